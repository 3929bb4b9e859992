"""The compressed serdes (zstd, int8-zstd, int4-zstd) on real KV from SmolLM2: their error
bounds, their sizes, damaged values as misses with and without a MAC, and an engine whose
remote tier (a real cache server) stores int4-zstd chunks and loads them back. One engine
for the module: its first ask fills both tiers and gives the real KV the other tests use."""

from __future__ import annotations

import json
import random
import socket
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import zstandard

from kvserve.benchmarks.kvcache import make_document_ids, measure_serdes
from kvserve.kvcache import serde
from kvserve.kvcache.builder import CacheEngineBuilder
from kvserve.kvcache.integrity import PLAIN, KeyedKVAuthenticator, KVAuthenticator
from kvserve.kvcache.key import CacheEngineKey
from kvserve.kvcache.server.wire import recv_reply, send_request
from kvserve.kvcache.stats import CacheStats
from kvserve.kvcache.storage.cache_server_backend import CacheServerBackend
from kvserve.sampling_params import SamplingParams
from tests.kvcache.conftest import CacheServerProcess
from tests.reference import assert_no_leak

COMPRESSED = ("zstd", "int8-zstd", "int4-zstd")
CHUNK = 256
DOC_TOKENS = 600  # two full chunks
DOC_SEED = 31
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
# Relative L2 error each serde keeps on SmolLM2's KV (measured: 0.003/0.005 at 8 bits,
# 0.05/0.08 at 4 bits for K/V), with headroom; zstd is exact.
REL_ERROR = {"zstd": 0.0, "int8-zstd": 0.01, "int4-zstd": 0.1}
# Bytes stored over float32 bytes (measured: 0.83, 0.25, 0.124).
MAX_RATIO = {"zstd": 0.9, "int8-zstd": 0.26, "int4-zstd": 0.13}


def _transfer(**extra: Any) -> str:
    return json.dumps({"kv_connector": "TieredCacheConnector", "kv_connector_extra_config": extra})


def _cache_engine(llm: Any) -> Any:
    return CacheEngineBuilder.get(llm.llm_engine.config.kv_transfer_config.engine_id)


@pytest.fixture(scope="module")
def cache_server() -> Iterator[CacheServerProcess]:
    server = CacheServerProcess("--max-memory", "256MiB")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiered_llm(llm_factory: Callable[..., Any], cache_server: CacheServerProcess) -> Any:
    """SmolLM2 with a raw CPU tier and the cache server as an int4-zstd remote tier."""
    extra = {"remote_url": cache_server.url, "remote_serde": "int4-zstd"}
    return llm_factory(kv_transfer_config=_transfer(**extra))


@pytest.fixture(scope="module")
def first_ask(tiered_llm: Any) -> tuple[list[int], Any, torch.Tensor]:
    """A document asked once (stored in both tiers), and SmolLM2's KV for its two full
    chunks as the CPU tier holds it (raw float32)."""
    ids = make_document_ids(tiered_llm.get_tokenizer(), DOC_TOKENS, seed=DOC_SEED)
    out = tiered_llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    kv = _cache_engine(tiered_llm).retrieve(ids).kv()
    assert kv is not None and kv.shape == (30, 2, 2 * CHUNK, 3, 64)
    return ids, out, kv.clone()


@pytest.fixture(scope="module")
def real_kv(first_ask: tuple[list[int], Any, torch.Tensor]) -> torch.Tensor:
    return first_ask[2]


def _chunk(kv: torch.Tensor, i: int) -> torch.Tensor:
    return kv[:, :, i * CHUNK : (i + 1) * CHUNK].contiguous()


def _quantization_step(kv: torch.Tensor, bits: int) -> torch.Tensor:
    """The documented step: (max - min) / (2**bits - 1) per channel over the chunk's tokens."""
    return (kv.amax(dim=2, keepdim=True) - kv.amin(dim=2, keepdim=True)) / (2**bits - 1)


@pytest.mark.parametrize("name", COMPRESSED)
def test_round_trip_within_the_stated_bound_on_real_kv(name: str, real_kv: torch.Tensor) -> None:
    for i in range(2):
        chunk = _chunk(real_kv, i)
        meta, payload = serde.encode(chunk, name)
        assert meta.serde == name and meta.shape == tuple(chunk.shape)
        out = serde.decode(meta, payload)
        assert out.dtype == chunk.dtype and out.shape == chunk.shape
        assert len(payload) <= MAX_RATIO[name] * chunk.numel() * 4
        if name == "zstd":
            assert torch.equal(out, chunk)
            continue
        bits = 8 if name == "int8-zstd" else 4
        # Each element within half a step of its channel, up to float32 rounding.
        bound = _quantization_step(chunk, bits) / 2 + 1e-6 * chunk.abs().amax()
        assert torch.all((out - chunk).abs() <= bound)
        for slot in (0, 1):  # K, V
            rel = (out[:, slot] - chunk[:, slot]).norm() / chunk[:, slot].norm()
            assert rel < REL_ERROR[name], (slot, rel)


