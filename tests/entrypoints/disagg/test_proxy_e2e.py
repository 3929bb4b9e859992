"""Disaggregated prefill over real processes: two producers and two consumers running
P2pZmqConnector, and `kvserve proxy` in front of them in three shapes (1P1D, 2P1D, 1P2D).

The reference is the second producer answering the same requests without
kv_transfer_params (a plain instance: its connector does nothing for such requests).
The last test kills that producer in the middle of two transfers: the consumer with
kv_load_failure_policy "recompute" still answers with the plain tokens, the one with
"fail" answers a 503 naming the failure, and neither keeps a KV block.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import torch
import zmq

from kvserve.distributed.kv_transfer.kv_connector.connectors.p2p_params import prompt_hash
from kvserve.distributed.kv_transfer.kv_connector.connectors.p2p_wire import (
    LayerHeader,
    PeerSender,
)
from kvserve.kvcache.integrity import KeyedKVAuthenticator
from kvserve.utils.zmq_curve import socket_security
from tests.entrypoints.disagg.helpers import (
    MODEL,
    Process,
    _free_port,
    p2p_consumer,
    p2p_producer,
    proxy,
    serve,
    stop_all,
    wait_idle,
)

pytestmark = pytest.mark.slow

# The proxies serve the first four in every shape (completion and chat, streamed or not);
# the last two are kept for the producer killed mid-transfer, so no consumer holds their
# prefix before it.
TOPICS = ["ocean tides", "volcanoes", "honey bees", "glaciers", "lighthouses", "desert foxes"]
SERVED = TOPICS[:4]
MAX_TOKENS = 8
PROXY_KEY = "proxy-key"


def _prompt(topic: str) -> str:
    return (
        f"Here is a short story about {topic}. Once upon a time, in a quiet village by the "
        f"sea, there lived a curious child who loved {topic} more than anything else, and"
    )


def _messages(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me three facts about {topic}, briefly."}]


@dataclass
class Fleet:
    p1: Process
    p2: Process
    d1: Process  # policy recompute
    d2: Process  # policy fail
    d1_kv: int
    d2_kv: int
    one_one: Process
    two_one: Process
    one_two: Process


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    d1_kv, d2_kv = _free_port(), _free_port()
    engines = [
        serve("p1", p2p_producer()),
        serve("p2", p2p_producer()),
        serve("d1", p2p_consumer(d1_kv)),
        serve("d2", p2p_consumer(d2_kv, policy="fail")),
    ]
    proxies: list[Process] = []
    try:
        for engine in engines:
            engine.wait_healthy()
        p1, p2, d1, d2 = engines
        proxies = [
            proxy("proxy-1p1d", [p1], [(d1, d1_kv)], api_key=PROXY_KEY),
            proxy("proxy-2p1d", [p1, p2], [(d1, d1_kv)]),
            proxy("proxy-1p2d", [p1], [(d1, d1_kv), (d2, d2_kv)]),
        ]
        for p in proxies:
            p.wait_healthy()
        yield Fleet(p1, p2, d1, d2, d1_kv, d2_kv, *proxies)
    finally:
        stop_all([*proxies, *engines])


def _complete(server: Process, topic: str, stream: bool) -> str:
    client = server.client()
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    if not stream:
        return str(client.completions.create(prompt=_prompt(topic), **kwargs).choices[0].text)
    chunks = client.completions.create(prompt=_prompt(topic), stream=True, **kwargs)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def _chat(server: Process, topic: str, stream: bool) -> str:
    client = server.client()
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    if not stream:
        reply = client.chat.completions.create(messages=_messages(topic), **kwargs)  # type: ignore[arg-type]
        return str(reply.choices[0].message.content)
    chunks = client.chat.completions.create(messages=_messages(topic), stream=True, **kwargs)  # type: ignore[arg-type]
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.fixture(scope="module")
def plain(fleet: Fleet) -> dict[tuple[str, str], str]:
    """The plain instance's answers: (kind, topic) -> text."""
    answers = {("completion", t): _complete(fleet.p2, t, stream=False) for t in TOPICS}
    answers |= {("chat", t): _chat(fleet.p2, t, stream=False) for t in SERVED}
    return answers


