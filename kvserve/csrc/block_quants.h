// GGUF block kinds and the loads every block kernel shares: a block's quants or weights
// as floats (dequant_block, load_quants, load_quants16, load_weights16) and its float16
// scales (f16). Included by block_gemm.h.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvserve_cpu {

// ---- GGUF block weights ------------------------------------------------------------
// Linear layers can keep llama.cpp's 32-weight blocks instead of float32 weights, split
// into planes: qs (the quants), d (block scale) and m (block minimum, Q4_1 only), both
// scales float16 as in the file (decode streams every byte of them per token: float32
// scales would be 20% more traffic for Q4_1). Dequantization is the gguf package's own
// expression on the exactly converted scales, so a dequantized block equals the float32
// weight the model would otherwise load, bit for bit.
//   kind 0, Q8_0: w = d * q, q int8;                 qs: int8  [N, K]
//   kind 1, Q4_1: w = d * q + m, q in 0..15;         qs: uint8 [N, K/2]
//   kind 2, Q4_0: w = d * (q - 8), q in 0..15;       qs: uint8 [N, K/2]
//   kind 3, Q4_1 with float32 d and m (GGUF's Q4_K, repacked at load by
//           model_executor/layers/gguf_repack.py: a Q4_K sub-block's d * sc and
//           -dmin * min are exact in float32, not in float16); qs as Q4_1.
//   kind 4, Q8_0's int8 qs with two float32 scales per block, one per 16 weights (GGUF's
//           Q6_K, repacked at load: q - 32 in -32..31 and a sub-block's d * sc, exact in
//           float32); d: float32 [N, K/16], no minimum.
//   kind 5, Q4_1 and kind 6, Q4_0 in nibble planes: the same planes as kinds 1 and 2 with
//           each pair of blocks' 32 quant bytes reordered once at load for the AVX2 float
//           GEMV (block_gemm_planes.h; rows of a multiple of 64 weights).
//   kinds 7-11: kinds 0-4 (Q8_0, Q4_1, Q4_0, repacked Q4_K and Q6_K) interleaved 16 rows
//           at a time for the lossless digit matmul (block_gemm_exact.cpp: AVX-512 VNNI,
//           and AVX2 for the 4-bit kinds 8-10; rows a multiple of 16): per group g of 16
//           rows and block b, qs holds at (g nb + b) 16 bb the rows' 4-byte chunks c in
//           order (chunk c of row i at (16 c + i) 4; the byte kinds' quants as unsigned
//           q + 128), d and m the 16 rows' scales at (g nb + b) 16 (kind 11: its two
//           scales per block at ((g nb + b) 2 + half) 16).
//   kind 12: Q8_0 whose quants all lie in -16..15 (GGUF's Q5_0, repacked) interleaved in
//           5 bits: per group and block 20 bytes a row, kind 9's 256 bytes of nibbles of
//           q + 16, then for each chunk c two 64-bit masks of the fifth bits (bit 4 i + j:
//           weight 4 c + j of row i, then weight 16 + 4 c + j); d as kind 7's. A third
//           less to read than kind 7.
//   kinds 13-14: kinds 10 and 11 (GGUF's Q4_K and Q6_K) with the file's scale fields in
//           place of their float32 scales (AVX-512 VNNI, kind 13 also AVX2; rows a
//           multiple of 16; columns of whole 256-weight super-blocks, sb = cols / 256 of
//           them): qs as kinds 10 and 11; d the float16 super-block scales, per group g
//           and super-block s at ((g sb + s) P + p) 16 (kind 13, P = 2: p = 0 the rows' d,
//           1 their dmin; kind 14, P = 1: d); m the blocks' 8-bit sub-scales at
//           ((g nb + b) 2 + p) 16 (kind 13: uint8 p = 0 sc, 1 min; kind 14: int8 sc of the
//           block's half p). A block's scale is float32(d) * float32(sc), its minimum
//           -(float32(dmin) * float32(min)): exact in float32, the very values of kinds 10
//           and 11, so the results are theirs bit for bit. Bytes per 32 weights: Q4_K 18.5 (kind 10: 24),
//           Q6_K 34.25 (kind 11: 40); decode streams every one of them per token.
//   kind 15: kind 14 with its quants in 6 bits, as kind 12 holds Q8_0's in 5: per group
//           and block 24 bytes a row, kind 9's 256 bytes of nibbles of the file's 6-bit
//           quants u (w = d sc (u - 32); the low nibbles are the block's first half, the
//           high its second, each half with its own sc), then for each chunk c four 64-bit
//           masks, bit 4 i + j for row i's byte j: bits 4 and 5 of the low nibbles' quants
//           (weight 4 c + j), then of the high nibbles' (16 + 4 c + j); d and m as kind
//           14's. 26.25 bytes per 32 weights, the file's own size.
// In a 4-bit block, byte j holds weight j in its low nibble and weight j + 16 in its high.
constexpr int64_t kBlock = 32;  // weights per block
constexpr int64_t kSuperBlock = 256;  // weights per k-quant super-block (kinds 13-15)

