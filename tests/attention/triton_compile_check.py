"""Compiles the TRITON backend's kernels for an H100 (sm_90) with Triton's bundled ptxas,
no GPU needed: the compiled path's front end (constexpr branches, loop-carried types,
early returns, dot shapes) is checked on a CPU, where the tests otherwise only run the
interpreter. Run as a script in a process without TRITON_INTERPRET (the interpreter's
mode would hand the compiler interpreted functions); prints one line per kernel."""

from __future__ import annotations

import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvserve.attention.ops import triton_reshape_and_cache as cache_ops
from kvserve.attention.ops import triton_unified_attention as attn_ops

TARGET = GPUTarget("cuda", 90, 32)


def _compile(kernel: triton.JITFunction, types: dict[str, str], constexprs: dict) -> int:
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "i32")
        for name in kernel.arg_names
    }
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=TARGET
    )
    return len(compiled.asm["cubin"])


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET"
    pointers = ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")
    types = {name: "*bf16" for name in pointers}
    types.update({f"part_{p}_ptr": "*fp32" for p in ("out", "max", "sum")})
    types.update({"scale": "fp32", "soft_cap": "fp32"})
    for name in ("block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr", "positions_ptr"):
        types[name] = "*i32"
    # Every variant switched on, split-KV included: the branches that plain layers skip.
    constexprs = dict(
        NUM_QUERIES_PER_KV=4, HEAD_SIZE=64, HEAD_PAD=64, BLOCK_SIZE=16, BLOCK_Q=4,
        BLOCK_M=16, TILE_N=16, CAUSAL=True, USE_WINDOW=True, USE_SINKS=True,
        USE_CHUNK=True, USE_SOFTCAP=True, NUM_SPLITS=8, USE_POSITIONS=True,
    )  # fmt: skip
    size = _compile(attn_ops._unified_attention_kernel, types, constexprs)
    print(f"unified_attention sm_90 cubin {size} bytes")
    merge_types = {"out_ptr": "*bf16"} | {f"part_{p}_ptr": "*fp32" for p in ("out", "max", "sum")}
    size = _compile(
        attn_ops._merge_splits_kernel, merge_types, dict(HEAD_SIZE=64, HEAD_PAD=64, NUM_SPLITS=8)
    )
    print(f"merge_splits sm_90 cubin {size} bytes")
    cache_types = {name: "*bf16" for name in ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")}
    cache_types["slot_mapping_ptr"] = "*i64"
    size = _compile(
        cache_ops._reshape_and_cache_kernel,
        cache_types,
        dict(NUM_KV_HEADS=8, HEAD_SIZE=64, HEADS_PAD=8, HEAD_PAD=64, BLOCK_SIZE=16),
    )
    print(f"reshape_and_cache sm_90 cubin {size} bytes")


if __name__ == "__main__":
    main()
