"""KV that leaves an engine is authenticated: the MAC binds key, header and bytes; a chunk
planted in Redis or the cache server (forged bytes under the right key and shape, or a
valid chunk copied under another key) is a counted miss and the request recomputes HF's
tokens; a shared store without a secret refuses to start unless the operator opts out."""

from __future__ import annotations

import argparse
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from kvserve.args.engine_args import EngineArgs
from kvserve.benchmarks.kvcache import make_document_ids
from kvserve.config import KVSecurityConfig
from kvserve.distributed.kv_transfer.kv_connector.base import KVConnectorRole
from kvserve.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from kvserve.kvcache.builder import CacheEngineBuilder
from kvserve.kvcache.integrity import (
    ENV_SECRET,
    PLAIN,
    KeyedKVAuthenticator,
    KVSecurityError,
    kv_authenticator,
)
from kvserve.kvcache.server.wire import recv_reply, send_request
from kvserve.kvcache.stats import CacheStats
from kvserve.kvcache.storage.cache_server_backend import CacheServerBackend
from kvserve.kvcache.storage.redis_backend import META_PREFIX, VALUE_PREFIX, RedisBackend
from kvserve.sampling_params import SamplingParams
from tests.reference import assert_no_leak, hf_reference

SECRET = b"the operator's secret, 32 bytes!"
WRONG = b"an attacker's guess at the secret"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
CHUNK = 256


def test_the_mac_binds_key_header_and_bytes() -> None:
    auth = KeyedKVAuthenticator(SECRET)
    payload = bytes(range(256)) * 64
    blob = auth.seal("model@1@0@abc@float32", b"shape=[1,2]", payload)
    assert bytes(auth.open("model@1@0@abc@float32", b"shape=[1,2]", blob, "t") or b"") == payload
    forged = bytearray(blob)
    forged[100] ^= 1
    assert auth.open("model@1@0@abc@float32", b"shape=[1,2]", forged, "t") is None
    assert auth.open("model@1@0@abd@float32", b"shape=[1,2]", blob, "t") is None  # moved
    assert auth.open("model@1@0@abc@float32", b"shape=[2,1]", blob, "t") is None  # relabelled
    assert (
        KeyedKVAuthenticator(WRONG).open("model@1@0@abc@float32", b"shape=[1,2]", blob, "t") is None
    )
    assert auth.open("k", b"", b"short", "t") is None
    with pytest.raises(KVSecurityError, match="at least 16"):
        KeyedKVAuthenticator(b"short")


def test_secret_sources_and_the_refusal(tmp_path: Any) -> None:
    secret_file = tmp_path / "kv.secret"
    secret_file.write_bytes(SECRET + b"\n")
    secret_file.chmod(0o600)
    from_file = kv_authenticator(KVSecurityConfig(str(secret_file)), "Redis", environ={})
    from_env = kv_authenticator(KVSecurityConfig(), "Redis", environ={ENV_SECRET: SECRET.decode()})
    blob = from_file.seal("k", b"h", b"kv")
    assert from_env.open("k", b"h", blob, "t") is not None  # the same key either way
    # Local-only tiers need no secret; a shared one without it is refused, naming the fix.
    assert kv_authenticator(KVSecurityConfig(), None, environ={}) is PLAIN
    with pytest.raises(KVSecurityError) as refused:
        kv_authenticator(KVSecurityConfig(), "the KV tier's redis://h:6379/0", environ={})
    for hint in ("redis://h:6379/0", "--kv-secret-file", ENV_SECRET, "--allow-unauthenticated-kv"):
        assert hint in str(refused.value)
    opted_out = KVSecurityConfig(allow_unauthenticated_kv=True)
    assert kv_authenticator(opted_out, "Redis", environ={}) is PLAIN
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "empty").chmod(0o600)
    with pytest.raises(KVSecurityError, match="holds no secret"):
        kv_authenticator(KVSecurityConfig(str(tmp_path / "empty")), None, environ={})


@pytest.mark.parametrize(
    "transfer",
    [
        {
            "kv_connector": "TieredCacheConnector",
            "kv_connector_extra_config": {"remote_url": "redis://10.0.0.7:6379/0"},
        },
        {
            "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": {"shared_storage_path": "set below"},
        },
        {
            "kv_connector": "P2pZmqConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {},
        },
    ],
    ids=["redis", "shared_storage", "p2p"],
)
def test_a_shared_store_without_a_secret_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, transfer: dict[str, Any]
) -> None:
    monkeypatch.delenv(ENV_SECRET, raising=False)
    if "shared_storage_path" in transfer["kv_connector_extra_config"]:
        transfer["kv_connector_extra_config"]["shared_storage_path"] = str(tmp_path)
    args = ["--kv-transfer-config", json.dumps(transfer)]
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    config = EngineArgs.from_cli_args(parser.parse_args(args)).create_engine_config()
    with pytest.raises(KVSecurityError, match="--allow-unauthenticated-kv"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER)
    # The explicit opt-out starts it.
    opted = EngineArgs.from_cli_args(parser.parse_args([*args, "--allow-unauthenticated-kv"]))
    connector = KVConnectorFactory.create_connector(
        opted.create_engine_config(), KVConnectorRole.SCHEDULER
    )
    connector.shutdown()