// Kinds whose blocks carry a minimum (w = d * q + m).
constexpr bool has_min(int64_t kind) {
  return kind == 1 || kind == 3 || kind == 5 || kind == 8 || kind == 10 || kind == 13;
}
// Kinds with one int8 quant per byte (the others pack two 4-bit quants).
constexpr bool byte_quants(int64_t kind) {
  return kind == 0 || kind == 4 || kind == 7 || kind == 11 || kind == 14;
}
// Kinds whose scales are float32 (repacked k-quants) rather than the file's float16.
constexpr bool float32_scales(int64_t kind) { return kind == 3 || kind == 4 || kind == 10 || kind == 11; }
// Kinds 13-15: the file's k-quant scale fields, float16 per super-block and 8-bit per block.
constexpr bool compact_scales(int64_t kind) { return kind >= 13 && kind <= 15; }
// Scales per 32-weight block: kinds 4, 11, 14 and 15 scale each half of a block on its own.
constexpr int64_t scales_per_block(int64_t kind) {
  return kind == 4 || kind == 11 || kind == 14 || kind == 15 ? 2 : 1;
}
// Kinds 5 and 6: Q4_1 and Q4_0 in nibble planes.
constexpr bool nibble_planes(int64_t kind) { return kind == 5 || kind == 6; }
// Kinds 7-15: kinds 0-4 interleaved 16 rows at a time, kind 12 (Q8_0 in 5 bits), kinds
// 13-14 (kinds 10-11 with the file's scale fields) and kind 15 (kind 14 in 6 bits).
constexpr bool interleaved(int64_t kind) { return kind >= 7 && kind <= 15; }
constexpr int64_t kInterleavedRows = 16;
// The kind whose arithmetic a kind has (a reordered kind's plain layout).
constexpr int64_t base_kind(int64_t kind) {
  return kind == 12   ? 0
         : kind == 15 ? 4
         : kind >= 13 ? kind - 10
         : nibble_planes(kind) ? kind - 4
         : interleaved(kind)   ? kind - 7
                               : kind;
}
constexpr int64_t kNumKinds = 16;

// Nibble planes: blocks 2g (A) and 2g + 1 (B) of a row share 32 bytes, eight 32-bit lanes
// j of eight nibbles k each. Nibble k of lane j is weight 8 (k / 2) + j of A for even k
// and of B for odd k, so masking nibble k off all lanes gives 8 consecutive quants of one
// block as 2^(4k) q per lane: one AND (the top nibble: one shift) and one conversion per
// 8 weights, where the plain layout spends a widening, a mask or shift and a conversion.
// For int8, the even and odd nibbles of each byte are A's and B's 32 quants (byte 4j + b:
// weight 8b + j). plain_to_planes and planes_to_plain convert one pair of blocks.
inline int plain_quant(const uint8_t* block, int i) {
  return i < 16 ? block[i] & 15 : block[i - 16] >> 4;
}
inline void plain_to_planes(const uint8_t* a, const uint8_t* b, uint8_t* pair) {
  for (int j = 0; j < 8; ++j)
    for (int byte = 0; byte < 4; ++byte)
      pair[4 * j + byte] = static_cast<uint8_t>(plain_quant(a, 8 * byte + j) |
                                                (plain_quant(b, 8 * byte + j) << 4));
}
// Block `half` (0: A, 1: B) of a pair as a plain 16-byte block.
inline void planes_to_plain(const uint8_t* pair, int half, uint8_t* block) {
  for (int i = 0; i < 16; ++i) block[i] = 0;
  for (int i = 0; i < kBlock; ++i) {
    const int q = (pair[4 * (i % 8) + i / 8] >> (4 * half)) & 15;
    block[i % 16] = static_cast<uint8_t>(block[i % 16] | (i < 16 ? q : q << 4));
  }
}

