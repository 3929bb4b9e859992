"""Gemma 3 through the native decode stack (csrc/decode_stack.cpp, its fused step in
csrc/decode_step.cpp): (1 + w) norms in the sandwich scheme, per-head q/k norms,
GELU(tanh), sliding-window and global layers with their own RoPE tables.

Against the module path the comparisons are exact (the same kernels in the same order);
against HF transformers the greedy tokens must be equal.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedModel

from kvserve.model_executor.model_loader import get_model
from kvserve.transformers_utils.arch_config import load_arch_config
from kvserve.transformers_utils.model_resolver import resolve_model
from tests.kernel_support import require_kernels
from tests.model_executor.test_llama_decode_stack import _decode_run, _load

require_kernels()

VOCAB = 256


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    """Window 4 (prompts and decodes cross it), a global layer with linearly scaled RoPE
    between two sliding ones, a final logit soft-cap, random norm weights."""
    torch.manual_seed(3)
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=4,
        query_pre_attn_scalar=24,
        final_logit_softcapping=3.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.1,
    )
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():  # HF starts Gemma norms at zero (scale 1); make them matter
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("tiny_gemma3")
    model.save_pretrained(path)
    return path, model.eval()


@pytest.mark.parametrize(
    ("quantization", "int8", "num_requests"),
    [
        (None, False, 3),  # float32 weights: the per-op path
        ("q4_1", False, 1),  # block weights, float activations: the fused step
        ("q4_1", False, 8),
        ("q4_1", False, 12),  # over 8 rows: the per-op path on block weights
        ("q8_0", True, 3),  # int8 activations (fused with AVX-512 VNNI's packed copy)
    ],
)
def test_gemma3_decode_steps_equal_the_module_path_exactly(
    quantization: str | None,
    int8: bool,
    num_requests: int,
    tiny_gemma3: tuple[Path, PreTrainedModel],
    paged_runner: Callable,
) -> None:
    path, _ = tiny_gemma3
    native = _load(path, quantization, int8)
    modules = _load(path, quantization, int8)
    modules.model.decode_stack = None

    got = _decode_run(paged_runner, native, num_requests)
    want = _decode_run(paged_runner, modules, num_requests)
    stack = native.model.decode_stack
    assert stack._stack is not None and stack.applies_final_norm  # the decode steps took it
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step} differs"


@torch.no_grad()
def test_gemma3_decode_stack_greedy_matches_hf(
    tiny_gemma3: tuple[Path, PreTrainedModel], paged_runner: Callable
) -> None:
    path, hf = tiny_gemma3
    model = _load(path)
    runner = paged_runner(model, block_size=4)
    torch.manual_seed(11)
    prompts = {f"r{i}": torch.randint(3, VOCAB, (n,)).tolist() for i, n in enumerate((9, 5, 13))}
    logits = runner.step(list(prompts.items()))
    tokens = {r: [int(lg[-1].argmax())] for r, lg in zip(prompts, logits, strict=True)}
    for _ in range(11):  # batched decode steps, through the stack
        logits = runner.step([(r, t[-1:]) for r, t in tokens.items()])
        for r, lg in zip(prompts, logits, strict=True):
            tokens[r].append(int(lg[-1].argmax()))
    assert model.model.decode_stack._stack is not None
    for r, prompt in prompts.items():
        want = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
        assert tokens[r] == want, r


def _count_stack_steps(worker: Any) -> None:
    """Wraps the worker's decode stack so its taken steps are counted on the model."""
    stack = worker.model_runner.model.model.decode_stack
    forward = stack.forward

    def counted(hidden: torch.Tensor, positions: torch.Tensor) -> Any:
        out = forward(hidden, positions)
        stack.taken_steps = getattr(stack, "taken_steps", 0) + (out is not None)
        return out

    stack.forward = counted


def _drop_stack(worker: Any) -> None:
    worker.model_runner.model.model.decode_stack = None


