"""Reasoning output from a real server: a tiny random Llama whose tokenizer has <think> and
</think> as special tokens and whose chat template opens <think> in the generation prompt
(as DeepSeek-R1's and Qwen3's do), with its output forced (tests/forced_tokens.py) so that
the parser, not the model, is what is tested. `--reasoning-parser auto` picks the parser."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.entrypoints.openai.utils import RemoteServer
from tests.forced_tokens import forced_xargs

pytestmark = pytest.mark.slow

MODEL = "tiny-think"
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
CORPUS = ["the answer is a small json object", "let me think about what the user asked"] * 20
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Is it ok?"}]


def build_model(directory: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>", "<think>", "</think>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<eos>",
        additional_special_tokens=["<think>", "</think>"],
    )
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().eval().save_pretrained(directory)
    return tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RemoteServer, Any]]:
    directory = tmp_path_factory.mktemp("tiny_think")
    tokenizer = build_model(directory)
    server = RemoteServer(
        "--served-model-name",
        MODEL,
        str(directory),
        "--reasoning-parser",
        "auto",
        forced_tokens=True,
    )
    yield server, tokenizer
    assert server.stop() == 0


def forced(tokenizer: Any, reasoning: str, content: str | None) -> dict[str, Any]:
    """vllm_xargs forcing ``reasoning</think>content<eos>`` (content None: stop after the
    end token and leave the rest to the model and its grammar)."""
    ids = tokenizer.encode(reasoning, add_special_tokens=False)
    ids.append(tokenizer.convert_tokens_to_ids("</think>"))
    if content is not None:
        ids += [*tokenizer.encode(content, add_special_tokens=False), tokenizer.eos_token_id]
    return {"vllm_xargs": forced_xargs(ids)}


def test_chat_reasoning_whole_and_streamed(setup: tuple[RemoteServer, Any]) -> None:
    server, tokenizer = setup
    client = server.client()
    body = forced(tokenizer, "The user asks if it is ok.\nYes.", "\n\nIt is ok.")
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=body)
    message = reply.choices[0].message
    assert message.reasoning_content == "The user asks if it is ok.\nYes."  # type: ignore[attr-defined]
    assert message.content == "\n\nIt is ok."
    assert reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, extra_body=body, stream=True
    )
    reasoning, content = [], []
    for chunk in stream:
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    assert "".join(reasoning) == message.reasoning_content  # type: ignore[attr-defined]
    assert "".join(content) == message.content
    assert not any("think>" in c for c in content)
    # include_reasoning=false: the reasoning is split off and dropped.
    quiet = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, extra_body={**body, "include_reasoning": False}
    )
    assert getattr(quiet.choices[0].message, "reasoning_content", None) is None
    assert quiet.choices[0].message.content == "\n\nIt is ok."


def test_thinking_switched_off_in_the_template(setup: tuple[RemoteServer, Any]) -> None:
    server, tokenizer = setup
    ids = [*tokenizer.encode("Yes.", add_special_tokens=False), tokenizer.eos_token_id]
    reply = server.client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        extra_body={
            "vllm_xargs": forced_xargs(ids),
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None
    assert reply.choices[0].message.content == "Yes."


def test_grammar_applies_after_the_reasoning(setup: tuple[RemoteServer, Any]) -> None:
    """Free-text reasoning is forced (a grammar from the first token would forbid it),
    then the model writes the answer under the schema's grammar."""
    server, tokenizer = setup
    # A json_schema constraint; compact, so a random model cannot ramble in whitespace.
    body = {
        **forced(tokenizer, "I must answer in json.", None),
        "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True},
    }
    for stream in (False, True):
        response = server.client().chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=60,
            temperature=0.0,
            extra_body=body,
            stream=stream,
        )
        if stream:
            parts: dict[str, list[str]] = {"reasoning": [], "content": []}
            for chunk in response:  # type: ignore[union-attr]
                for choice in chunk.choices:
                    delta = choice.delta
                    parts["reasoning"].append(getattr(delta, "reasoning_content", None) or "")
                    parts["content"].append(delta.content or "")
            reasoning, content = "".join(parts["reasoning"]), "".join(parts["content"])
        else:
            message = response.choices[0].message  # type: ignore[union-attr]
            reasoning, content = message.reasoning_content, message.content  # type: ignore[attr-defined]
        assert reasoning == "I must answer in json."
        answer = json.loads(content)
        assert set(answer) == {"ok"} and isinstance(answer["ok"], bool), content


def test_responses_reasoning_item(setup: tuple[RemoteServer, Any]) -> None:
    server, tokenizer = setup
    client = server.client()
    body = forced(tokenizer, "Think first.", "Done.")
    response = client.responses.create(model=MODEL, input="Is it ok?", extra_body=body)
    item, message = response.output
    assert item.type == "reasoning" and message.type == "message"
    assert item.content is not None and item.content[0].text == "Think first."
    assert response.output_text == "Done."
    events = list(
        client.responses.create(model=MODEL, input="Is it ok?", extra_body=body, stream=True)
    )
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Think first."
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert len(done) == 1 and done[0].text == "Think first." and done[0].output_index == 0
    texts = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in texts) == "Done." and texts[0].output_index == 1
    final = events[-1]
    assert final.type == "response.completed"
    assert [o.type for o in final.response.output] == ["reasoning", "message"]
