"""SharedStorageConnector under pipeline and tensor parallelism: TP=2 x PP=2 (four mp
workers, the batch queue on, as by default) on a tiny random Llama with 2 KV heads, one
decoder layer per stage and one KV head per TP rank. Each rank stores its own head of its
own layer in its own entry (<key>.tp<rank>-of-2.pp<stage>-of-2); after the prefix cache
is dropped the same prompts load every rank's part, two micro-batches in flight, and give
transformers' greedy tokens. A part missing on TP rank 1 of stage 0 only (neither in the
last stage nor its first TP rank, the one the scheduler hears from) makes every rank
recompute."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from kvserve.distributed.kv_transfer.kv_connector.connectors.shared_storage import prefix_keys
from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.distributed.kv_transfer.helpers import core_of, entries, shared_storage
from tests.entrypoints.test_llm_tiny_models import build_model, hf_greedy
from tests.reference import assert_no_leak

pytestmark = pytest.mark.slow

TP = 2
PP = 2
BLOCK = 4
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def test_tp2_pp2_ranks_store_and_load_their_own_parts(tmp_path: Path) -> None:
    reference = build_model("llama", tmp_path / "model")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, reference.config.vocab_size) for _ in range(27)] for _ in "ab"]
    expected = [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]
    storage = tmp_path / "kv"
    llm = LLM(
        str(tmp_path / "model"), tensor_parallel_size=TP, pipeline_parallel_size=PP,
        distributed_executor_backend="mp", block_size=BLOCK, kv_cache_memory=8 << 20, kv_transfer_config=shared_storage(storage),
    )  # fmt: skip
    try:
        core = core_of(llm)
        assert core.model_executor.max_concurrent_batches == PP  # the batch queue runs
        layers = core.model_executor.collective_rpc("tests.executor.rpc_functions:own_kv_layers")
        assert layers == [1] * TP * PP  # rank = stage * TP + tp rank
        written = _generate(llm, prompts)
        assert [list(o.outputs[0].token_ids) for o in written] == expected
        # Two prompts x four ranks, each entry holding its rank's one layer and one head.
        stored = sorted(entries(storage))
        parts = sorted(name.split(".", 1)[1] for name in stored)
        assert parts == sorted(
            f"tp{t}-of-{TP}.pp{p}-of-{PP}" for t in range(TP) for p in range(PP) for _ in "ab"
        )
        for name in stored:
            [layer_file] = (storage / name).iterdir()
            with safe_open(str(layer_file), framework="pt") as f:
                assert f.get_tensor("kv").shape[:4] == (2, 6, BLOCK, 1)

        # Rank (tp 1, stage 0) loses its part of the second prompt: only the last stage's
        # first TP rank reports to the scheduler, so all ranks must agree the load failed.
        connector = core.scheduler.connector
        *_, key = prefix_keys(prompts[1][: 6 * BLOCK], BLOCK, connector._request_salt(None))
        victim = Path(connector._entry_dir(key, (1, 0)))
        next(victim.iterdir()).unlink()
        assert llm.reset_prefix_cache()
        loaded = _generate(llm, prompts)
        assert [list(o.outputs[0].token_ids) for o in loaded] == expected
        assert loaded[0].num_cached_tokens == 6 * BLOCK  # every rank's part of 6 blocks
        assert loaded[1].num_cached_tokens == 0  # rolled back and recomputed
        assert_no_leak(llm)
    finally:
        llm.llm_engine.shutdown()