inline int64_t weight_cols(int64_t kind, int64_t qs_cols) {
  return kind == 12   ? qs_cols / 20 * kBlock
         : kind == 15 ? qs_cols / 24 * kBlock
         : byte_quants(kind) ? qs_cols
                             : qs_cols * 2;
}

// d_hi: the scale of weights 16-31 (kind 4; d itself for the other kinds).
template <int KIND>
inline void dequant_block(const uint8_t* __restrict qs, float d, float m, float d_hi,
                          float* __restrict w) {
  if constexpr (byte_quants(KIND)) {
    const int8_t* q = reinterpret_cast<const int8_t*>(qs);
#pragma omp simd
    for (int i = 0; i < 16; ++i) w[i] = d * static_cast<float>(q[i]);
#pragma omp simd
    for (int i = 16; i < 32; ++i) w[i] = d_hi * static_cast<float>(q[i]);
  } else {
    int32_t lo[16], hi[16];
#pragma omp simd
    for (int j = 0; j < 16; ++j) {
      lo[j] = qs[j] & 15;
      hi[j] = qs[j] >> 4;
    }
    if constexpr (has_min(KIND)) {
#pragma omp simd
      for (int j = 0; j < 16; ++j) {
        w[j] = d * static_cast<float>(lo[j]) + m;
        w[j + 16] = d * static_cast<float>(hi[j]) + m;
      }
    } else {
#pragma omp simd
      for (int j = 0; j < 16; ++j) {
        w[j] = d * static_cast<float>(lo[j] - 8);
        w[j + 16] = d * static_cast<float>(hi[j] - 8);
      }
    }
  }
}

#ifdef __AVX2__
// Four bytes at p in every 32-bit lane: x's 4 quants or digits against 8 rows' at once.
inline __m256i broadcast4x8(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Keeps a running sum one chain of adds in a register: GCC otherwise re-associates a
// block's integer adds into a tree whose products, all live at once, spill to the stack.
inline void in_register(__m256i& v) { asm("" : "+x"(v)); }

// The 32 quants of a block as four vectors of 8 floats (weights 0-7, 8-15, 16-23, 24-31).
// A 4-bit block's 16 bytes are broadcast to both halves and spread one byte per 32-bit lane
// by an in-lane byte shuffle: Zen 3 runs 4 of those per block where sign extension
// (vpmovsxbd, 4 per block) and the shifts between them queued on its two shuffle pipes;
// the GEMV is 1.28x faster that way (AMD EPYC Zen 3, same bits).
// kWiden: the two halves are zero-extended from memory instead (vpmovzxbd with its load,
// no broadcast): one row of x takes 3.6-8% less time per block that way (Zen 3, one
// thread, in cache), where 2-3 rows, whose multiplies share the shuffle pipes, took ~2%
// more; the GEMV picks it for one row.
template <int KIND, bool kWiden = false>
inline void load_quants(const uint8_t* qs, __m256 q[4]) {
  if constexpr (byte_quants(KIND)) {
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(qs + 8 * i))));
  } else {
    // Lane i of `first` holds byte i (weights i and i + 16), of `second` byte 8 + i.
    __m256i first, second;
    if constexpr (kWiden) {
      first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
      second = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
    } else {
      const __m256i bytes =
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
      first = _mm256_shuffle_epi8(
          bytes, _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                  4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1));
      second = _mm256_shuffle_epi8(
          bytes, _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
                                  12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1));
    }
    const __m256i mask = _mm256_set1_epi32(15);
    __m256i v[4] = {_mm256_and_si256(first, mask), _mm256_and_si256(second, mask),
                    _mm256_srli_epi32(first, 4), _mm256_srli_epi32(second, 4)};
    for (int i = 0; i < 4; ++i) {
      if constexpr (KIND == 2) v[i] = _mm256_sub_epi32(v[i], _mm256_set1_epi32(8));
      q[i] = _mm256_cvtepi32_ps(v[i]);
    }
  }
}

#endif