@pytest.mark.parametrize("quantization", [None, "q8_0"])
def test_gemma3_engine_decodes_through_the_stack_with_hybrid_kv_groups(
    quantization: str | None, tiny_gemma3: tuple[Path, PreTrainedModel]
) -> None:
    """Through the engine the sliding-window and global layers are two KV cache groups
    (their own block tables and slots): the stack takes every decode step (per-op path
    on float32 weights, the fused step on q8_0 blocks). Float32: HF's greedy tokens;
    q8_0 (lossy): the same tokens as the engine without the stack."""
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams

    path, hf = tiny_gemma3
    llm = LLM(
        str(path), skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16,
        quantization=quantization, enable_prefix_caching=False,
    )  # fmt: skip
    try:
        llm.collective_rpc(_count_stack_steps)
        torch.manual_seed(12)
        prompts = [
            {"prompt_token_ids": torch.randint(3, VOCAB, (n,)).tolist()} for n in (10, 6, 19)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        taken = llm.collective_rpc(
            lambda w: getattr(w.model_runner.model.model.decode_stack, "taken_steps", 0)
        )
        assert taken[0] >= 9, taken
        if quantization is None:
            with torch.no_grad():
                want = [
                    hf.generate(
                        torch.tensor([p["prompt_token_ids"]]), max_new_tokens=10,
                        min_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0,
                    )[0, len(p["prompt_token_ids"]):].tolist()
                    for p in prompts
                ]  # fmt: skip
        else:
            llm.collective_rpc(_drop_stack)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            want = [list(o.outputs[0].token_ids) for o in outputs]
        assert got == want
    finally:
        llm.llm_engine.shutdown()


def test_gemma3_config_attention_soft_cap_is_ignored(
    tmp_path: Path, tiny_gemma3: tuple[Path, PreTrainedModel], paged_runner: Callable
) -> None:
    """HF's Gemma 3 never soft-caps attention scores whatever its config says, so neither
    do the modules, and the fused decode step (which has no soft-cap) still applies."""
    _, hf = tiny_gemma3
    hf.config.attn_logit_softcapping = 2.0
    try:
        hf.save_pretrained(tmp_path)
    finally:
        hf.config.attn_logit_softcapping = None
    model = _load(tmp_path)
    runner = paged_runner(model, block_size=4)
    runner.step([("a", [5, 6, 7])])
    runner.step([("a", [8])])
    assert model.model.decode_stack._stack is not None


@pytest.mark.slow
@torch.no_grad()
def test_gemma3_270m_gguf_decode_equals_the_module_path(paged_runner: Callable) -> None:
    """The packaged Gemma 3 270M with the engine's default lossless GGUF blocks (so the
    fused step): the same logits bit for bit, hence the same greedy tokens, as the
    modules, for two requests side by side."""
    from tests.gemma3_fixtures import GEMMA3

    resolved = resolve_model(GEMMA3)
    arch = load_arch_config(resolved)
    runs = []
    for use_stack in (True, False):
        model = get_model(resolved, arch, quantization="gguf")
        if not use_stack:
            model.model.decode_stack = None
        runner = paged_runner(model, block_size=16, num_blocks=16)
        prompts = {"a": [2, *range(1000, 1040)], "b": [2, 818, 5279, 529, 7001, 563]}
        logits = runner.step(list(prompts.items()))
        tokens = {r: [int(lg[-1].argmax())] for r, lg in zip(prompts, logits, strict=True)}
        steps = []
        for _ in range(12):
            logits = runner.step([(r, t[-1:]) for r, t in tokens.items()])
            steps.append(torch.cat(logits))
            for r, lg in zip(prompts, logits, strict=True):
                tokens[r].append(int(lg[-1].argmax()))
        if use_stack:
            assert model.model.decode_stack._stack is not None
            assert all(layer.mlp.down_proj.quant_weight is not None for layer in model.model.layers)
        runs.append((tokens, steps))
        del model, runner
    (got_tokens, got), (want_tokens, want) = runs
    assert got_tokens == want_tokens
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step} differs"


FAMILY_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.1,
}


@pytest.fixture(scope="module")
def family_checkpoints() -> dict[str, Path]:
    """Tiny random checkpoints by family, built on first use (see _family_path)."""
    return {}


def _family_path(kind: str, checkpoints: dict[str, Path], factory: pytest.TempPathFactory) -> Path:
    """Qwen3 (q/k norms, random norm weights), Phi-3 (fused checkpoint projections),
    Mistral (every layer sliding, window 4)."""
    import transformers as tf

    if kind not in checkpoints:
        torch.manual_seed(4)
        if kind == "qwen3":
            model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**FAMILY_COMMON, head_dim=16))
            with torch.no_grad():  # HF starts norms at one; make the q/k norms matter
                for name, param in model.named_parameters():
                    if name.endswith("norm.weight"):
                        param.normal_(1.0, 0.3)
        elif kind == "phi3":
            model = tf.Phi3ForCausalLM(tf.Phi3Config(**FAMILY_COMMON, pad_token_id=0))
        else:
            model = tf.MistralForCausalLM(tf.MistralConfig(**FAMILY_COMMON, sliding_window=4))
        path = factory.mktemp(kind)
        model.save_pretrained(path)
        checkpoints[kind] = path
    return checkpoints[kind]


@pytest.mark.parametrize("quantization", [None, "q4_1"])
@pytest.mark.parametrize("kind", ["qwen3", "phi3", "mistral"])
def test_family_decode_steps_equal_the_module_path_exactly(
    kind: str,
    quantization: str | None,
    family_checkpoints: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
    paged_runner: Callable,
) -> None:
    """Qwen3's q/k norms (RMSNorm weights), Phi-3's and Mistral's shapes through the same
    stack: float32 weights (per-op path) and block weights (the fused step)."""
    path = _family_path(kind, family_checkpoints, tmp_path_factory)
    native = _load(path, quantization)
    modules = _load(path, quantization)
    modules.model.decode_stack = None

    got = _decode_run(paged_runner, native, 3)
    want = _decode_run(paged_runner, modules, 3)
    assert native.model.decode_stack._stack is not None
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step} differs"
