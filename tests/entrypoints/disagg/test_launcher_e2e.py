"""`kvserve disagg`: a producer, a consumer and the proxy from one command, the KV sent
straight from producer to consumer (P2pZmqConnector, the default) or going through a real
redis-server (`--kv-tier`, for instances that cannot reach each other). Answers equal the
producer's own (plain: a producer never loads KV); the consumer got the prompts' KV
from the producer or the tier; SIGTERM to the command stops all three processes."""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.entrypoints.disagg.helpers import MODEL, Process
from tests.entrypoints.openai.utils import SERVER_ARGS
from tests.kvcache.conftest import RedisServer, find_redis_server

pytestmark = pytest.mark.slow

TOPICS = ["ocean tides", "volcanoes", "honey bees"]
KEY = "disagg-test-key"


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server binary (apt-get install redis-server)")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


def _urls(launcher: Process) -> tuple[str, str]:
    found = re.search(r"producer (\S+), consumer (\S+)\)", launcher.output())
    assert found, launcher.output()
    return found.group(1), found.group(2)


def _prompt(topic: str) -> str:
    return (
        f"Here is a short story about {topic}. Once upon a time, in a quiet village by the "
        f"sea, there lived a curious child who loved {topic} more than anything else, and"
    )


def _metric(url: str, name: str, kind: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and f'kind="{kind}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("kv_path", ["p2p", "redis"])
def test_disagg_answers_and_stops_on_sigterm(kv_path: str, request: pytest.FixtureRequest) -> None:
    tier = [] if kv_path == "p2p" else ["--kv-tier", request.getfixturevalue("redis").url]
    # The key guards the proxy and both instances; the proxy sends it on.
    launcher = Process(
        "disagg",
        ["disagg", *tier, "--api-key", KEY, "--serve-args", shlex.join(SERVER_ARGS)],
        key=KEY,
    )
    try:
        launcher.wait_healthy(timeout=600)
        producer, consumer = _urls(launcher)
        assert httpx.get(f"{producer}/v1/models", timeout=10).status_code == 401
        plain = openai.OpenAI(base_url=f"{producer}/v1", api_key=KEY, max_retries=0)
        for topic in TOPICS:
            reference = plain.completions.create(
                model=MODEL, prompt=_prompt(topic), max_tokens=8, temperature=0.0
            )
            answer = launcher.client().completions.create(
                model=MODEL, prompt=_prompt(topic), max_tokens=8, temperature=0.0
            )
            assert answer.choices[0].text == reference.choices[0].text
            chunks = launcher.client().completions.create(
                model=MODEL, prompt=_prompt(topic), max_tokens=8, temperature=0.0, stream=True
            )
            assert "".join(c.choices[0].text for c in chunks) == reference.choices[0].text
        if kv_path == "p2p":  # 6 transfers, every prompt token but the last
            sent = _metric(consumer, "kvserve:kv_connector_transfer_requests_total", "received")
            assert sent == 2 * len(TOPICS), sent
        else:  # the consumer found (almost) every prompt token in the tier
            hit = _metric(consumer, "kvserve:kv_connector_lookup_tokens_total", "hit")
            assert hit >= 3 * 32, hit
    finally:
        launcher.stop()
    assert launcher.proc.returncode == 0
    for url in (producer, consumer):  # both instances went with the command
        deadline = time.monotonic() + 10
        while True:
            try:
                httpx.get(f"{url}/health", timeout=1)
            except httpx.TransportError:
                break
            assert time.monotonic() < deadline, f"{url} still answers after SIGTERM"
            time.sleep(0.2)
