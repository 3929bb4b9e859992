"""One engine process for the encoder cache connector test: generates for one image of
the tiny Gemma 3 VLM and prints its tokens and multimodal counters as JSON.

python -m tests.distributed.ec_engine_run '{"model": DIR, "ec": {...}, "seed": 1}'
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    spec = json.loads(sys.argv[1])
    from kvserve.entrypoints.llm import LLM
    from kvserve.metrics.reader import Counter
    from kvserve.sampling_params import SamplingParams
    from tests.multimodal.gemma3_mm_model import random_image

    llm = LLM(
        model=spec["model"],
        kv_cache_memory=16 << 20,
        max_num_batched_tokens=96,
        disable_log_stats=False,
        ec_transfer_config=spec["ec"],
    )
    prompt = {
        "prompt": "<bos>Look: <start_of_image> what?",
        "multi_modal_data": {"image": [random_image(spec["seed"], 64, 24)]},
    }
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    counters = {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter)}
    llm.llm_engine.shutdown()
    result = {
        "tokens": list(out.outputs[0].token_ids),
        **{k.removeprefix("kvserve:mm_"): v for k, v in counters.items() if "mm_" in k},
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
