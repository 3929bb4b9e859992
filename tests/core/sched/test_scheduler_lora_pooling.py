"""The scheduler's parts of LoRA (at most max_loras adapters running, adapter ids in the
block hashes) and of pooling (a request ends with its pooled vector)."""

from __future__ import annotations

from kvserve.config import LoRAConfig, SchedulerConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_cache_utils import get_request_block_hasher
from kvserve.core.request import Request
from kvserve.core.sched.scheduler import Scheduler
from kvserve.lora.request import LoRARequest
from kvserve.protocol.engine_core import FinishReason
from kvserve.protocol.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvserve.sampling_params import SamplingParams
from tests.core.sched.driver import BS, Driver

ALPHA, BETA = LoRARequest("alpha", 1, "/a"), LoRARequest("beta", 2, "/b")


def _request(rid: str, prompt: list[int], lora: LoRARequest | None) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=4),
        eos_token_id=None,
        block_hasher=get_request_block_hasher(BS, 0),
        lora_request=lora,
    )


def _driver(max_loras: int) -> Driver:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8)
    kv_config = KVCacheConfig(100, [KVCacheGroupSpec(["layers.0.attn"], spec)])
    manager = KVCacheManager(
        kv_config, 256, enable_caching=True, log_stats=True, max_num_batched_tokens=64
    )
    return Driver(
        Scheduler(
            SchedulerConfig(max_num_batched_tokens=64, max_model_len=256),
            manager,
            lora_config=LoRAConfig(max_loras=max_loras),
        )
    )


def test_adapter_id_enters_every_block_hash() -> None:
    prompt = list(range(12))
    base, alpha = _request("a", prompt, None), _request("b", prompt, ALPHA)
    alpha_again, beta = _request("c", prompt, ALPHA), _request("d", prompt, BETA)
    assert len(base.block_hashes) == 3
    assert all(x != y for x, y in zip(base.block_hashes, alpha.block_hashes, strict=True))
    assert all(x != y for x, y in zip(alpha.block_hashes, beta.block_hashes, strict=True))
    assert alpha.block_hashes == alpha_again.block_hashes


def test_at_most_max_loras_adapters_run_at_once() -> None:
    driver = _driver(max_loras=1)
    driver.add(
        _request("alpha-1", list(range(8)), ALPHA),
        _request("beta-1", list(range(8)), BETA),
        _request("base-1", list(range(8)), None),
        _request("alpha-2", list(range(8)), ALPHA),
    )
    seen: list[set[str]] = []
    while driver.scheduler.requests:
        out, _ = driver.step()
        running = {r.lora_request.lora_name for r in driver.scheduler.running if r.lora_request}
        assert len(running) <= 1
        seen.append(set(out.num_scheduled_tokens))
    assert {"alpha-1", "alpha-2", "base-1"} <= seen[0] and "beta-1" not in seen[0]
    assert any("beta-1" in step for step in seen)


def test_pooled_request_finishes_with_its_vector() -> None:
    driver = _driver(max_loras=1)
    driver.add(_request("p", list(range(6)), None))
    out, outputs = driver.step(pooler_output={"p": [0.6, 0.8]})
    assert out.num_scheduled_tokens == {"p": 6}
    (final,) = outputs.outputs
    assert final.finish_reason == FinishReason.STOP and final.pooling_output == [0.6, 0.8]
    assert final.new_token_ids == []
    assert not driver.scheduler.requests