@pytest.mark.parametrize("name", COMPRESSED)
def test_odd_shapes_float16_and_constant_channels(name: str) -> None:
    bits = {"zstd": 0, "int8-zstd": 8, "int4-zstd": 4}[name]
    torch.manual_seed(1)
    # Odd element counts (4-bit padding), one token, no tokens, shapes without a token axis.
    for shape in ((1, 2, 7, 1, 3), (2, 2, 1, 2, 8), (2, 2, 0, 2, 8), (3, 5), (5,), ()):
        x = torch.randn(shape)
        out = serde.decode(*serde.encode(x, name))
        assert out.shape == x.shape and out.dtype == x.dtype
        if bits == 0 or x.numel() == 0:
            assert torch.equal(out, x)
        else:
            # A channel's range is within the whole tensor's, so is its step.
            step = (x.max() - x.min()) / (2**bits - 1)
            assert torch.all((out - x).abs() <= step / 2 + 1e-6)
    half = torch.randn(2, 2, 16, 2, 8).half()
    out = serde.decode(*serde.encode(half, name))
    assert out.dtype == torch.float16
    if bits == 0:
        assert torch.equal(out, half)
    else:
        step = _quantization_step(half.float(), bits)
        assert torch.all((out.float() - half.float()).abs() <= step / 2 + 1e-3)
    # A constant channel (step 0) decodes exactly.
    flat = torch.full((2, 2, 16, 2, 8), 3.25)
    assert torch.equal(serde.decode(*serde.encode(flat, name)), flat)