# ---- planted chunks, end to end ----------------------------------------------------------


def _cache_server_copy(host: str, port: int, source: str, target: str) -> None:
    """Copies a stored value, header and bytes as they are, under another key."""
    with socket.create_connection((host, port), timeout=5) as sock:
        send_request(sock, {"op": "GET", "key": source})
        header, payload = recv_reply(sock, 1 << 32)
        send_request(sock, {"op": "PUT", "key": target, "meta": header["meta"]}, payload)
        assert recv_reply(sock, 0)[0]["status"] == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["redis", "cache_server"])
def test_planted_chunks_are_rejected_and_recomputed(
    llm_factory: Callable[..., Any], request: pytest.FixtureRequest, tier: str
) -> None:
    if tier == "redis":
        server = request.getfixturevalue("redis_server")
        url, host, port = server.url, "127.0.0.1", server.port
    else:
        server = request.getfixturevalue("cache_server_factory")("--max-memory", "1GiB")
        url, host, port = server.url, server.host, server.port
    extra = {"remote_url": url, "local_cpu": False}
    llm = llm_factory(
        kv_transfer_config=json.dumps(
            {"kv_connector": "TieredCacheConnector", "kv_connector_extra_config": extra}
        )
    )
    ids = make_document_ids(llm.get_tokenizer(), 2 * CHUNK + 50, seed=45)
    expected = hf_reference().greedy(ids, GREEDY.max_tokens)

    def ask() -> tuple[list[int], int]:
        llm.reset_prefix_cache()
        out = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), out.num_cached_tokens or 0

    engine = CacheEngineBuilder.get(llm.llm_engine.config.kv_transfer_config.engine_id)
    stats = engine.stats.tier(tier)
    assert ask() == (expected, 0)  # stores the two full chunks
    assert ask() == (expected, 2 * CHUNK)  # and loads them back: the secret round-trips
    keys = [chunk.key for chunk in engine.chunks(ids)]
    failures = stats.auth_failures

    # A valid chunk copied under another key: chunk 0's value where chunk 1 belongs.
    source, target = keys[0].to_string(), keys[1].to_string()
    if tier == "redis":
        raw = redis.Redis(port=port)
        for prefix in (VALUE_PREFIX, META_PREFIX):
            raw.set(prefix + target, raw.get(prefix + source) or b"")
        raw.close()
    else:
        _cache_server_copy(host, port, source, target)
    assert ask() == (expected, CHUNK)  # chunk 0 loads, chunk 1 is recomputed
    assert stats.auth_failures == failures + 1

    # A peer without the secret plants chunk 0: right key, right shape, its own bytes
    # (a consistent value, checksum and all; only its MAC is under another key).
    attacker_stats = CacheStats()
    attacker: Any
    if tier == "redis":
        attacker = RedisBackend(host, port, 0, attacker_stats, auth=KeyedKVAuthenticator(WRONG))
    else:
        attacker = CacheServerBackend(host, port, attacker_stats, auth=KeyedKVAuthenticator(WRONG))
    genuine = engine.storage.get(keys[0])
    assert genuine is not None
    attacker.put(keys[0], torch.randn_like(genuine) * 10)
    attacker.close()
    assert ask() == (expected, 0)  # rejected at chunk 0: the whole prompt recomputed
    assert stats.auth_failures == failures + 2
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    exported = scheduler.connector.get_kv_connector_stats()
    assert exported["tier_auth_failures"][tier] == failures + 2
    assert_no_leak(llm)


def test_a_secret_file_others_can_read_is_refused(tmp_path: Path) -> None:
    from kvserve.utils.kv_secret import read_kv_secret

    secret = tmp_path / "kv.secret"
    secret.write_text("a-secret-of-enough-length\n")
    secret.chmod(0o640)
    with pytest.raises(KVSecurityError, match="readable by other users; chmod 600"):
        read_kv_secret(str(secret), environ={})
    secret.chmod(0o600)
    assert read_kv_secret(str(secret), environ={}) == b"a-secret-of-enough-length"
