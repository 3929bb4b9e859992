"""`kvserve router` over three real `kvserve serve` instances publishing KV events.

A multi-turn workload (each turn extends the previous prompt) through the prefix router
lands every turn on the instance that served the conversation before, and the fleet's
prefix hit rate (the instances' own metrics) is at least twice that of the round-robin
router on the same shape of workload. One instance killed: the router keeps answering;
restarted on its ports: the router routes to it again and learns its new cache.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.utils.health import wait_until_healthy
from tests.entrypoints.openai.utils import SERVER_ARGS, _free_port

pytestmark = pytest.mark.slow

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
MODEL = "SmolLM2-135M-Instruct"
# Every instance requires this key; only the routers send it.
INSTANCE_KEY = "instance-key"
TOPICS = ["ocean tides", "volcanoes", "honey bees", "glaciers", "the printing press"]


def _wait_healthy(
    url: str, proc: subprocess.Popen[bytes], log: object, timeout: float = 300
) -> None:
    if wait_until_healthy(url, proc, time.monotonic() + timeout):
        return
    if proc.poll() is not None:
        raise RuntimeError(f"{url} exited during startup:\n{_tail(log)}")
    raise RuntimeError(f"{url} did not become healthy:\n{_tail(log)}")


def _tail(log: object) -> str:
    log.flush()  # type: ignore[attr-defined]
    log.seek(0)  # type: ignore[attr-defined]
    return str(log.read())[-4000:]  # type: ignore[attr-defined]


def _metrics(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, s.labels.get("backend", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class Instance:
    """A `kvserve serve` process with fixed HTTP and KV events ports (restartable)."""

    def __init__(self) -> None:
        self.port, self.pub, self.replay = _free_port(), _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-instance-", suffix=".log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def backend_arg(self) -> str:
        return f"{self.url}=tcp://127.0.0.1:{self.pub},tcp://127.0.0.1:{self.replay}"

    def start(self) -> None:
        events = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{self.pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay}",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(self.port),
             *SERVER_ARGS, "--kv-events-config", json.dumps(events), "--api-key", INSTANCE_KEY],
            stdout=self.log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True,
        )  # fmt: skip

    def wait(self) -> None:
        assert self.proc is not None
        _wait_healthy(self.url, self.proc, self.log)

    def kill(self) -> None:
        """SIGKILL to the whole process group: the engine core dies with the server."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def hits(self) -> tuple[float, float]:
        """Prompt tokens looked up in the prefix cache and found there (0 before the first
        request: labelled counters appear with their first sample)."""
        m = _metrics(self.url)
        return (
            m.get(("kvserve:prefix_cache_queries_total", ""), 0.0),
            m.get(("kvserve:prefix_cache_hits_total", ""), 0.0),
        )


class RouterProcess:
    def __init__(self, instances: list[Instance], policy: str, api_key: str | None = None) -> None:
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-router-", suffix=".log")
        backends = [arg for i in instances for arg in ("--backend", i.backend_arg)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.entrypoints.cli", "--log-level", "INFO", "router",
             "--port", self.url.rsplit(":", 1)[1], "--policy", policy, *backends,
             "--backend-api-key", INSTANCE_KEY, *(["--api-key", api_key] if api_key else [])],
            stdout=self.log, stderr=subprocess.STDOUT, env=ENV,
        )  # fmt: skip
        _wait_healthy(self.url, self.proc, self.log)
        self.client = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=api_key or "EMPTY", max_retries=0
        )

    def complete(self, prompt: str) -> str:
        """Sends one completion; returns the instance that served it."""
        raw = self.client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0
        )
        assert raw.parse().choices[0].text is not None
        return raw.headers["x-kvserve-backend"]

    def indexed_blocks(self) -> float:
        return sum(
            v
            for (name, _), v in _metrics(self.url).items()
            if name == "kvserve_router_indexed_blocks"
        )

    def wait_index_settled(self, before: float) -> None:
        """Until the index grew past `before` and held still for a few polls: the KV
        events of the requests just served have reached the router."""
        deadline, stable, last = time.monotonic() + 30, 0, -1.0
        while time.monotonic() < deadline and stable < 3:
            now = self.indexed_blocks()
            stable = stable + 1 if now == last and now > before else 0
            last = now
            time.sleep(0.1)
        assert stable >= 3, f"the router's index did not settle ({last} blocks)"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[Instance]]:
    instances = [Instance() for _ in range(3)]
    for instance in instances:
        instance.start()
    try:
        for instance in instances:
            instance.wait()
        yield instances
    finally:
        # All signalled first: each drains its shutdown alongside the others.
        running = [i.proc for i in instances if i.proc is not None and i.proc.poll() is None]
        for proc in running:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in running:
            proc.wait(timeout=60)