def _consumer_counts(d: Process) -> tuple[float, float, float, float]:
    """Prompt tokens, local prefix hits, tokens and requests received over the wire."""
    m = d.metrics()
    return (
        m.get(("kvserve:prompt_tokens_total", ""), 0.0),
        m.get(("kvserve:prefix_cache_hits_total", ""), 0.0),
        m.get(("kvserve:kv_connector_transfer_tokens_total", "received"), 0.0),
        m.get(("kvserve:kv_connector_transfer_requests_total", "received"), 0.0),
    )


def test_1p1d_gives_the_plain_tokens_and_the_consumer_only_decodes(
    fleet: Fleet, plain: dict[tuple[str, str], str]
) -> None:
    before = _consumer_counts(fleet.d1)
    num_requests = 0
    for topic in SERVED:
        for stream in (False, True):
            assert _complete(fleet.one_one, topic, stream) == plain[("completion", topic)]
            assert _chat(fleet.one_one, topic, stream) == plain[("chat", topic)]
            num_requests += 2
    deadline = time.monotonic() + 10
    while (after := _consumer_counts(fleet.d1))[3] - before[3] < num_requests:
        assert time.monotonic() < deadline, f"only {after[3] - before[3]} transfers received"
        time.sleep(0.1)
    prompt, hits, received, _ = (a - b for a, b in zip(after, before, strict=True))
    computed = prompt - hits - received
    # Every prompt token but the last came over the wire (or the local prefix cache).
    assert received > 0 and computed <= num_requests, (prompt, hits, received)
    proxy_metrics = fleet.one_one.metrics()
    assert proxy_metrics[("kvserve_proxy_kv_transfer_bytes_total", "")] > 0
    assert proxy_metrics[("kvserve_proxy_stage_seconds_count", "prefill")] == num_requests
    assert proxy_metrics[("kvserve_proxy_errors_total", "decode")] == 0
    wait_idle(fleet.d1)
    wait_idle(fleet.p1)


def test_n_samples_through_the_proxy(fleet: Fleet, plain: dict[tuple[str, str], str]) -> None:
    topic = TOPICS[0]
    answer = fleet.one_one.client().completions.create(
        model=MODEL, prompt=_prompt(topic), max_tokens=MAX_TOKENS, temperature=0.0, n=2
    )
    assert [c.text for c in answer.choices] == [plain[("completion", topic)]] * 2
    wait_idle(fleet.d1)


def _spread(p: Process) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{p.url}/metrics", timeout=10).text
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("kvserve_proxy_requests_total{"):
            labels, value = line[len("kvserve_proxy_requests_total{") :].split("} ")
            fields = dict(kv.split("=", 1) for kv in labels.split(","))
            out[(fields["stage"].strip('"'), fields["instance"].strip('"'))] = float(value)
    return out


@pytest.mark.parametrize("shape", ["2p1d", "1p2d"])
def test_proxy_balances_over_several_instances(
    fleet: Fleet, plain: dict[tuple[str, str], str], shape: str
) -> None:
    front = fleet.two_one if shape == "2p1d" else fleet.one_two
    for topic in SERVED:
        assert _complete(front, topic, stream=True) == plain[("completion", topic)]
        assert _chat(front, topic, stream=False) == plain[("chat", topic)]
    spread = _spread(front)
    if shape == "2p1d":
        assert spread[("prefill", fleet.p1.url)] > 0 and spread[("prefill", fleet.p2.url)] > 0
        assert spread[("decode", fleet.d1.url)] == 8
    else:
        assert spread[("prefill", fleet.p1.url)] == 8
        assert spread[("decode", fleet.d1.url)] > 0 and spread[("decode", fleet.d2.url)] > 0
    for server in (fleet.p1, fleet.p2, fleet.d1, fleet.d2):
        wait_idle(server)