def _damaged(payload: bytes, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    n = len(payload)
    positions = [*range(48), *range(n - 8, n), *rng.sample(range(48, n - 8), 40)]
    for pos in positions:
        flipped = bytearray(payload)
        flipped[pos] ^= 1 << rng.randrange(8)
        yield f"bit flip at {pos}", bytes(flipped)
    for cut in (1, 4, n // 2, n - 1):
        yield f"truncated to {n - cut}", payload[: n - cut]
    yield "trailing byte", payload + b"\x00"
    yield "empty", b""


@pytest.mark.parametrize("name", COMPRESSED)
def test_decoder_alone_rejects_damage(name: str, real_kv: torch.Tensor) -> None:
    """No MAC: the zstd checksum and the header and length checks refuse every damaged
    value with a ValueError (which every tier turns into a miss)."""
    chunk = _chunk(real_kv, 0)
    meta, payload = serde.encode(chunk, name)
    for what, bad in _damaged(bytes(payload), random.Random(0)):
        with pytest.raises(ValueError):
            serde.decode(meta, bad)
            pytest.fail(f"{name}: {what} decoded")
    # The value read under a header it was not written with: another shape with the same
    # element count, another serde, another dtype.
    for wrong in (
        serde.ChunkMeta((30, 2, CHUNK, 64, 3), meta.dtype, name),
        serde.ChunkMeta((30, 2, CHUNK // 2, 3, 128), meta.dtype, name),
        serde.ChunkMeta(meta.shape, meta.dtype, next(s for s in COMPRESSED if s != name)),
        serde.ChunkMeta(meta.shape, "float16", name),
    ):
        with pytest.raises(ValueError):
            serde.decode(wrong, payload)


def test_a_frame_claiming_a_huge_size_is_refused_before_decompressing() -> None:
    """A few bytes under a header with a huge shape: refused by the expansion cap, not
    allocated (the frame is valid zstd of zeros)."""
    meta = serde.ChunkMeta((256, 2, 256, 8, 128), "float32", "int4-zstd")
    header = serde.mac_header(meta)
    prefix = b"KVZ1" + len(header).to_bytes(4, "little") + header
    prefix += bytes(-len(prefix) % 8)
    size = len(prefix) + 256 * 2 * 256 * 8 * 128 // 2 + 2 * 256 * 2 * 8 * 128 * 4
    coder = zstandard.ZstdCompressor(write_checksum=True).compressobj(size=size)
    frame = coder.compress(prefix) + coder.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    # Stream the zeros without holding them: 1 MiB at a time.
    zeros, left = bytes(1 << 20), size - len(prefix)
    while left:
        frame += coder.compress(zeros[: min(left, len(zeros))])
        left -= min(left, len(zeros))
    frame += coder.flush()
    assert len(frame) < size // 1000
    with pytest.raises(ValueError, match="claims"):
        serde.decode(meta, frame + zlib.crc32(frame).to_bytes(4, "little"))


class _RawClient:
    """A peer of the cache server that reads and writes stored values directly."""

    def __init__(self, server: CacheServerProcess) -> None:
        self.addr = (server.host, server.port)

    def _exchange(self, header: dict[str, Any], payload: bytes = b"") -> Any:
        with socket.create_connection(self.addr, timeout=10) as s:
            send_request(s, header, payload)
            return recv_reply(s, 1 << 30)

    def get(self, name: str) -> tuple[dict[str, Any], bytes]:
        header, blob = self._exchange({"op": "GET", "key": name})
        assert header["status"] == "ok"
        return header["meta"], bytes(blob)

    def put(self, name: str, meta: dict[str, Any], blob: bytes) -> None:
        header, _ = self._exchange({"op": "PUT", "key": name, "meta": meta}, blob)
        assert header["status"] == "ok"


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("SmolLM2", 1, 0, f"{i:064x}", "float32")


@pytest.mark.parametrize("name", ["int4-zstd", "zstd"])
@pytest.mark.parametrize("secret", [None, b"compressed-serde-test-secret-0123456789"])
def test_damaged_remote_values_are_misses(
    name: str, secret: bytes | None, real_kv: torch.Tensor, cache_server: CacheServerProcess
) -> None:
    """The cache server keeps values as opaque bytes (no checksum of its own): a value a
    peer damaged there is a miss, caught by the MAC when a secret is set and by the
    decoder when none is, and deleted; the untouched value next to it still loads."""
    auth: KVAuthenticator = PLAIN if secret is None else KeyedKVAuthenticator(secret)
    stats = CacheStats()
    backend = CacheServerBackend(
        cache_server.host, cache_server.port, stats, serde_name=name, auth=auth
    )
    raw = _RawClient(cache_server)
    chunk = _chunk(real_kv, 1)
    base = 1000 * (COMPRESSED.index(name) + 1) + (0 if secret is None else 500)
    good = _key(base)
    backend.put(good, chunk)
    meta, blob = raw.get(good.to_string())
    assert len(blob) <= MAX_RATIO[name] * chunk.numel() * 4 + 32
    flipped = bytearray(blob)
    flipped[len(blob) // 3] ^= 0x10
    other_shape = {**meta, "shape": [30, 2, CHUNK, 64, 3]}
    cases = [
        (meta, bytes(flipped)),
        (meta, blob[: len(blob) // 2]),
        (meta, blob[:-1]),
        (other_shape, blob),
        ({**meta, "serde": "int8-zstd" if name != "int8-zstd" else "zstd"}, blob),
    ]
    for i, (bad_meta, bad_blob) in enumerate(cases, start=1):
        bad = _key(base + i)
        raw.put(bad.to_string(), bad_meta, bad_blob)
        assert backend.get(bad) is None, i
        assert not backend.contains(bad)  # deleted, so later lookups skip it
    tier = stats.tier(backend.name)
    assert tier.misses == len(cases) and tier.hits == 0
    failures = tier.auth_failures if secret is not None else tier.errors
    assert failures == len(cases)
    loaded = backend.get(good)
    assert loaded is not None and tier.hits == 1
    if name == "zstd":
        assert torch.equal(loaded, chunk)
    else:
        assert torch.all((loaded - chunk).abs() <= _quantization_step(chunk, 4) / 2 + 1e-5)


def test_engine_loads_from_the_int4_zstd_remote_tier(
    tiered_llm: Any, first_ask: tuple[list[int], Any, torch.Tensor]
) -> None:
    ids, first, reference_kv = first_ask
    engine = _cache_engine(tiered_llm)
    # Only the remote tier holds the chunks now: the next ask loads and decodes them.
    engine.clear()
    tiered_llm.reset_prefix_cache()
    second = tiered_llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 2 * CHUNK
    tier = engine.stats.tier("cache_server")
    assert tier.hits == 2 and tier.errors == 0 and tier.auth_failures == 0
    assert tier.bytes_stored <= MAX_RATIO["int4-zstd"] * reference_kv.numel() * 4 + 64
    # What was loaded (now promoted into the CPU tier) is the KV within the serde's bound.
    loaded = engine.retrieve(ids).kv()
    assert loaded is not None
    for i in range(2):
        got, want = _chunk(loaded, i), _chunk(reference_kv, i)
        assert torch.all((got - want).abs() <= _quantization_step(want, 4) / 2 + 1e-5)
    assert len(second.outputs[0].token_ids) == len(first.outputs[0].token_ids)
    assert_no_leak(tiered_llm)


def test_bench_reports_size_cost_and_error_per_serde(real_kv: torch.Tensor) -> None:
    """`kvserve bench kvcache`'s serde table, on the same real KV."""
    chunks = [_chunk(real_kv, i) for i in range(2)]
    table = measure_serdes(chunks, serde.SERDES, repeats=1)
    assert list(table) == list(serde.SERDES)
    assert table["raw"]["ratio_to_raw"] == 1.0 and table["raw"]["bytes_per_token"] == 46080
    for name in ("raw", "zstd"):
        assert table[name]["max_abs_error"] == 0.0
    assert 1.05 < table["zstd"]["ratio_to_raw"] < 2
    assert table["int8-zstd"]["ratio_to_raw"] > table["int8"]["ratio_to_raw"] > 3.5
    assert table["int4-zstd"]["ratio_to_raw"] > 7.5
    for name in ("int8-zstd", "int4-zstd"):
        assert table[name]["rel_error_k"] < REL_ERROR[name]
        assert table[name]["rel_error_v"] < REL_ERROR[name]
        assert table[name]["decode_ms_per_chunk"] > 0