def _conversation(topic: str, turns: int) -> list[str]:
    """Each turn's prompt is the previous one plus more text (about 40 tokens a turn)."""
    prompt = f"A long conversation about {topic}. " * 6
    prompts = []
    for turn in range(turns):
        prompt += f" Question {turn} about {topic}: tell me one more fact, please, in detail."
        prompts.append(prompt)
    return prompts


def _run_workload(
    router: RouterProcess, fleet: list[Instance], topics: list[str]
) -> tuple[float, list[list[str]]]:
    """3 turns of 4 conversations, turn by turn: the fleet's hit rate and who served what."""
    before = [i.hits() for i in fleet]
    convs = [_conversation(t, 3) for t in topics]
    served: list[list[str]] = [[] for _ in convs]
    for turn in range(3):
        blocks = router.indexed_blocks()
        for c, prompts in enumerate(convs):
            served[c].append(router.complete(prompts[turn]))
        router.wait_index_settled(blocks)
    after = [i.hits() for i in fleet]
    queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return hits / queries, served


def test_prefix_routing_follows_conversations_and_beats_round_robin(fleet: list[Instance]) -> None:
    prefix = RouterProcess(fleet, "prefix")
    round_robin = RouterProcess(fleet, "round_robin")
    try:
        rate_prefix, served = _run_workload(prefix, fleet, [f"{t} (A)" for t in TOPICS[:4]])
        for turns in served:
            assert turns == [turns[0]] * 3, served  # every turn where its prefix lives
        assert len({turns[0] for turns in served}) >= 2  # new conversations spread out
        rate_rr, _ = _run_workload(round_robin, fleet, [f"{t} (B)" for t in TOPICS[:4]])
        print(f"fleet prefix hit rate: prefix router {rate_prefix:.3f}, round robin {rate_rr:.3f}")
        assert rate_prefix > 0.3 and rate_prefix >= 2 * rate_rr
    finally:
        prefix.stop()
        round_robin.stop()


def test_router_survives_an_instance_and_uses_it_again(fleet: list[Instance]) -> None:
    router = RouterProcess(fleet, "prefix")
    try:
        victim = fleet[0]
        victim.kill()
        for topic in TOPICS:  # every request answered, none by the dead instance
            assert router.complete(_conversation(f"{topic} (C)", 1)[0]) != victim.url
        assert _metrics(router.url)[("kvserve_router_backend_healthy", victim.url)] == 0
        victim.start()
        victim.wait()
        deadline = time.monotonic() + 30
        while _metrics(router.url)[("kvserve_router_backend_healthy", victim.url)] != 1:
            assert time.monotonic() < deadline, "the router never took the instance back"
            time.sleep(0.2)
        # The least used instance takes new conversations; the next turn follows the
        # prefix the restarted instance now caches (its new event stream, learned afresh).
        blocks = router.indexed_blocks()
        first = _conversation("lighthouses (D)", 2)
        assert router.complete(first[0]) == victim.url
        router.wait_index_settled(blocks)
        assert router.complete(first[1]) == victim.url
    finally:
        router.stop()


def test_router_requires_its_key_sends_the_instances_theirs_and_refuses_non_text(
    fleet: list[Instance],
) -> None:
    router = RouterProcess(fleet, "prefix", api_key="router-key")
    try:
        assert router.complete("The capital of France is") in {i.url for i in fleet}
        unkeyed = openai.OpenAI(base_url=f"{router.url}/v1", api_key="EMPTY", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            unkeyed.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):  # the router's key is not theirs
            openai.OpenAI(
                base_url=f"{fleet[0].url}/v1", api_key="router-key", max_retries=0
            ).models.list()
        # A body the router cannot forward (no UTF-8 form; json.dumps escapes it, as a
        # client in another language might send it): its own 400, and it stays up.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "\udc00"}]}
        bad = httpx.post(
            f"{router.url}/v1/chat/completions",
            content=json.dumps(body),
            headers={"authorization": "Bearer router-key", "content-type": "application/json"},
            timeout=30,
        )
        assert bad.status_code == 400, bad.text
        assert "messages.0.content" in bad.json()["error"]["message"]
        assert router.client.models.list().data
    finally:
        router.stop()
