"""One engine process for the cross-process tests: asks one long document, prints JSON.

python -m tests.kvcache.engine_run '{"extra": {...}, "seed": 0}'
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    from kvserve.benchmarks.kvcache import make_document_ids
    from kvserve.entrypoints.llm import LLM
    from kvserve.kvcache.builder import CacheEngineBuilder
    from kvserve.sampling_params import SamplingParams

    spec = json.loads(sys.argv[1])
    llm = LLM(
        kv_cache_memory=128 << 20,
        kv_transfer_config={
            "kv_connector": "TieredCacheConnector",
            "kv_connector_extra_config": spec["extra"],
        },
    )
    ids = make_document_ids(llm.get_tokenizer(), spec.get("num_tokens", 2000), spec.get("seed", 0))
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    (engine, _), *_ = CacheEngineBuilder._engines.values()
    stats = engine.stats.snapshot()
    llm.llm_engine.shutdown()
    result = {
        "tokens": list(out.outputs[0].token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "tiers": stats["tiers"],
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
