"""Session-wide fixtures: the real default model, loaded once, and the HF reference."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import xdist_groups
from tests.engine_cache import EngineCache, engine_cache

# Gemma 3 270M's engine and HF reference, shared session-wide by the tests that use them.
pytest_plugins = ["tests.gemma3_fixtures"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every engine a test starts (and every process it spawns) authenticates the KV it shares:
# tiers across processes, shared storage and P2P refuse to start without a secret, and the
# secure path is the one tested. Tests of the opt-out and of the refusal unset it.
os.environ.setdefault("KVSERVE_KV_SECRET", "kvserve-tests-kv-secret-0123456789")
# Without a GPU, Triton kernels (the TRITON attention backend's) run only interpreted, a
# mode Triton reads once, at its import: set it before anything imports triton. A CUDA
# machine (its driver's control device present) compiles them instead.
if "triton" not in sys.modules and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    # kvserve's own cache (converted tokenizers) lives in pytest's cache directory, kept
    # between runs (every later run, and each server process a test starts, skips the
    # conversion) but never in the real home. Tests of the cache use tmp_path instead.
    if getattr(config, "cache", None) is not None:
        os.environ.setdefault("KVSERVE_HOME", str(config.cache.mkdir("kvserve")))
        # The process that sees every test's report: xdist's controller, or a serial run.
        if not hasattr(config, "workerinput"):
            config.pluginmanager.register(xdist_groups.DurationRecorder(config))


# `make test-fast` runs `pytest -m "not e2e"`: the unit and component tests, in a few
# minutes on a 2-core machine; `make test` (what CI runs) runs these too. A module is here
# when, in a full run on a 2-core AMD EPYC (afbfd3b, 34.6 min of pytest), its tests took
# 5 s or more together and 1 s or more each on average: they start servers, engine-core,
# worker or peer processes, or run real models end to end. Modules of many cheap tests
# behind one slower fixture stay in the fast tier. A test marked `slow` is e2e as well.
# Paths are relative to tests/; a path that no longer exists marks nothing.
E2E_MODULES = frozenset(
    {
        "attention/test_cascade.py",
        "attention/test_triton_attn_e2e.py",
        "benchmarks/test_cascade.py",
        "benchmarks/test_peers.py",
        "benchmarks/test_soak.py",
        "benchmarks/test_startup.py",
        "core/sched/test_grammar_tracker.py",
        "core/test_hybrid_kv_cache_gemma3.py",
        "distributed/kv_transfer/test_async_multi_e2e.py",
        "distributed/kv_transfer/test_hybrid_connectors_gemma3.py",
        "distributed/kv_transfer/test_p2p_zmq.py",
        "distributed/kv_transfer/test_p2p_zmq_tp.py",
        "distributed/kv_transfer/test_shared_storage_e2e.py",
        "distributed/kv_transfer/test_shared_storage_mla.py",
        "distributed/kv_transfer/test_shared_storage_tp.py",
        "distributed/kv_transfer/test_shared_storage_tp_pp.py",
        "distributed/test_ec_connector.py",
        "distributed/test_expert_parallel.py",
        "distributed/test_kv_events_engine.py",
        "distributed/test_parallel_state.py",
        "engine/test_async_llm.py",
        "engine/test_data_parallel.py",
        "engine/test_dp_ray.py",
        "engine_core/test_core_isolation.py",
        "engine_core/test_core_proc.py",
        "entrypoints/disagg/test_launcher_e2e.py",
        "entrypoints/disagg/test_proxy_e2e.py",
        "entrypoints/openai/test_admission.py",
        "entrypoints/openai/test_auth_and_engine_death.py",
        "entrypoints/openai/test_bench_serve.py",
        "entrypoints/openai/test_concurrency.py",
        "entrypoints/openai/test_schemathesis.py",
        "entrypoints/openai/test_serve_data_parallel.py",
        "entrypoints/openai/test_serve_expert_parallel.py",
        "entrypoints/openai/test_serve_tensor_parallel.py",
        "entrypoints/openai/test_serving_embedding.py",
        "entrypoints/openai/test_serving_lora.py",
        "entrypoints/openai/test_serving_multimodal.py",
        "entrypoints/openai/test_serving_responses.py",
        "entrypoints/openai/test_sleep_mode.py",
        "entrypoints/openai/test_spec_decode_serving.py",
        "entrypoints/openai/test_structured_outputs.py",
        "entrypoints/router/test_router_e2e.py",
        "entrypoints/test_cli.py",
        "entrypoints/test_llm_correctness.py",
        "entrypoints/test_llm_logprobs.py",
        "entrypoints/test_llm_sampling.py",
        "entrypoints/test_llm_sleep.py",
        "entrypoints/web/test_pages_in_chromium.py",
        "executor/test_multiproc_executor.py",
        "executor/test_ray_executor.py",
        "executor/test_serial_utils.py",
        "executor/test_tensor_parallel_families.py",
        "executor/test_tensor_parallel_smollm2.py",
        "kvcache/test_cache_server.py",
        "kvcache/test_faults.py",
        "kvcache/test_tiered_connector_e2e.py",
        "kvcache/test_tiered_connector_pp.py",
        "kvcache/test_tiered_connector_tp.py",
        "kvcache/test_tiered_metrics_serving.py",
        "model_executor/models/test_registry.py",
        "model_executor/test_gemma3.py",
        "model_executor/test_gguf_loader.py",
        "model_executor/test_gguf_repack.py",
        "spec_decode/test_spec_decode_greedy.py",
        "structured_output/test_constrained_generation.py",
        "worker/test_attention_sinks.py",
        "worker/test_thread_governor.py",
    }
)
_TESTS_ROOT = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.relative_to(_TESTS_ROOT).as_posix()
        if module in E2E_MODULES or item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.e2e)
        xdist_groups.check_shared_fixture_groups(item, module)


# Optional: a serial run with xdist left out (`-p no:xdist`) has no such hook.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Whole modules (and modules sharing a costly fixture) per worker: tests/xdist_groups.py."""
    if config.getvalue("dist") in ("load", "loadscope", "loadgroup"):
        return xdist_groups.make_scheduler(config, log)
    return None


# Small enough that several engines fit in memory side by side during the suite.
TEST_KV_CACHE_MEMORY = 128 << 20


@pytest.fixture(scope="module", autouse=True)
def _release_module_engines() -> Iterator[None]:
    yield
    for cache in EngineCache.live:
        cache.release()


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    """A module that leaves torch's thread count changed (an in-process data-parallel
    engine core takes its share of the cores) must not hand it to the next module: the
    engines built there would run another thread count than the same tests run alone."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def llm_factory() -> Iterator[EngineCache]:
    """Builds LLM instances for the real default model, one per distinct configuration."""
    yield from engine_cache(kv_cache_memory=TEST_KV_CACHE_MEMORY)


@pytest.fixture(scope="session")
def llm(llm_factory: EngineCache) -> Any:
    """The default engine configuration (prefix caching on, chunked prefill on)."""
    return llm_factory.pin()