#ifdef __AVX512F__
// A shuffle index that moves byte k of a 128-bit lane to the low byte of a 32-bit lane
// and zeros the other three bytes.
constexpr int byte_lane(int k) { return static_cast<int>(0xFFFFFF00u | static_cast<unsigned>(k)); }

#ifdef __AVX512BW__
// A 4-bit block's 16 bytes broadcast to the four 128-bit lanes and spread one byte per
// 32-bit lane by one in-lane shuffle (byte i -> lane i: weights i and 16 + i), so no
// cross-lane sign extensions remain (1.2x on an Intel Xeon with AMX).
inline __m512i spread_nibble_bytes(const uint8_t* qs) {
  return _mm512_shuffle_epi8(
      _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))),
      _mm512_set_epi32(byte_lane(15), byte_lane(14), byte_lane(13), byte_lane(12),
                       byte_lane(11), byte_lane(10), byte_lane(9), byte_lane(8), byte_lane(7),
                       byte_lane(6), byte_lane(5), byte_lane(4), byte_lane(3), byte_lane(2),
                       byte_lane(1), byte_lane(0)));
}
#endif

// The 32 quants of a block as two vectors of 16 floats (weights 0-15, 16-31): the float
// GEMV's widest form, half the instructions per block of load_quants.
template <int KIND>
inline void load_quants16(const uint8_t* qs, __m512 q[2]) {
  if constexpr (byte_quants(KIND)) {
    for (int i = 0; i < 2; ++i)
      q[i] = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * i))));
  } else {
#ifdef __AVX512BW__
    // As load_quants, one byte per 32-bit lane (spread_nibble_bytes).
    const __m512i spread = spread_nibble_bytes(qs);
    __m512i lo = _mm512_and_si512(spread, _mm512_set1_epi32(15));
    __m512i hi = _mm512_srli_epi32(spread, 4);
    if constexpr (KIND == 2) {
      lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
      hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
    }
    q[0] = _mm512_cvtepi32_ps(lo);
    q[1] = _mm512_cvtepi32_ps(hi);
#else
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(bytes, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    if constexpr (KIND == 2) {
      lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
      hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    }
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
#endif
  }
}

// A block's 32 weights without their minimum, d * q (weights 0-15 scaled by d, 16-31 by
// d_hi), as two vectors: exact for float16 scales (11 significant bits times a quant's 4
// or 8); the lookup gives the same products as the conversion.
// kLookup: a 4-bit block looks its quants up in a table already multiplied by d: vpermps
// reads only the low 4 bits of each index, so no mask, no conversion and one multiply for
// the table instead of two. It runs on the shuffle port, which a GEMV of many rows of x
// needs for its multiplies, so those convert (Intel Xeon Ice Lake, the unscaled table:
// 1.2-1.4x for 1-4 rows, 0.93x for 5).
// The scales are broadcast from memory (d, d_hi point at them), a load: broadcast from a
// register, as GCC compiled a float argument, it is one more shuffle-pipe operation per
// block beside the lookup's three, and on Zen 4, whose 512-bit shuffles and multiplies
// each hold a pipe two cycles, the pipes were the limit (the one-row Q4_1 GEMV in cache:
// 8 such operations a block, 1.13x faster at 7, same bits).
template <int KIND, bool kLookup>
inline void load_weights16(const uint8_t* qs, const float* d, const float* d_hi, __m512 w[2]) {
#ifdef __AVX512BW__
  if constexpr (!byte_quants(KIND) && kLookup) {
    const __m512 values = _mm512_mul_ps(
        _mm512_broadcastss_ps(_mm_load_ss(d)),
        KIND == 2 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                  : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i spread = spread_nibble_bytes(qs);
    w[0] = _mm512_permutexvar_ps(spread, values);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(spread, 4), values);
    return;
  }
#endif
  __m512 q[2];
  load_quants16<KIND>(qs, q);
  w[0] = _mm512_mul_ps(_mm512_broadcastss_ps(_mm_load_ss(d)), q[0]);
  w[1] = _mm512_mul_ps(_mm512_broadcastss_ps(_mm_load_ss(d_hi)), q[1]);
}
#endif

constexpr int64_t block_bytes_of(int64_t kind) {
  return kind == 12 ? 20 : kind == 15 ? 24 : byte_quants(kind) ? 32 : 16;
}

// float16 -> float32, exact (F16C's vcvtph2ps where the CPU has it).
inline float f16(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

}  // namespace kvserve_cpu
