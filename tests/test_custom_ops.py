"""The C++ CPU kernels against the torch expressions they replace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve import _custom_ops as ops
from kvserve import kernel_build
from kvserve.model_executor.layers.activation import GeluAndMul, SiluAndMul
from kvserve.model_executor.layers.layernorm import RMSNorm
from kvserve.model_executor.layers.rotary_embedding import RotaryEmbedding
from tests.kernel_support import require_kernels

require_kernels()


def test_kernels_are_built_on_this_machine() -> None:
    # The CI machine has a compiler: the fast paths must really be in use there.
    assert ops.available() and ops.why_unavailable() is None
    assert ops.use_for(torch.zeros(1))
    assert not ops.use_for(torch.zeros(1, dtype=torch.float64))
    with ops.disabled():
        assert not ops.use_for(torch.zeros(1))


def test_a_built_library_loads_without_torchs_build_machinery() -> None:
    """After one build, a process loads the library straight from where torch's
    cpp_extension keeps it (importing cpp_extension costs a start ~0.5 s)."""
    from torch.utils import cpp_extension

    name = kernel_build.library_name()  # KVSERVE_MARCH=haswell builds kvserve_cpu_ops_haswell
    library = kernel_build.library_path(name)
    assert library.parent == Path(cpp_extension._get_build_directory(name, False))
    assert library.with_name(
        library.name + kernel_build._STAMP_SUFFIX
    ).is_file()  # this run's build
    probe = "import sys, torch; from kvserve import _custom_ops as o; o.available(); "
    probe += "print(o.available(), 'torch.utils.cpp_extension' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.stdout.split() == ["True", "False"], result.stderr


def test_a_stale_or_foreign_stamp_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    library = kernel_build.library_path("kvserve_cpu_ops")
    assert library.parent == tmp_path / "kvserve_cpu_ops"
    library.parent.mkdir()
    library.write_bytes(b"a library built from other sources")
    stamp = library.with_name(library.name + kernel_build._STAMP_SUFFIX)
    info = library.stat()
    # Another checkout's sources or flags: a different stamp.
    record = {"stamp": "other", "size": info.st_size, "mtime_ns": info.st_mtime_ns}
    stamp.write_text(json.dumps(record))
    assert not kernel_build._load_stamped("kvserve_cpu_ops", "ours")
    # Our stamp, but the library was rebuilt since (by another checkout): not ours.
    stamp.write_text(json.dumps({**record, "stamp": "ours", "size": info.st_size + 1}))
    assert not kernel_build._load_stamped("kvserve_cpu_ops", "ours")
    stamp.write_text("{truncated")
    assert not kernel_build._load_stamped("kvserve_cpu_ops", "ours")


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_rotary_kernel_matches_torch_bit_for_bit(scaling: dict | None) -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 64, 10000.0, scaling, max_position=4096)
    positions = torch.randint(0, 4096, (37,))
    qkv = torch.randn(37, 9 * 64 + 2 * 3 * 64)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)  # strided views, as in the model
    with ops.disabled():
        q_ref, k_ref = rope(positions, q.clone(), k.clone())
    q_out, k_out = rope(positions, q, k)
    assert q_out.data_ptr() == q.data_ptr()  # rotated in place
    assert torch.equal(q_out, q_ref)
    assert torch.equal(k_out, k_ref)


def test_rotary_kernel_rejects_positions_beyond_its_table() -> None:
    rope = RotaryEmbedding(64, 64, 10000.0, None, max_position=16)
    q, k = torch.randn(1, 64), torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="outside the rotary cache"):
        rope(torch.tensor([16]), q, k)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_rms_norm_kernels_match_torch(rows: int) -> None:
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576)
    x, residual = torch.randn(rows, 576) * 3, torch.randn(rows, 576)
    with ops.disabled():
        ref_plain = norm(x)
        ref_out, ref_sum = norm(x, residual)
    torch.testing.assert_close(norm(x), ref_plain, rtol=1e-6, atol=1e-6)
    out, summed = norm(x.clone(), residual.clone())
    assert torch.equal(summed, ref_sum)  # the residual add is exact
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)


def test_silu_and_mul_kernel_matches_torch() -> None:
    torch.manual_seed(1)
    x = torch.randn(33, 2 * 1536) * 4
    with ops.disabled():
        ref = SiluAndMul()(x)
    torch.testing.assert_close(SiluAndMul()(x), ref, rtol=1e-6, atol=1e-6)


def test_gelu_tanh_and_mul_kernel_matches_float64() -> None:
    # Gemma's MLP. The kernel's g * sigmoid(2u) is 0.5 g (1 + tanh(u)) rewritten; against
    # the float64 value it is within float32 rounding, closer than torch's float32 one
    # (whose 1 + tanh(u) cancels for negative g: up to 4e-4 relative).
    torch.manual_seed(2)
    x = torch.randn(33, 2 * 1536) * 4
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 100.0, -100.0])
    gate, up = x.double().chunk(2, dim=-1)
    inner = (2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)
    want = 0.5 * gate * (1 + torch.tanh(inner)) * up
    got = GeluAndMul(approximate="tanh")(x)
    torch.testing.assert_close(got.double(), want, rtol=4e-6, atol=1e-6)


def test_cache_write_skips_negative_slots_and_matches_index_copy() -> None:
    from kvserve.attention.backends.utils import write_to_kv_cache

    kv_cache = torch.zeros(2, 4, 8, 3, 64)  # [K/V, blocks, block_size, kv heads, head size]
    key, value = torch.randn(4, 3, 64), torch.randn(4, 3, 64)
    query = torch.randn(4, 9, 64)
    slots = torch.tensor([5, -1, 17, 31])
    no_decodes = (
        torch.zeros((0, 1), dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        torch.zeros(0, dtype=torch.long),
    )
    out = torch.zeros_like(query)
    ops.cache_and_decode_attention(
        out, query, key, value, kv_cache, slots, *no_decodes, 0.125, None
    )  # fmt: skip
    expected = torch.zeros_like(kv_cache)
    valid = torch.nonzero(slots >= 0).flatten()
    write_to_kv_cache(key, value, expected, slots[valid], valid)
    assert torch.equal(kv_cache, expected)
    assert not out.any()  # no decode rows: the output is untouched


def test_block_kernels_check_the_scale_planes_of_each_kind() -> None:
    # Kind 3 (repacked Q4_K) takes float32 scales and minimums; kind 4 (repacked Q6_K)
    # two float32 scales per block and no minimum; kinds 0-2, 5-9 and 12-15 float16.
    qs = torch.zeros(2, 16, dtype=torch.uint8)
    f32, f16 = torch.ones(2, 1), torch.ones(2, 1, dtype=torch.float16)
    q8 = torch.full((2, 32), 3, dtype=torch.int8)
    halves = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    expected = torch.cat([3 * halves[:, :1].expand(2, 16), 3 * halves[:, 1:].expand(2, 16)], 1)
    assert torch.equal(ops.dequantize_blocks(q8, halves, torch.empty(0), 4), expected)
    with pytest.raises(RuntimeError, match="2 scale"):
        ops.dequantize_blocks(q8, f32, torch.empty(0), 4)
    assert torch.equal(ops.dequantize_blocks(qs, f32, -f32, 3), torch.zeros(2, 32) - 1)
    with pytest.raises(RuntimeError, match="float32 for kind 3"):
        ops.dequantize_blocks(qs, f16, f16, 3)
    with pytest.raises(RuntimeError, match="float16 for kind 1"):
        ops.dequantize_blocks(qs, f32, f32, 1)
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):  # interleaved Q4_1
        ops.dequantize_blocks(qs, f16, f16, 8)
    with pytest.raises(RuntimeError, match="20 bytes a row"):  # interleaved 5-bit Q8_0
        ops.dequantize_blocks(torch.zeros(16, 30, dtype=torch.uint8), f16, f16, 12)
    with pytest.raises(RuntimeError, match="float16 for kind 13"):  # compact Q4_K's d, dmin
        ops.dequantize_blocks(qs, f32, f32, 13)
    with pytest.raises(RuntimeError, match="24 bytes a row"):  # interleaved 6-bit Q6_K
        ops.dequantize_blocks(torch.zeros(16, 30, dtype=torch.uint8), f16, f16, 15)
    with pytest.raises(RuntimeError, match="unknown block kind"):
        ops.dequantize_blocks(qs, f32, f32, 16)