def test_client_errors_and_disconnects_pass_through(fleet: Fleet) -> None:
    # Bad input: the prefiller's 400, in OpenAI's error shape, straight to the client.
    with pytest.raises(openai.BadRequestError) as bad:
        fleet.one_one.client().completions.create(model=MODEL, prompt="", max_tokens=4)
    assert bad.value.body["param"] == "prompt"  # type: ignore[index]
    # Text the proxy cannot forward (no UTF-8 form; json.dumps escapes it) is its own 400.
    bad_text = httpx.post(
        f"{fleet.one_one.url}/v1/completions",
        content=json.dumps({"model": MODEL, "prompt": "\ud800", "max_tokens": 4}),
        headers={"authorization": f"Bearer {PROXY_KEY}", "content-type": "application/json"},
        timeout=30,
    )
    assert bad_text.status_code == 400 and "prompt" in bad_text.json()["error"]["message"]
    # The proxy's key is required; the instances' is the proxy's to send.
    unkeyed = openai.OpenAI(base_url=f"{fleet.one_one.url}/v1", api_key="EMPTY", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        unkeyed.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        fleet.p1.client().with_options(api_key=PROXY_KEY).models.list()
    # A client that leaves a stream: the decoder aborts the request and frees its blocks.
    aborts = fleet.one_one.metrics()[("kvserve_proxy_client_aborts_total", "")]
    with httpx.stream(
        "POST", f"{fleet.one_one.url}/v1/completions", timeout=60,
        headers={"authorization": f"Bearer {PROXY_KEY}"},
        json={"model": MODEL, "prompt": _prompt("long stories"), "max_tokens": 400,
              "ignore_eos": True, "stream": True},
    ) as response:  # fmt: skip
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    deadline = time.monotonic() + 30
    while fleet.one_one.metrics()[("kvserve_proxy_client_aborts_total", "")] == aborts:
        assert time.monotonic() < deadline, "the proxy never saw the client leave"
        time.sleep(0.1)
    wait_idle(fleet.d1)
    # 400 tokens take far longer than that here: the request was dropped, not finished.
    assert fleet.d1.metrics()[("kvserve:num_requests_running", "")] == 0


def _prefill_then_die(producer: Process, kv_port: int, topic: str) -> dict[str, Any]:
    """A prefill whose producer sends 3 of its layers, then stops (it is killed next)."""
    answer = producer.client().completions.create(
        model=MODEL, prompt=_prompt(topic), max_tokens=1, temperature=0.0,
        extra_body={"kv_transfer_params": {
            "do_remote_decode": True, "remote_host": "127.0.0.1", "remote_port": kv_port,
            "fault_stop_after_layers": 3,
        }},
    )  # fmt: skip
    params = answer.model_extra["kv_transfer_params"]  # type: ignore[index]
    assert params["do_remote_prefill"] and params["num_tokens"] > 16
    return dict(params)


def test_producer_killed_mid_transfer(fleet: Fleet, plain: dict[tuple[str, str], str]) -> None:
    topic_a, topic_b = TOPICS[4], TOPICS[5]
    params_a = _prefill_then_die(fleet.p2, fleet.d1_kv, topic_a)
    params_b = _prefill_then_die(fleet.p2, fleet.d2_kv, topic_b)
    fleet.p2.stop(sig=9)  # SIGKILL, engine core included: the rest never comes
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0}

    def decode(consumer: Process, topic: str, params: dict[str, Any]) -> Any:
        return consumer.client().completions.create(
            prompt=_prompt(topic), extra_body={"kv_transfer_params": params}, **kwargs
        )

    # Both consumers wait out recv_timeout_s at once, not one after the other.
    with ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        recomputed = pool.submit(decode, fleet.d1, topic_a, params_a)
        failed = pool.submit(decode, fleet.d2, topic_b, params_b)
        # "recompute": the consumer waits out recv_timeout_s, then computes the prompt itself.
        answer = recomputed.result()
        assert time.monotonic() - started >= 7  # it did wait for the KV first
        # "fail": a clear error, and the consumer goes on serving.
        with pytest.raises(openai.APIStatusError) as failure:
            failed.result()
    assert answer.choices[0].text == plain[("completion", topic_a)]
    assert failure.value.status_code == 503
    assert "failed to load external KV" in str(failure.value)
    assert "kv_load_failure_policy is 'fail'" in str(failure.value)
    for consumer in (fleet.d1, fleet.d2):
        wait_idle(consumer)
        assert _complete(consumer, topic_b, stream=False) == plain[("completion", topic_b)]
        wait_idle(consumer)
    failed = fleet.d2.metrics()[("kvserve:kv_connector_transfer_requests_total", "failed")]
    assert failed == 1
    # The 2P1D proxy goes on with the producer left (the dead one is tried and skipped).
    for topic in TOPICS[:2]:
        assert _complete(fleet.two_one, topic, stream=False) == plain[("completion", topic)]


