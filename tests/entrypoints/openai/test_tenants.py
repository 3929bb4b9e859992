"""Tenants (--api-key-file): one tenant's KV never serves another's requests, while each
tenant's own requests still share their prefixes, through the prefix cache and the tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"alpha": "key-of-alpha", "beta": "key-of-beta"}
PROMPT = "Count with me, slowly and carefully: " + " ".join(str(i) for i in range(200, 290))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    folder = tmp_path_factory.mktemp("tenants")
    key_file = folder / "keys"
    key_file.write_text("# key tenant\n" + "".join(f"{k} {t}\n" for t, k in KEYS.items()))
    key_file.chmod(0o600)
    tiers = folder / "tiers.yaml"
    tiers.write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 64MiB\n")
    remote = RemoteServer("--api-key-file", str(key_file), "--kv-cache-config", str(tiers))
    yield remote
    remote.stop()


def _cached_tokens(server: RemoteServer) -> dict[str, float]:
    """Per tenant, the prompt tokens its requests found cached (prefix cache or tier)."""
    text = httpx.get(server.url("/metrics"), timeout=10).text
    return {
        sample.labels["tenant"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvserve:tenant_cached_prompt_tokens_total"
    }


def _complete(server: RemoteServer, tenant: str) -> tuple[str, float]:
    """The greedy text, and how many of its prompt tokens were found cached."""
    before = _cached_tokens(server).get(tenant, 0.0)
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=KEYS[tenant], max_retries=0)
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    return str(text.choices[0].text), _cached_tokens(server).get(tenant, 0.0) - before


def test_tenants_share_no_kv_and_each_reuses_its_own(server: RemoteServer) -> None:
    first, cached = _complete(server, "alpha")
    assert cached == 0
    again, cached = _complete(server, "alpha")
    assert again == first and cached >= 256  # its own prefix, found
    # The same prompt from the other tenant: computed afresh, from neither the prefix
    # cache nor the tier chunk alpha's request stored; the same tokens.
    other, cached = _complete(server, "beta")
    assert other == first and cached == 0
    _, cached = _complete(server, "beta")
    assert cached >= 256
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url("/v1"), api_key="nobody", max_retries=0).models.list()


def test_a_key_file_others_can_read_is_refused_at_start(tmp_path: Path) -> None:
    from kvserve.entrypoints.openai.tenants import load_api_keys

    key_file = tmp_path / "keys"
    key_file.write_text("k1 alpha\n")
    key_file.chmod(0o644)
    with pytest.raises(ValueError, match="readable by other users"):
        load_api_keys(str(key_file))
    key_file.chmod(0o600)
    key_file.write_text("k1 alpha extra\n")
    with pytest.raises(ValueError, match="expected 'KEY TENANT'"):
        load_api_keys(str(key_file))
