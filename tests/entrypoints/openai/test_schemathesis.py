"""schemathesis fuzzes every operation of the server's own OpenAPI schema: 2xx or 4xx, never 5xx.

A real `kvserve serve` with a short context (48 tokens), so no generated request can ask
for a long generation. Valid and invalid bodies (schemathesis' positive and negative
modes) for every operation, a bounded number per operation, derandomized: the run is the
same every time and stays short.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.slow

EXAMPLES_PER_OPERATION = 8


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[RemoteServer]:
    remote = RemoteServer("--max-model-len", "48", "--max-num-seqs", "16")
    yield remote
    remote.stop()


def fuzz(server: RemoteServer, operation: schemathesis.APIOperation, mode: GenerationMode) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        derandomize=True,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def one(case: schemathesis.Case) -> None:
        response = case.call(base_url=server.base_url, timeout=120)
        assert response.status_code < 500, (
            f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\n"
            f"body: {case.body!r}"
        )

    one()


def test_no_generated_request_gets_a_5xx_and_the_server_stays_healthy(
    fuzz_server: RemoteServer,
) -> None:
    schema = schemathesis.openapi.from_url(fuzz_server.url("/openapi.json"))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    for operation in operations:
        fuzz(fuzz_server, operation, GenerationMode.POSITIVE)
        if operation.method.upper() == "POST":  # only a body can be invalid
            fuzz(fuzz_server, operation, GenerationMode.NEGATIVE)
    assert httpx.get(fuzz_server.url("/health"), timeout=10).status_code == 200
    body = {"prompt": "hi", "max_tokens": 2}
    response = httpx.post(fuzz_server.url("/v1/completions"), json=body, timeout=60)
    assert response.status_code == 200, response.text
