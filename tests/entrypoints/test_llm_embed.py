"""Pooling runner offline: LLM.embed / encode / score against sentence-transformers (a tiny
random BERT) and against HF's hidden states (SmolLM2, last-token pooling)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvserve.entrypoints.llm import LLM
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams
from tests.model_executor.tiny_bert import build_tiny_bert
from tests.reference import assert_no_leak, hf_reference

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a cat sat on the mat",
    "kv",
    "prefix caching shares blocks between requests with the same prompt",
]


@pytest.fixture(scope="module")
def bert_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """pooling mode -> (SentenceTransformer reference, LLM on the saved directory)."""
    engines: dict[str, Any] = {}
    for mode in ("mean", "cls"):
        directory = tmp_path_factory.mktemp(f"bert_{mode}")
        reference = build_tiny_bert(directory, mode)
        engines[mode] = (reference, LLM(str(directory / "st"), kv_cache_memory=16 << 20))
    yield engines
    for _, llm in engines.values():
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_bert_matches_sentence_transformers(bert_engines: dict[str, Any], mode: str) -> None:
    reference, llm = bert_engines[mode]
    config = llm.llm_engine.config
    assert config.model_config.is_pooling and config.model_config.is_encoder_only
    assert config.model_config.pooler_config.pooling_type == mode.upper()
    # The encoder's KV is never reused: each prompt is computed whole, then its blocks go.
    assert not config.cache_config.enable_prefix_caching
    assert not config.scheduler_config.enable_chunked_prefill

    expected = reference.encode(SENTENCES, convert_to_tensor=True, normalize_embeddings=True)
    outputs = llm.embed(SENTENCES, use_tqdm=False)
    assert [o.request_id for o in outputs] == sorted((o.request_id for o in outputs), key=int)
    for sentence, output, ref in zip(SENTENCES, outputs, expected, strict=True):
        assert output.prompt_token_ids == reference.tokenizer(sentence)["input_ids"]
        assert 1 not in output.prompt_token_ids[1:-1], "words must not be [UNK]"
        vector = torch.tensor(output.outputs.embedding)
        assert output.outputs.hidden_size == 64
        assert float(vector.norm()) == pytest.approx(1.0, abs=1e-5)
        assert float(vector @ ref.float()) > 0.9999
    assert_no_leak(llm)


def test_bert_encode_raw_and_truncated(bert_engines: dict[str, Any]) -> None:
    """normalize=False returns the raw mean of HF's last hidden states; dimensions keeps
    the leading values and normalises them."""
    from transformers import BertModel

    reference, llm = bert_engines["mean"]
    hf = BertModel.from_pretrained(reference[0].auto_model.name_or_path).eval()
    ids = reference.tokenizer(SENTENCES[0])["input_ids"]
    with torch.inference_mode():
        hidden = hf(torch.tensor([ids])).last_hidden_state[0].mean(0)
    raw = llm.encode({"prompt_token_ids": ids}, PoolingParams(normalize=False), use_tqdm=False)
    torch.testing.assert_close(raw[0].outputs.data, hidden, atol=1e-5, rtol=1e-5)
    short = llm.embed(SENTENCES[0], PoolingParams(dimensions=16), use_tqdm=False)[0]
    expected = F.normalize(hidden[:16], dim=-1)
    torch.testing.assert_close(torch.tensor(short.outputs.embedding), expected, atol=1e-5, rtol=0)


def test_score_is_cosine_of_embeddings(bert_engines: dict[str, Any]) -> None:
    reference, llm = bert_engines["mean"]
    scores = llm.score(SENTENCES[0], SENTENCES, use_tqdm=False)
    embeddings = reference.encode(SENTENCES, convert_to_tensor=True, normalize_embeddings=True)
    expected = (embeddings @ embeddings[0]).tolist()
    assert [s.outputs.score for s in scores] == pytest.approx(expected, abs=1e-4)
    assert scores[0].outputs.score == pytest.approx(1.0, abs=1e-5)


def test_pooling_engine_rejects_generation(bert_engines: dict[str, Any]) -> None:
    _, llm = bert_engines["cls"]
    with pytest.raises(ValueError, match="pooling runner"):
        llm.generate("the cat", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("the cat", PoolingParams(dimensions=65), use_tqdm=False)
    assert llm.embed("the cat", use_tqdm=False)[0].outputs.hidden_size == 64
    assert_no_leak(llm)


def test_generate_engine_rejects_pooling(llm: Any) -> None:
    with pytest.raises(ValueError, match="pooling model"):
        llm.embed("Hello", use_tqdm=False)


@pytest.fixture(scope="module")
def smollm2_embed(llm_factory: Callable[..., Any]) -> Any:
    # A small token budget: long prompts reach the pooler in several chunks.
    return llm_factory(task="embed", max_num_batched_tokens=16)


def test_smollm2_last_token_matches_hf(smollm2_embed: Any) -> None:
    ref = hf_reference()
    prompts = ["Hello, my name is", " ".join(SENTENCES)]
    outputs = smollm2_embed.embed(prompts, use_tqdm=False)
    raw = smollm2_embed.encode(prompts, PoolingParams(normalize=False), use_tqdm=False)
    assert len(outputs[1].prompt_token_ids) > 16, "the long prompt spans several chunks"
    for output, unnormalized in zip(outputs, raw, strict=True):
        with torch.inference_mode():
            model_input = torch.tensor([output.prompt_token_ids])
            hidden = ref.model.model(model_input).last_hidden_state[0, -1]
        vector = torch.tensor(output.outputs.embedding)
        assert float(vector @ F.normalize(hidden, dim=-1)) > 0.9999
        torch.testing.assert_close(unnormalized.outputs.data, hidden, atol=2e-3, rtol=1e-3)
    assert_no_leak(smollm2_embed)
