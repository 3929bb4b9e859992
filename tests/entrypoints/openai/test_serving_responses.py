"""`/v1/responses` through the openai SDK, and `use_beam_search` on /v1/completions."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from kvserve.sampling_params import BeamSearchParams
from tests.entrypoints.openai.utils import RemoteServer

MODEL = "SmolLM2-135M-Instruct"
INSTRUCTIONS = "Answer in one short sentence."
QUESTION = "What is the capital of France?"


def test_vllm_serve_flags_are_accepted_and_no_ops_logged(server: RemoteServer) -> None:
    # The package's server is started with conftest.VLLM_FLAGS; its whole log, as other
    # modules' requests may have logged since.
    log = server.output(tail=None)
    for flag in ("enforce_eager", "swap_space", "trust_remote_code"):
        assert f"{flag}=" in log and "has no effect in kvserve" in log, log
    assert "disable_frontend_multiprocessing=True has no effect" in log


def chat_reply(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int) -> str:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,  # type: ignore[arg-type]
    )
    return reply.choices[0].message.content or ""


def test_text_input_with_instructions_answers_like_chat(server: RemoteServer) -> None:
    client = server.client()
    response = client.responses.create(
        model=MODEL,
        input=QUESTION,
        instructions=INSTRUCTIONS,
        max_output_tokens=24,
        temperature=0,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "completed", response
    assert response.output[0].type == "message"
    expected = chat_reply(
        client,
        [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
        24,
    )
    assert response.output_text == expected
    assert "Paris" in response.output_text
    assert response.usage is not None
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.store is False, "responses are not stored unless the server is told to"


def test_message_input_and_max_output_tokens(server: RemoteServer) -> None:
    client = server.client()
    messages: Any = [
        {"role": "developer", "content": INSTRUCTIONS},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    response = client.responses.create(
        model=MODEL, input=messages, max_output_tokens=3, temperature=0
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3
    full = chat_reply(
        client,
        [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
        3,
    )
    assert response.output_text == full


def test_streaming_events_as_the_sdk_expects(server: RemoteServer) -> None:
    client = server.client()
    whole = client.responses.create(
        model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=24, temperature=0
    )
    events = list(
        client.responses.create(
            model=MODEL,
            input=QUESTION,
            instructions=INSTRUCTIONS,
            max_output_tokens=24,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds) > 9
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    done = events[-1]
    assert done.type == "response.completed"
    assert done.response.output_text == whole.output_text
    assert done.response.usage is not None
    assert done.response.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]
    item_ids = {getattr(e, "item_id", None) for e in events} - {None}
    assert len(item_ids) == 1 and done.response.output[0].id in item_ids


def test_bad_input_is_a_400_and_the_server_keeps_serving(server: RemoteServer) -> None:
    client = server.client()
    bad: list[Any] = [
        [{"type": "function_call", "name": "f", "arguments": "{}"}],  # no call_id
        [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
        [],
    ]
    for value in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, input=value)
        assert info.value.body["param"] == "input"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="--enable-store-responses"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_x")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nothing")
    ok = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert ok.usage is not None and ok.usage.output_tokens == 2


def test_completions_use_beam_search_matches_offline(server: RemoteServer, llm: Any) -> None:
    body = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "use_beam_search": True,
        "n": 3,
        "max_tokens": 6,
        "ignore_eos": True,
    }
    response = httpx.post(server.url("/v1/completions"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["text"] for c in choices}) == 3
    offline = llm.beam_search(
        ["The capital of France is"], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    )[0]
    assert [c["text"] for c in choices] == [s.text for s in offline.sequences]
    streamed = httpx.post(server.url("/v1/completions"), json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 400 and "use_beam_search" in streamed.text
    wide = httpx.post(server.url("/v1/completions"), json={**body, "n": 12}, timeout=60)
    assert wide.status_code == 400 and "n must be at most 10" in wide.text


def test_stored_responses_when_enabled(tool_server: RemoteServer) -> None:
    # The package's tool server has --enable-store-responses.
    client = tool_server.client()
    first = client.responses.create(
        model=MODEL, input="My name is Ada.", max_output_tokens=8, temperature=0
    )
    assert first.store is True
    assert client.responses.retrieve(first.id).output_text == first.output_text
    follow = client.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    history = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert follow.output_text == chat_reply(client, history, 8)
    assert follow.previous_response_id == first.id
