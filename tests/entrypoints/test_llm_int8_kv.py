"""--kv-cache-dtype int8 end to end on a tiny random Llama (head_dim 64, SmolLM2's):
greedy agreement with the float cache, exactness within the int8 path across prefix
caching and chunked prefill, no leaked blocks, and the pool's tokens per byte."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import _custom_ops as ops
from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.reference import assert_no_leak

pytestmark = pytest.mark.e2e
MAX_TOKENS = 16
KV_MEMORY = 4 << 20
# Long enough that a 16-token budget chunks them and blocks of 4 are shared.
PROMPTS = [
    [5, 17, 99, 3, 42, 7, 61, 18, 200, 11, 64, 128, 9, 31, 77, 250, 4, 90, 33, 12],
    [5, 17, 99, 3, 42, 7, 61, 18, 13, 150, 8, 8, 91, 240],
    [8, 140, 6],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=256,
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    path = tmp_path_factory.mktemp("int8kv") / "hf"
    LlamaForCausalLM(config).float().eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def engines(model_dir: str) -> Iterator[dict[str, LLM]]:
    made: dict[str, LLM] = {}

    def make(name: str, **kwargs: Any) -> LLM:
        made[name] = LLM(
            model_dir, skip_tokenizer_init=True, block_size=4, kv_cache_memory=KV_MEMORY, **kwargs
        )
        return made[name]

    make("float32")
    make("float16", kv_cache_dtype="float16")
    # Prefix caching on, prompts chunked at 16 tokens (the int8 path's every feature).
    make("int8", kv_cache_dtype="int8", max_num_batched_tokens=16)
    # Neither: each prompt in one step, nothing reused.
    make("int8-plain", kv_cache_dtype="fp8", enable_prefix_caching=False,
         enable_chunked_prefill=False, max_num_batched_tokens=256)  # fmt: skip
    yield made
    for llm in made.values():
        llm.llm_engine.shutdown()


def greedy(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _runner(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner


def test_int8_cache_tensors_and_tokens_per_byte(engines: dict[str, LLM]) -> None:
    """The managers' pool: int8 rows (64 values + a 2-byte scale) hold 128/66 = 1.94x
    float16's tokens and 3.88x float32's in the same bytes."""
    assert {t.dtype for t in _runner(engines["int8"]).kv_caches.values()} == {torch.int8}
    blocks = {
        name: llm.llm_engine.engine_core.engine_core.kv_cache_config.num_blocks
        for name, llm in engines.items()
    }
    assert blocks["int8"] == blocks["int8-plain"]
    assert blocks["int8"] / blocks["float16"] >= 1.9
    assert blocks["int8"] / blocks["float32"] >= 3.8


def forced_logprobs(llm: LLM, continuations: list[list[int]]) -> list[float]:
    """Each continuation token's logprob with the continuation fed as the prompt."""
    outs = llm.generate(
        [{"prompt_token_ids": p + c} for p, c in zip(PROMPTS, continuations, strict=True)],
        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False,
    )  # fmt: skip
    return [
        out.prompt_logprobs[len(prompt) + step][token].logprob
        for prompt, cont, out in zip(PROMPTS, continuations, outs, strict=True)
        for step, token in enumerate(cont)
    ]


def test_int8_agrees_with_the_float_cache(engines: dict[str, LLM]) -> None:
    """A random tiny model's next-token distribution is nearly flat (256 tokens, top-2
    gaps of hundredths of a nat), so free-running continuations part at the first near
    tie; what is asserted is the size of int8's effect. Fed float32's continuation, the
    chosen tokens' logprobs move by < 0.1 nats (measured: mean 0.012, max 0.047; float16's
    mean 0.0004, max 0.0014), and the first 3 tokens of every prompt are float32's (measured: the first
    difference comes at token 3-11, float16's never within 16)."""
    want = greedy(engines["float32"])
    got = greedy(engines["int8"])
    for w, g in zip(want, got, strict=True):
        assert g[:3] == w[:3], (w, g)
    ref = torch.tensor(forced_logprobs(engines["float32"], want))
    delta = (torch.tensor(forced_logprobs(engines["int8"], want)) - ref).abs()
    delta16 = (torch.tensor(forced_logprobs(engines["float16"], want)) - ref).abs()
    print(f"int8 |dlogprob| mean {delta.mean():.4f} max {delta.max():.4f}; "
          f"float16 mean {delta16.mean():.5f} max {delta16.max():.5f}")  # fmt: skip
    assert delta.max() < 0.1
    assert delta16.max() <= delta.max()
    assert_no_leak(engines["int8"])


def test_prefix_caching_and_chunked_prefill_are_exact_within_int8(
    engines: dict[str, LLM],
) -> None:
    """A row's int8 values depend on that row only, so reusing cached blocks and chunking
    the prompt change nothing the attention reads: tokens equal the plain int8 engine's,
    the second (prefix-cached) run's equal the first's."""
    plain = greedy(engines["int8-plain"])
    first = greedy(engines["int8"])
    again = greedy(engines["int8"])
    assert first == plain
    assert again == plain
    for name in ("int8", "int8-plain"):
        assert_no_leak(engines[name])


def test_fused_decode_stack_declines_int8(engines: dict[str, LLM]) -> None:
    """The C++ decode stack reads float caches: with int8 it declines (the layers run
    one by one through the int8 decode kernel) where the float engine's runs."""
    stacks = {
        name: [m.decode_stack for m in _runner(engines[name]).model.modules()
               if getattr(m, "decode_stack", None) is not None]
        for name in ("int8", "float32")
    }  # fmt: skip
    assert stacks["int8"] and all(s._supported is not True for s in stacks["int8"])
    if ops.available():
        assert all(s._supported is True for s in stacks["float32"])


def test_mamba_hybrid_keeps_its_float32_state_beside_int8_attention(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Bamba: the attention layers' pages are int8, the Mamba states in the same pool stay
    float32 (MambaStateCache views the bytes as floats), so the states are exact and only
    the attention's K/V are rounded: greedy stays HF's (measured: all 12 tokens)."""
    from tests.mamba_models import build_mamba_model, hf_greedy

    directory = tmp_path_factory.mktemp("bamba-int8")
    hf = build_mamba_model("bamba", directory)
    prompts = [[5, 17, 99, 3, 42, 7, 61, 18, 100, 11, 64, 128, 9, 31, 77, 150, 4], [8, 140, 6]]
    llm = LLM(str(directory), skip_tokenizer_init=True, kv_cache_memory=8 << 20,
              kv_cache_dtype="int8")  # fmt: skip
    try:
        assert {t.dtype for t in _runner(llm).kv_caches.values()} == {torch.int8}
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            assert list(out.outputs[0].token_ids)[:6] == hf_greedy(hf, prompt, 6)
        assert_no_leak(llm)
    finally:
        llm.llm_engine.shutdown()