def _plant(server: Process, kv_port: int, topic: str) -> dict[str, Any]:
    """What a peer without the fleet's secret does to plant KV: the engines' own sender,
    under another KV secret, sends every layer of the prompt's KV to the consumer's KV
    port; returns the kv_transfer_params a producer would have handed out for it."""
    ids = httpx.post(
        f"{server.url}/tokenize",
        json={"model": MODEL, "prompt": _prompt(topic)},
        headers={"authorization": f"Bearer {server.key}"},
        timeout=30,
    ).json()["tokens"]
    num_tokens = len(ids) - 1  # the consumer computes the last prompt token itself
    params = {
        "do_remote_prefill": True, "transfer_id": f"planted-{topic}", "num_tokens": num_tokens,
        "prompt_hash": prompt_hash(ids[:num_tokens]),
    }  # fmt: skip
    forged_secret = b"not-the-fleet-secret-" * 2
    context = zmq.Context()
    sender = PeerSender(
        context,
        f"tcp://127.0.0.1:{kv_port}",
        timeout_s=1,
        auth=KeyedKVAuthenticator(forged_secret),
        security=socket_security(forged_secret),
    )
    try:
        # SmolLM2's KV: 30 layers of 3 KV heads of 64, in blocks of 16 tokens.
        layer = torch.zeros(2, -(-num_tokens // 16), 16, 3, 64)
        for i in range(30):
            header = LayerHeader(
                transfer_id=str(params["transfer_id"]), layer_index=i, num_layers=30,
                layer_name=f"model.layers.{i}.self_attn.attn", dtype="float32",
                shape=list(layer.shape), num_tokens=num_tokens,
                prompt_hash=str(params["prompt_hash"]),
            )  # fmt: skip
            sender.send_layer("planted", header, layer)
        # The consumer never acknowledges it (the CURVE handshake fails): a timed-out send.
        deadline = time.monotonic() + 30
        while not (done := sender.take_done()):
            assert time.monotonic() < deadline, "the planted transfer never ended"
            time.sleep(0.1)
        assert [(req_id, ok) for req_id, ok, _, _ in done] == [("planted", False)]
    finally:
        sender.close()
        context.destroy(linger=0)
    return params


def test_kv_from_a_peer_without_the_secret_is_refused_and_recomputed(fleet: Fleet) -> None:
    """A peer that can reach the consumer's KV port but does not hold the fleet's secret
    plants a transfer: the consumer refuses it, computes the prompt itself and answers
    what an instance without transfers answers."""
    topic = "migrating cranes"
    reference = _complete(fleet.p1, topic, stream=False)
    params = _plant(fleet.p1, fleet.d1_kv, topic)

    def refusals() -> float:
        m = fleet.d1.metrics()
        return m.get(("kvserve:kv_connector_transfer_auth_failures_total", "received"), 0.0) + (
            m.get(("kvserve:kv_connector_transfer_requests_total", "failed"), 0.0)
        )

    before = refusals()
    answer = fleet.d1.client().completions.create(
        model=MODEL, prompt=_prompt(topic), max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"kv_transfer_params": params},
    )  # fmt: skip
    assert answer.choices[0].text == reference
    assert refusals() > before
    wait_idle(fleet.d1)
