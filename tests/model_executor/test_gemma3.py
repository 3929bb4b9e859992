"""Gemma 3 270M from its PyPI package through the whole engine, token-exact vs HF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvserve
from kvserve.model_executor.layers.greedy_screen import GreedyScreen
from kvserve.sampling_params import SamplingParams
from kvserve.transformers_utils.arch_config import load_arch_config
from kvserve.transformers_utils.model_resolver import resolve_model
from kvserve.worker.greedy_head import make_greedy_head
from tests.gemma3_fixtures import GEMMA3, GEMMA3_MAX_TOKENS, GEMMA3_WINDOW
from tests.reference import assert_no_leak

CHAT_TEMPLATES = Path(kvserve.__file__).parent / "entrypoints" / "chat_templates"


def test_gemma3_gguf_layer_types_follow_hf_default_pattern() -> None:
    arch = load_arch_config(resolve_model(GEMMA3))
    assert arch.architecture == "Gemma3ForCausalLM"
    assert (arch.num_hidden_layers, arch.hidden_size, arch.vocab_size) == (18, 640, 262144)
    # HF's Gemma3TextConfig default: layer i is global iff (i + 1) % 6 == 0.
    full = [i for i, kind in enumerate(arch.layer_types) if kind == "full_attention"]
    assert full == [5, 11, 17]
    assert arch.sliding_window == GEMMA3_WINDOW
    assert [arch.layer_sliding_window(i) for i in (0, 5)] == [GEMMA3_WINDOW, None]
    assert [arch.layer_rope_theta(i) for i in (0, 5)] == [10000.0, 1_000_000.0]
    assert arch.query_pre_attn_scalar == 256.0
    assert arch.attn_logit_softcapping is None and arch.final_logit_softcapping is None


def test_gemma3_270m_batched_chunked_prefill_matches_hf(
    gemma3_llm: Any, gemma3_prompts: list[list[int]], gemma3_reference: list[list[int]]
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=GEMMA3_MAX_TOKENS, ignore_eos=True)
    # The session engine may hold these prompts from another module's tests: every long
    # prompt is prefilled here, in 64-token chunks across its windows, whatever ran before.
    gemma3_llm.reset_prefix_cache()
    outputs = gemma3_llm.generate(
        [{"prompt_token_ids": p} for p in gemma3_prompts], params, use_tqdm=False
    )
    for prompt, output, expected in zip(gemma3_prompts, outputs, gemma3_reference, strict=True):
        assert list(output.outputs[0].token_ids) == expected, f"prompt of {len(prompt)} tokens"
    assert_no_leak(gemma3_llm)


def test_gemma3_greedy_screen_matches_hf(
    gemma3_llm: Any, gemma3_prompts: list[list[int]], gemma3_reference: list[list[int]]
) -> None:
    """The tied 262,144-row Q8_0 head through the greedy screen (greedy_screen.py), on by
    default only where the integer GEMV is the cheaper (AVX2): installed here on the
    session engine whatever the CPU, for the short prompts, up to three at a time."""
    runner = gemma3_llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
    runner = runner.model_runner
    lm_head = runner.model.lm_head
    saved = runner.greedy_head, lm_head.greedy_screen
    # AVX-512 VNNI builds interleave the head for the digit matmul: the screen takes the
    # plain layout's copy (its exact pass is the float GEMV's).
    lm_head.greedy_screen = GreedyScreen(lm_head.quant_weight.plain(), lm_head.num_embeddings)
    runner.greedy_head = make_greedy_head(runner.model, is_last_stage=True, is_pooling=False)
    screened = 0
    tokens = runner.greedy_head.tokens

    def counted(*args: Any) -> Any:
        nonlocal screened
        out = tokens(*args)
        screened += out is not None
        return out

    runner.greedy_head.tokens = counted
    params = SamplingParams(temperature=0.0, max_tokens=GEMMA3_MAX_TOKENS, ignore_eos=True)
    try:
        for group in (slice(0, 3), slice(3, 5)):
            outputs = gemma3_llm.generate(
                [{"prompt_token_ids": p} for p in gemma3_prompts[group]], params, use_tqdm=False
            )
            got = [list(o.outputs[0].token_ids) for o in outputs]
            assert got == gemma3_reference[group]
    finally:
        runner.greedy_head, lm_head.greedy_screen = saved
    assert screened >= 2 * (GEMMA3_MAX_TOKENS - 1)
    assert_no_leak(gemma3_llm)


def test_gemma3_tied_head_serves_the_lookups_without_a_float32_table(gemma3_llm: Any) -> None:
    """The 262,144 x 640 embedding (671 MB in float32) is looked up in the tied head's
    Q8_0 blocks: each row gguf's dequantization of the file's, bit for bit."""
    from gguf.quants import dequantize

    from kvserve.model_executor.model_loader.gguf_loader import iterate_gguf_blocks

    runner = gemma3_llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
    model = runner.model_runner.model
    embed = model.model.embed_tokens
    assert embed.row_blocks is model.lm_head.quant_weight and embed.weight.numel() == 0
    config = gemma3_llm.llm_engine.config.model_config
    qtype, raw = next(
        (qtype, raw)
        for name, qtype, raw in iterate_gguf_blocks(config.resolved.path, config.arch)
        if name == "model.embed_tokens.weight"
    )
    ids = [0, 2, 106, 1000, 262143, 2, 131072]
    reference = torch.from_numpy(dequantize(raw[ids], qtype).astype(np.float32))
    assert torch.equal(embed.forward(torch.tensor(ids)), reference)


def test_gemma3_base_model_chat_needs_a_template(gemma3_llm: Any) -> None:
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    with pytest.raises(ValueError, match="no chat template"):
        gemma3_llm.chat(conversation, use_tqdm=False)
    template = (CHAT_TEMPLATES / "gemma3.jinja").read_text()
    params = SamplingParams(temperature=0.0, max_tokens=2)
    (output,) = gemma3_llm.chat(conversation, params, chat_template=template, use_tqdm=False)
    assert gemma3_llm.get_tokenizer().decode(output.prompt_token_ids) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
    assert len(output.outputs[0].token_ids) == 2
