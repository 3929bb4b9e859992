"""The native decode stack (csrc/decode_stack.cpp, and its fused step in
csrc/decode_step.cpp) against the per-layer module path.

All run the same kernels in the same order, so every comparison here is exact: the
stack is only a faster way to make the same calls.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvserve import _custom_ops as ops
from kvserve.attention.backends.registry import get_attn_backend
from kvserve.attention.backends.utils import make_common_attn_metadata
from kvserve.benchmarks.random_gguf import MIXES, LlamaShape, ensure_random_gguf
from kvserve.forward_context import set_forward_context
from kvserve.model_executor.layers.block_weight import (
    BlockWeight,
    LinearBlocks,
    MixedBlockWeight,
    concat_rows,
)
from kvserve.model_executor.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
)
from kvserve.model_executor.layers.quantization import quantize_model
from kvserve.model_executor.model_loader import get_model
from kvserve.transformers_utils.arch_config import load_arch_config
from kvserve.transformers_utils.model_resolver import resolve_model
from tests.kernel_support import require_kernels

require_kernels()


def _load(path: Path, quantization: str | None = None, int8: bool = False) -> torch.nn.Module:
    resolved = resolve_model(str(path))
    arch = load_arch_config(resolved)
    model = get_model(resolved, arch)
    if quantization == "q4_1":  # GGUF files' type, as the default gguf method runs it
        for module in model.modules():
            if isinstance(module, LinearBase):
                module.quant_weight = BlockWeight.quantize(module.weight, T.Q4_1)
    elif quantization in ("mixed", "mixed_prepared"):
        for module in model.modules():
            if isinstance(module, LinearBase):
                module.quant_weight = _mixed_blocks(module)
                if quantization == "mixed_prepared" or int8:
                    # the digit matmul's interleaved parts (AVX-512 VNNI), or gguf_int8's
                    module.quant_weight.prepare_kernels("gguf_int8" if int8 else "gguf")
    elif quantization is not None:
        quantize_model(model, quantization, None, arch)
        for module in model.modules():
            bw = getattr(module, "quant_weight", None)
            if bw is not None and int8:
                bw.use_int8_activations()  # with the interleaved copy on AVX-512 VNNI
    return model


def _mixed_blocks(module: LinearBase) -> LinearBlocks:
    """The fused layers' shards in two block types, as Llama Q4_K_M files' q/k (Q4_K)
    beside their v (Q6_K): here q/k and gate Q4_1, v and up Q8_0 (a MixedBlockWeight);
    the other layers Q4_1."""
    if isinstance(module, QKVParallelLinear):
        q, kv = module.num_heads * module.head_size, module.num_kv_heads * module.head_size
        sizes, types = [q, kv, kv], [T.Q4_1, T.Q4_1, T.Q8_0]
    elif isinstance(module, MergedColumnParallelLinear):
        sizes, types = module.output_sizes, [T.Q4_1, T.Q8_0]
    else:
        return BlockWeight.quantize(module.weight, T.Q4_1)
    shards = module.weight.split(sizes)
    return concat_rows([BlockWeight.quantize(w, t) for w, t in zip(shards, types, strict=True)])


def _decode_run(
    runner_cls: Callable, model: torch.nn.Module, num_requests: int = 3
) -> list[torch.Tensor]:
    """Prefill prompts of different lengths, then eight batched decode steps (the
    requests' lengths cross block boundaries at different steps)."""
    runner = runner_cls(model, block_size=4)
    torch.manual_seed(5)
    lengths = [5, 11, 2, 7, 3, 9, 4, 6, 1, 8, 10, 5][:num_requests]
    prompts = {f"r{i}": torch.randint(3, 256, (n,)).tolist() for i, n in enumerate(lengths)}
    logits = runner.step(list(prompts.items()))
    out = [torch.cat(logits)]
    last = {r: int(lg[-1].argmax()) for r, lg in zip(prompts, logits, strict=True)}
    for _ in range(8):
        logits = runner.step([(r, [last[r]]) for r in prompts])
        out.append(torch.cat(logits))
        last = {r: int(lg[-1].argmax()) for r, lg in zip(prompts, logits, strict=True)}
    return out


@pytest.mark.parametrize(
    ("which", "quantization", "int8", "num_requests"),
    [
        ("tiny_llama", None, False, 3),
        ("tiny_qwen2", None, False, 3),  # q/k/v biases
        # Block weights, float activations (the default gguf method): steps of up to 8
        # rows take the fused step, larger ones the per-op path.
        ("tiny_llama", "q8_0", False, 3),
        ("tiny_llama", "q4_1", False, 1),
        ("tiny_llama", "q4_1", False, 8),  # two GEMV passes: 6 rows, then 2
        ("tiny_llama", "q4_1", False, 12),
        ("tiny_qwen2", "q4_1", False, 2),
        # Fused layers whose shards differ in block type: one part after the other, the
        # float GEMV's rows of several through the thread's staging buffer, the digit
        # matmul's (mixed_prepared, AVX-512 VNNI) straight into the output's columns.
        ("tiny_llama", "mixed", False, 1),
        ("tiny_llama", "mixed", False, 3),
        ("tiny_qwen2", "mixed", False, 2),
        ("tiny_llama", "mixed_prepared", False, 1),
        ("tiny_llama", "mixed_prepared", False, 3),
        ("tiny_llama", "mixed", True, 3),
        # Block weights, int8 activations: with AVX-512 VNNI, steps of up to 8 rows take
        # the fused step (csrc/decode_step.cpp), larger ones the per-op path.
        ("tiny_llama", "q8_0", True, 1),
        ("tiny_llama", "q8_0", True, 3),
        ("tiny_llama", "q8_0", True, 12),
        ("tiny_qwen2", "q8_0", True, 2),
    ],
)
def test_decode_steps_equal_the_module_path_exactly(
    which: str,
    quantization: str | None,
    int8: bool,
    num_requests: int,
    request: pytest.FixtureRequest,
    paged_runner: Callable,
) -> None:
    path, _ = request.getfixturevalue(which)
    native = _load(path, quantization, int8)
    modules = _load(path, quantization, int8)
    modules.model.decode_stack = None

    got = _decode_run(paged_runner, native, num_requests)
    want = _decode_run(paged_runner, modules, num_requests)
    assert native.model.decode_stack._stack is not None  # the decode steps took it
    if quantization and quantization.startswith("mixed"):
        fused = native.model.layers[0].self_attn.qkv_proj.quant_weight
        assert isinstance(fused, MixedBlockWeight) and len(fused.parts) == 2
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step} differs"


