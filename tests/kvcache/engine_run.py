"""One engine process for the cross-process tests: asks one long document, prints JSON.

python -m tests.kvcache.engine_run '{"extra": {...}, "seed": 0}'

Optional keys: "doc" (token ids instead of a generated document), "asks" (how many
times, with the prefix cache reset and the tier flushed in between), "fsize_limit"
(RLIMIT_FSIZE in bytes for this process, with SIGXFSZ ignored so a write past it
fails with EFBIG instead of killing the process).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    spec = json.loads(sys.argv[1])
    if "fsize_limit" in spec:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_limit"], spec["fsize_limit"]))

    from kvserve.benchmarks.kvcache import make_document_ids
    from kvserve.entrypoints.llm import LLM
    from kvserve.kvcache.builder import CacheEngineBuilder
    from kvserve.sampling_params import SamplingParams

    llm = LLM(
        kv_cache_memory=128 << 20,
        kv_transfer_config={
            "kv_connector": "TieredCacheConnector",
            "kv_connector_extra_config": spec["extra"],
        },
    )
    ids = spec.get("doc") or make_document_ids(
        llm.get_tokenizer(), spec.get("num_tokens", 2000), spec.get("seed", 0)
    )
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0)
    engine, *_ = CacheEngineBuilder.live()
    asks = []
    for i in range(spec.get("asks", 1)):
        if i:
            engine.flush()
            llm.reset_prefix_cache()
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        asks.append(
            {"tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens}
        )
    engine.flush()
    stats = engine.stats.snapshot()
    llm.llm_engine.shutdown()
    result = {**asks[-1], "asks": asks, "tiers": stats["tiers"]}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