# Q4_K_M at a shape k-quants fit (rows of 256, tests/benchmarks/test_random_gguf.py's):
# Q4_K everywhere but v and ffn_down in 4 of the 8 layers and the tied head, Q6_K.
TINY_K = LlamaShape("tiny-llama-k", 256, 8, 4, 2, 512, 49152 + 64, rope_scaling=None)


def _load_gguf(path: Path, method: str) -> torch.nn.Module:
    resolved = resolve_model(str(path))
    arch = load_arch_config(resolved)
    model = get_model(resolved, arch)
    quantize_model(model, method, str(resolved.path), arch)
    return model


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_random_gguf(TINY_K, tmp_path_factory.mktemp("random_gguf"), MIXES["Q4_K_M"])


@pytest.mark.parametrize(("method", "num_requests"), [("gguf", 1), ("gguf", 3), ("gguf_int8", 3)])
def test_q4_k_m_decode_steps_equal_the_module_path_exactly(
    method: str,
    num_requests: int,
    tiny_q4_k_m: Path,
    paged_runner: Callable,
) -> None:
    """A Q4_K_M file's blocks as loaded (on AVX-512 VNNI the digit matmul's kinds 13 and
    15, a fused projection's Q4_K q/k beside its Q6_K v; gguf_int8's k-quants too)."""
    native, modules = _load_gguf(tiny_q4_k_m, method), _load_gguf(tiny_q4_k_m, method)
    modules.model.decode_stack = None

    got = _decode_run(paged_runner, native, num_requests)
    want = _decode_run(paged_runner, modules, num_requests)
    assert native.model.decode_stack._stack is not None
    fused = native.model.layers[0].self_attn.qkv_proj.quant_weight
    assert isinstance(fused, MixedBlockWeight) and len(fused.parts) == 2
    if ops.exact_packed_matmul():  # AVX2 builds: Q4_K only; Q6_K's float32 scales (kind 4)
        six_bit = 15 in ops.exact_packed_kinds()
        assert [p.kind for p in fused.parts] == [13, 15 if six_bit else 4]
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step} differs"


def test_prefill_steps_and_kernel_fallbacks_take_the_modules(
    tiny_llama: tuple, paged_runner: Callable
) -> None:
    path, _ = tiny_llama
    model = _load(path)
    stack = model.model.decode_stack
    runner = paged_runner(model, block_size=4)
    runner.step([("a", [5, 6, 7])])
    assert stack._stack is None  # a prefill-only step never builds it
    # Mixed step: one decode row plus a prefill chunk.
    runner.step([("a", [8]), ("b", [9, 10])])
    assert stack._stack is None
    with ops.disabled():
        runner.step([("a", [11]), ("b", [12])])
    assert stack._stack is None
    runner.step([("a", [13]), ("b", [14])])
    assert stack._stack is not None


@torch.no_grad()
def test_padding_rows_past_the_actual_tokens_are_ignored(tiny_llama: tuple) -> None:
    from kvserve.attention.layer import allocate_kv_caches, bind_kv_cache

    path, _ = tiny_llama
    outputs = []
    for use_stack in (True, False):
        model = _load(path)
        if not use_stack:
            model.model.decode_stack = None
        bind_kv_cache(model, allocate_kv_caches(model, 16, 4, "cpu"))
        builder = get_attn_backend("cpu").get_builder_cls()(4, "cpu")
        prefill = make_common_attn_metadata([6], [0], [[3, 7]], 4)
        with set_forward_context(builder.build(prefill)):
            model(torch.arange(10, 16), torch.arange(6))
        # One real decode token (position 6, slot 7*4+2) and one padding row.
        decode = make_common_attn_metadata([1], [6], [[3, 7]], 4)
        with set_forward_context(builder.build(decode)):
            hidden = model(torch.tensor([20, 0]), torch.tensor([6, 0]))
        outputs.append(hidden)
    assert torch.equal(outputs[0][:1], outputs[1][:1])


@pytest.mark.parametrize("num_requests", [1, 2])
def test_long_contexts_split_k_in_the_fused_step_as_in_the_op(
    num_requests: int, tiny_llama: tuple, paged_runner: Callable
) -> None:
    """Contexts long enough for the decode attention's split-K: the fused step runs the
    partitions (and their merges) on its own threads, the modules' op through
    at::parallel_for; the partitions are the same, so the logits are too, bit for bit."""
    path, _ = tiny_llama
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert ops.decode_attention_partitions(600) > 1
        runs = []
        for use_stack in (True, False):
            model = _load(path, "q4_1")
            if not use_stack:
                model.model.decode_stack = None
            runner = paged_runner(model, block_size=16, num_blocks=2 * 40)
            torch.manual_seed(11)
            prompts = {f"r{i}": torch.randint(3, 256, (600 - 90 * i,)).tolist()
                       for i in range(num_requests)}  # fmt: skip
            last = {r: int(lg[-1].argmax()) for r, lg in zip(prompts, runner.step(list(prompts.items())), strict=True)}  # fmt: skip
            steps = []
            for _ in range(3):
                logits = runner.step([(r, [last[r]]) for r in prompts])
                steps.append(torch.cat(logits))
                last = {r: int(lg[-1].argmax()) for r, lg in zip(prompts, logits, strict=True)}
            if use_stack:
                assert model.model.decode_stack._stack is not None
            runs.append(steps)
    finally:
        torch.set_num_threads(before)
    for step, (g, w) in enumerate(zip(*runs, strict=True)):
        assert torch.equal(g, w), f"step {step} differs"


@pytest.mark.parametrize(("quantization", "int8"), [("q4_1", False), ("q8_0", True)])
def test_a_long_requests_logits_follow_neither_threads_nor_batch(
    quantization: str, int8: bool, tiny_llama: tuple, paged_runner: Callable
) -> None:
    """A context long enough for split-K, prefilled and decoded on one thread, on two, or
    on a random count per step (torch.set_num_threads between steps, as the runner's
    thread governor does): its logits are the same bit for bit, in the lossless block
    path and with int8 activations; with int8 activations also beside two other requests
    (gguf_int8's batch invariance). The partitions follow the request's own context, so
    nothing in its attention follows the threads or the batch."""
    path, _ = tiny_llama
    torch.manual_seed(3)
    prompt = torch.randint(3, 256, (700,)).tolist()
    others = {"a": [5, 6, 7], "b": list(range(3, 40))}
    follow = [11, 12, 13, 14]
    assert ops.decode_attention_partitions(len(prompt)) > 1
    rng = random.Random(1)
    mixed = [rng.choice((1, 2)) for _ in range(len(follow) + 1)]
    assert set(mixed) == {1, 2}

    def logits(threads: list[int], beside: bool) -> list[torch.Tensor]:
        model = _load(path, quantization, int8)
        runner = paged_runner(model, block_size=16, num_blocks=64)
        torch.set_num_threads(threads[0])
        runner.step([("r0", prompt)])
        if beside:
            for r, tokens in others.items():
                runner.step([(r, tokens)])
        steps = []
        for step, token in enumerate(follow):
            torch.set_num_threads(threads[step + 1])
            batch = [("r0", [token])] + ([(r, [token]) for r in others] if beside else [])
            steps.append(runner.step(batch)[0])
        assert model.model.decode_stack._stack is not None  # the fused decode step ran
        return steps

    before = torch.get_num_threads()
    try:
        want = logits([1] * len(mixed), beside=False)
        runs = [([2] * len(mixed), False), (mixed, False)] + ([(mixed, True)] if int8 else [])
        for threads, beside in runs:
            got = logits(threads, beside)
            for step, (g, w) in enumerate(zip(got, want, strict=True)):
                assert torch.equal(g, w), f"step {step} differs ({threads}, beside={beside})"
    finally:
        torch.set_num_threads(before)
