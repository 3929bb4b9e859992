// GGUF block weights shared by the block matmuls: the planes, their dequantization and
// the float GEMV (block_gemm.cpp), used by the int8 paths too (block_gemm_int8.cpp,
// block_gemm_vnni.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstring>
#include <utility>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#ifdef __SSE__
#include <xmmintrin.h>  // _mm_prefetch
#endif

#include "cpu_common.h"

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
// In a 4-bit block, byte j holds weight j in its low nibble and weight j + 16 in its high.
constexpr int64_t kBlock = 32;  // weights per block
constexpr int64_t kPrefetchRows = 4;
// Rows of x per float GEMV pass (gemv's largest R): a pass converts each block's quants
// once for all its rows. AVX-512's 32 registers hold 8 rows' accumulators (16) beside the
// quants, so 7-8-row decode steps take one pass instead of two; AVX2's 16 hold 6.
#ifdef __AVX512F__
constexpr int64_t kGemvRows = 8;
#else
constexpr int64_t kGemvRows = 6;
#endif

// Kinds whose blocks carry a minimum (w = d * q + m).
constexpr bool has_min(int64_t kind) { return kind == 1 || kind == 3; }
// Kinds with one int8 quant per byte (the others pack two 4-bit quants).
constexpr bool byte_quants(int64_t kind) { return kind == 0 || kind == 4; }
// Kinds whose scales are float32 (repacked k-quants) rather than the file's float16.
constexpr bool float32_scales(int64_t kind) { return kind == 3 || kind == 4; }
// Scales per 32-weight block: kind 4 scales each half of a block on its own.
constexpr int64_t scales_per_block(int64_t kind) { return kind == 4 ? 2 : 1; }
inline int64_t weight_cols(int64_t kind, int64_t qs_cols) {
  return byte_quants(kind) ? qs_cols : qs_cols * 2;
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
// The 32 quants of a block as four vectors of 8 floats (weights 0-7, 8-15, 16-23, 24-31).
// A 4-bit block's 16 bytes are broadcast to both halves and spread one byte per 32-bit lane
// by an in-lane byte shuffle: Zen 3 runs 4 of those per block where sign extension
// (vpmovsxbd, 4 per block) and the shifts between them queued on its two shuffle pipes;
// the GEMV is 1.28x faster that way (AMD EPYC Zen 3, same bits).
template <int KIND>
inline void load_quants(const uint8_t* qs, __m256 q[4]) {
  if constexpr (byte_quants(KIND)) {
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(qs + 8 * i))));
  } else {
    const __m256i bytes =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    // Lane i of `first` holds byte i (weights i and i + 16), of `second` byte 8 + i.
    const __m256i first = _mm256_shuffle_epi8(
        bytes, _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1, 4,
                                -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1));
    const __m256i second = _mm256_shuffle_epi8(
        bytes, _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
                                12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1));
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

// The 32 quants of a block as two vectors of 16 floats (weights 0-15, 16-31): the float
// GEMV's widest form, half the instructions per block of load_quants. kLookup: see below.
template <int KIND, bool kLookup>
inline void load_quants16(const uint8_t* qs, __m512 q[2]) {
  if constexpr (byte_quants(KIND)) {
    for (int i = 0; i < 2; ++i)
      q[i] = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * i))));
  } else {
#ifdef __AVX512BW__
    // As load_quants: the 16 bytes broadcast to the four 128-bit lanes and spread one byte
    // per 32-bit lane by one in-lane shuffle (byte i -> lane i: weights i and 16 + i), so
    // no cross-lane sign extensions remain (1.2x on an Intel Xeon with AMX).
    const __m512i spread = _mm512_shuffle_epi8(
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))),
        _mm512_set_epi32(byte_lane(15), byte_lane(14), byte_lane(13), byte_lane(12),
                         byte_lane(11), byte_lane(10), byte_lane(9), byte_lane(8),
                         byte_lane(7), byte_lane(6), byte_lane(5), byte_lane(4),
                         byte_lane(3), byte_lane(2), byte_lane(1), byte_lane(0)));
    if constexpr (kLookup) {
      // A nibble becomes its float by a table lookup: vpermps reads only the low 4 bits
      // of each index, so no mask and no conversion, the same floats in 3 instructions
      // instead of 5. It runs on the shuffle port, which a GEMV of many rows of x needs
      // for its multiplies, so those keep the conversion (Intel Xeon Ice Lake: 1.2-1.4x
      // for 1-4 rows, 0.93x for 5).
      const __m512 values = KIND == 2 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1,
                                                       2, 3, 4, 5, 6, 7)
                                      : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                       12, 13, 14, 15);
      q[0] = _mm512_permutexvar_ps(spread, values);
      q[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(spread, 4), values);
      return;
    }
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
#endif

inline int64_t block_bytes_of(int64_t kind) { return byte_quants(kind) ? 32 : 16; }

// float16 -> float32, exact (F16C's vcvtph2ps where the CPU has it).
inline float f16(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// sums[i] = x[32 i] + ... + x[32 i + 31] for each of `blocks` blocks, added in order (the
// float GEMV's Q4_1 minimum term; one order everywhere, so every caller agrees bit for bit).
inline void block_sums(const float* x, int64_t blocks, float* sums) {
  for (int64_t i = 0; i < blocks; ++i) {
    float sum = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) sum += x[i * kBlock + j];
    sums[i] = sum;
  }
}

struct BlockWeight {
  int64_t kind, rows, cols, row_bytes;
  const uint8_t* qs;
  const uint16_t* d;  // float16 bits (kinds 0-2)
  const uint16_t* m;
  const float* d32 = nullptr;  // kinds 3-4: float32 scales; kind 3: float32 minimums
  const float* m32 = nullptr;

  // Block i's scale and minimum as floats, whichever plane holds them; scale_hi is the
  // scale of its weights 16-31 (kind 4's second scale, the block's scale otherwise).
  template <int KIND>
  float scale(int64_t i) const {
    if constexpr (KIND == 4) return d32[2 * i];
    else if constexpr (KIND == 3) return d32[i];
    else return f16(d[i]);
  }
  template <int KIND>
  float scale_hi(int64_t i) const {
    if constexpr (KIND == 4) return d32[2 * i + 1];
    else return scale<KIND>(i);
  }
  template <int KIND>
  float minimum(int64_t i) const {
    if constexpr (KIND == 3) return m32[i];
    else if constexpr (KIND == 1) return f16(m[i]);
    else return 0.f;
  }

#ifdef __AVX2__
  // All-ones in lanes [0, count) of 8, zeros after.
  static __m256i lane_mask(int64_t count) {
    static const int32_t ones_then_zeros[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ones_then_zeros + 8 - count));
  }
  // Plane p's count <= 8 float16 values from block i on as floats, zeros past count. Reads
  // 8 values wherever 8 lie inside the plane, and copies the tail of the last row: an
  // element-wise copy there would stall the wide load that follows it on every row.
  __m256 halves_to_floats(const uint16_t* p, int64_t i, int64_t count) const {
    const __m256 keep = _mm256_castsi256_ps(lane_mask(count));
    if (i + 8 <= rows * (cols / kBlock))
      return _mm256_and_ps(
          keep, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
    alignas(16) uint16_t raw[8] = {};
    std::memcpy(raw, p + i, count * sizeof(uint16_t));
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(raw)));
  }
  // Scales of `count` <= 8 consecutive blocks from block i on into `scales` (kind 4: the
  // second scales into scales_hi), zeros past count; returns their minimums as a vector.
  template <int KIND>
  __m256 load_block_scales(int64_t i, int64_t count, float* scales, float* scales_hi) const {
    if constexpr (!float32_scales(KIND)) {
      _mm256_store_ps(scales, halves_to_floats(d, i, count));
      if constexpr (has_min(KIND)) return halves_to_floats(m, i, count);
      return _mm256_setzero_ps();
    }
    if constexpr (KIND == 3) {
      const __m256i keep = lane_mask(count);
      _mm256_store_ps(scales, _mm256_maskload_ps(d32 + i, keep));
      return _mm256_maskload_ps(m32 + i, keep);
    }
    alignas(32) float mins[8] = {};
    for (int64_t j = 0; j < count; ++j) {
      scales[j] = scale<KIND>(i + j);
      scales_hi[j] = scale_hi<KIND>(i + j);
      mins[j] = minimum<KIND>(i + j);
    }
    return _mm256_load_ps(mins);
  }
#endif
#ifdef __AVX512F__
  // halves_to_floats for 16 values (AVX-512F only: no byte/word masked loads needed).
  __m512 halves_to_floats16(const uint16_t* p, int64_t i, int64_t count) const {
    const __mmask16 keep = static_cast<__mmask16>((1u << count) - 1);
    if (i + 16 <= rows * (cols / kBlock))
      return _mm512_maskz_mov_ps(
          keep, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i))));
    alignas(32) uint16_t raw[16] = {};
    std::memcpy(raw, p + i, count * sizeof(uint16_t));
    return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(raw)));
  }
  // load_block_scales for 16 blocks: `count` <= 16 from block i on, zeros past count.
  template <int KIND>
  __m512 load_block_scales16(int64_t i, int64_t count, float* scales, float* scales_hi) const {
    const __mmask16 keep = static_cast<__mmask16>((1u << count) - 1);
    if constexpr (!float32_scales(KIND)) {
      _mm512_store_ps(scales, halves_to_floats16(d, i, count));
      if constexpr (has_min(KIND)) return halves_to_floats16(m, i, count);
      return _mm512_setzero_ps();
    }
    if constexpr (KIND == 3) {
      _mm512_store_ps(scales, _mm512_maskz_loadu_ps(keep, d32 + i));
      return _mm512_maskz_loadu_ps(keep, m32 + i);
    }
    alignas(64) float mins[16] = {};
    for (int64_t j = 0; j < count; ++j) {
      scales[j] = scale<KIND>(i + j);
      scales_hi[j] = scale_hi<KIND>(i + j);
      mins[j] = minimum<KIND>(i + j);
    }
    return _mm512_load_ps(mins);
  }
#endif

  // Decode reads every weight from DRAM once per token, and the hardware prefetcher stops
  // at 4 KiB page boundaries (every ~14 rows of a 576-wide Q4_1 weight), so the GEMVs ask
  // for the row kPrefetchRows ahead themselves. Single-stream gguf_int8 decode on a noisy
  // AVX-512 VM: 3% (6 alternating runs) to 15% (5 runs, another hour) faster.
  void prefetch_row(int64_t n) const {
#if defined(__SSE__)
    if (n >= rows) return;
    const int64_t nb = cols / kBlock;
    for (int64_t off = 0; off < row_bytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(qs + n * row_bytes + off), _MM_HINT_T0);
    if (d32 != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(d32 + n * nb * scales_per_block(kind)),
                   _MM_HINT_T0);
      if (m32 != nullptr) _mm_prefetch(reinterpret_cast<const char*>(m32 + n * nb), _MM_HINT_T0);
      return;
    }
    _mm_prefetch(reinterpret_cast<const char*>(d + n * nb), _MM_HINT_T0);
    if (m != nullptr) _mm_prefetch(reinterpret_cast<const char*>(m + n * nb), _MM_HINT_T0);
#else
    (void)n;
#endif
  }

  template <int KIND>
  void dequant_rows_t(int64_t begin, int64_t end, float* out) const {
    const int64_t nb = cols / kBlock, bb = block_bytes_of(KIND);
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = qs + n * row_bytes + b * bb;
        float* o = out + (n - begin) * cols + b * kBlock;
        const float db = scale<KIND>(n * nb + b), mb = minimum<KIND>(n * nb + b);
        const float dh = scale_hi<KIND>(n * nb + b);
#ifdef __AVX2__
        __m256 q[4];
        load_quants<KIND>(block, q);
        const __m256 dv = _mm256_set1_ps(db), hv = _mm256_set1_ps(dh), mv = _mm256_set1_ps(mb);
        for (int i = 0; i < 4; ++i) {
          // Multiply, then add: the gguf package's rounding, not a fused multiply-add.
          __m256 v = _mm256_mul_ps(i < 2 ? dv : hv, q[i]);
          if constexpr (has_min(KIND)) v = _mm256_add_ps(v, mv);
          _mm256_storeu_ps(o + 8 * i, v);
        }
#else
        dequant_block<KIND>(block, db, mb, dh, o);
#endif
      }
  }

  void dequant_rows(int64_t begin, int64_t end, float* out) const {
    if (kind == 0) dequant_rows_t<0>(begin, end, out);
    else if (kind == 1) dequant_rows_t<1>(begin, end, out);
    else if (kind == 2) dequant_rows_t<2>(begin, end, out);
    else if (kind == 3) dequant_rows_t<3>(begin, end, out);
    else dequant_rows_t<4>(begin, end, out);
  }

  // out[r * ldo + n] = sum_k x[r, k] * W[n, k] for n in [begin, end), R rows of x.
  // Per block, sum_i (d q_i + m) x_i = d (q . x) + m sum(x): the scale multiplies one
  // vector of partial sums, and the minimum a per-block sum of x computed once per call.
  // With AVX-512, up to 4 rows of x take two outputs per pass (gemv_outputs): each
  // output's sums are one chain of dependent adds, and two chains side by side keep the
  // FMA units busy where one waited on its own latency. An output's arithmetic is the same either way, so its value does not depend
  // on its neighbours, on R or on how [begin, end) was split.
  template <int KIND, int R>
  void gemv_t(const float* __restrict x, const float* __restrict xsum, float* __restrict out,
              int64_t ldo, int64_t begin, int64_t end) const {
#ifdef __AVX512F__
    constexpr int kPair = R <= 4 ? 2 : 1;
#else  // AVX2's 16 registers do not hold two outputs' sums beside the quants
    constexpr int kPair = 1;
#endif
    int64_t n = begin;
    for (; n + kPair <= end; n += kPair) gemv_outputs<KIND, R, kPair>(x, xsum, out, ldo, n);
    for (; n < end; ++n) gemv_outputs<KIND, R, 1>(x, xsum, out, ldo, n);
  }

  // Outputs n .. n + NO - 1 of gemv_t.
  template <int KIND, int R, int NO>
  void gemv_outputs(const float* __restrict x, const float* __restrict xsum,
                    float* __restrict out, int64_t ldo, int64_t n) const {
    const int64_t nb = cols / kBlock, bb = block_bytes_of(KIND);
    for (int o = 0; o < NO; ++o) prefetch_row(n + o + kPrefetchRows);
#if defined(__AVX512F__)
    // As in the AVX2 branch: sixteen blocks' scales and minimums converted at once and
    // the minimum term kept in a vector, instead of scalar conversions and a serial add.
    __m512 acc[NO][R], min_acc[NO][R];
    for (int o = 0; o < NO; ++o)
      for (int r = 0; r < R; ++r) acc[o][r] = min_acc[o][r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
      const int64_t count = std::min<int64_t>(16, nb - b0);
      alignas(64) float scales[NO][16], scales_hi[NO][16];
      __m512 mins[NO];
      for (int o = 0; o < NO; ++o)
        mins[o] = load_block_scales16<KIND>((n + o) * nb + b0, count, scales[o], scales_hi[o]);
      for (int64_t b = b0; b < b0 + count; ++b)
        for (int o = 0; o < NO; ++o) {
          __m512 q[2];
          load_quants16<KIND, (R <= 4)>(qs + (n + o) * row_bytes + b * bb, q);
          const __m512 sv = _mm512_set1_ps(scales[o][b - b0]);
          for (int r = 0; r < R; ++r) {
            const float* xb = x + r * cols + b * kBlock;
            if constexpr (KIND == 4) {  // a scale per half block
              const __m512 hv = _mm512_set1_ps(scales_hi[o][b - b0]);
              acc[o][r] =
                  _mm512_fmadd_ps(sv, _mm512_mul_ps(q[0], _mm512_loadu_ps(xb)), acc[o][r]);
              acc[o][r] =
                  _mm512_fmadd_ps(hv, _mm512_mul_ps(q[1], _mm512_loadu_ps(xb + 16)), acc[o][r]);
              continue;
            }
            __m512 qx = _mm512_mul_ps(q[0], _mm512_loadu_ps(xb));
            qx = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(xb + 16), qx);
            acc[o][r] = _mm512_fmadd_ps(sv, qx, acc[o][r]);
          }
        }
      if constexpr (has_min(KIND)) {
        const __mmask16 keep = static_cast<__mmask16>((1u << count) - 1);
        for (int r = 0; r < R; ++r) {
          const __m512 sums = _mm512_maskz_loadu_ps(keep, xsum + r * nb + b0);
          for (int o = 0; o < NO; ++o)
            min_acc[o][r] = _mm512_fmadd_ps(mins[o], sums, min_acc[o][r]);
        }
      }
    }
    // One horizontal sum per output: the minimum term joins the lanes before it.
    for (int o = 0; o < NO; ++o)
      for (int r = 0; r < R; ++r)
        out[r * ldo + n + o] = _mm512_reduce_add_ps(
            has_min(KIND) ? _mm512_add_ps(acc[o][r], min_acc[o][r]) : acc[o][r]);
#elif defined(__AVX2__)
    // Scales and minimums are converted eight blocks at a time and the minimum term
    // accumulates in a vector: one scalar float16 conversion per block and a serial
    // scalar add chain were what Zen 3 waited on (1.17x on top of load_quants').
    __m256 acc[NO][R], min_acc[NO][R];
    for (int o = 0; o < NO; ++o)
      for (int r = 0; r < R; ++r) acc[o][r] = min_acc[o][r] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
      const int64_t count = std::min<int64_t>(8, nb - b0);
      alignas(32) float scales[NO][8], scales_hi[NO][8];
      __m256 mins[NO];
      for (int o = 0; o < NO; ++o)
        mins[o] = load_block_scales<KIND>((n + o) * nb + b0, count, scales[o], scales_hi[o]);
      for (int64_t b = b0; b < b0 + count; ++b)
        for (int o = 0; o < NO; ++o) {
          __m256 q[4];
          load_quants<KIND>(qs + (n + o) * row_bytes + b * bb, q);
          const __m256 sv = _mm256_broadcast_ss(scales[o] + (b - b0));
          for (int r = 0; r < R; ++r) {
            const float* xb = x + r * cols + b * kBlock;
            __m256 qx = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
            qx = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), qx);
            if constexpr (KIND == 4) {  // a scale per half block
              const __m256 hv = _mm256_broadcast_ss(scales_hi[o] + (b - b0));
              __m256 hi = _mm256_mul_ps(q[2], _mm256_loadu_ps(xb + 16));
              hi = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), hi);
              acc[o][r] = _mm256_fmadd_ps(sv, qx, acc[o][r]);
              acc[o][r] = _mm256_fmadd_ps(hv, hi, acc[o][r]);
              continue;
            }
            qx = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), qx);
            qx = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), qx);
            acc[o][r] = _mm256_fmadd_ps(sv, qx, acc[o][r]);
          }
        }
      if constexpr (has_min(KIND)) {
        const __m256i keep = lane_mask(count);
        for (int r = 0; r < R; ++r) {
          const __m256 sums = _mm256_maskload_ps(xsum + r * nb + b0, keep);
          for (int o = 0; o < NO; ++o)
            min_acc[o][r] = _mm256_fmadd_ps(mins[o], sums, min_acc[o][r]);
        }
      }
    }
    for (int o = 0; o < NO; ++o)
      for (int r = 0; r < R; ++r) {
        const float min_term = has_min(KIND) ? hsum(min_acc[o][r]) : 0.f;
        out[r * ldo + n + o] = hsum(acc[o][r]) + min_term;
      }
#else
    for (int o = 0; o < NO; ++o) {
      const uint8_t* row = qs + (n + o) * row_bytes;
      float acc[R] = {};
      alignas(64) float wb[kBlock];
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t i = (n + o) * nb + b;
        dequant_block<KIND>(row + b * bb, scale<KIND>(i), minimum<KIND>(i), scale_hi<KIND>(i), wb);
        for (int r = 0; r < R; ++r) acc[r] += dot(wb, x + r * cols + b * kBlock, kBlock);
      }
      for (int r = 0; r < R; ++r) out[r * ldo + n + o] = acc[r];
    }
    (void)xsum;  // the dequantized block already carries the minimum
#endif
  }

  template <int KIND>
  void gemv_kind(int64_t rows_x, const float* x, const float* xsum, float* out, int64_t begin,
                 int64_t end) const {
    switch (rows_x) {
      case 1: return gemv_t<KIND, 1>(x, xsum, out, rows, begin, end);
      case 2: return gemv_t<KIND, 2>(x, xsum, out, rows, begin, end);
      case 3: return gemv_t<KIND, 3>(x, xsum, out, rows, begin, end);
      case 4: return gemv_t<KIND, 4>(x, xsum, out, rows, begin, end);
      case 5: return gemv_t<KIND, 5>(x, xsum, out, rows, begin, end);
#ifdef __AVX512F__
      case 6: return gemv_t<KIND, 6>(x, xsum, out, rows, begin, end);
      case 7: return gemv_t<KIND, 7>(x, xsum, out, rows, begin, end);
      default: return gemv_t<KIND, 8>(x, xsum, out, rows, begin, end);
#else
      default: return gemv_t<KIND, 6>(x, xsum, out, rows, begin, end);
#endif
    }
  }

  // xsum: [rows_x, cols / 32] sums of x per block (used by Q4_1's minimum).
  void gemv(int64_t rows_x, const float* x, const float* xsum, float* out, int64_t begin,
            int64_t end) const {
    if (kind == 0) gemv_kind<0>(rows_x, x, xsum, out, begin, end);
    else if (kind == 1) gemv_kind<1>(rows_x, x, xsum, out, begin, end);
    else if (kind == 2) gemv_kind<2>(rows_x, x, xsum, out, begin, end);
    else if (kind == 3) gemv_kind<3>(rows_x, x, xsum, out, begin, end);
    else gemv_kind<4>(rows_x, x, xsum, out, begin, end);
  }
};

// Checked view of a weight's planes (kinds as above).
BlockWeight block_weight(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                         int64_t kind);

// x as contiguous [rows, K], and an uninitialized output shaped like x with N features.
std::pair<at::Tensor, at::Tensor> linear_operands(const at::Tensor& x_in, const BlockWeight& w);

// x @ w^T for a dense float32 w, multi-threaded: every float32 layer's matmul (modules
// and the C++ decode stack alike), and the lossless block path's for long inputs once it
// has dequantized W, so the paths agree bit for bit (block_gemm.cpp).
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w);

// block_gemm_vnni.cpp: gguf_int8's row-interleaved copy of the blocks (empty in builds
// without AVX-512 VNNI), and its matmul for any number of rows of int8-quantized x
// (false, nothing written, in those builds).
at::Tensor pack_blocks_vnni(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                            int64_t kind);
bool packed_linear_vnni(const at::Tensor& packed, int64_t kind, int64_t N, int64_t K,
                        int64_t rows, const int8_t* xq, const float* xd, const float* xs,
                        float* out);
// The same matmul in pieces, for callers that split the work themselves: the output's
// groups of 16 features, [g_begin, g_end) of packed_groups(N) on the calling thread.
// xu: Q8_0 (kind 0) only, x as unsigned bytes (unsigned_activations), else unused.
constexpr int64_t kPackedGroup = 16;
inline int64_t packed_groups(int64_t N) { return (N + kPackedGroup - 1) / kPackedGroup; }
void check_packed_vnni(const at::Tensor& packed, int64_t kind, int64_t N, int64_t K);
void unsigned_activations(const int8_t* xq, uint8_t* xu, int64_t n);
void packed_groups_vnni(const uint8_t* packed, int64_t kind, int64_t N, int64_t K,
                        int64_t rows, const int8_t* xq, const uint8_t* xu, const float* xd,
                        const float* xs, float* out, int64_t g_begin, int64_t g_end);

// block_gemm_int8.cpp: x's 32 values quantized as gguf_int8 does (llama.cpp's Q8_1):
// int8 quants q, scale d and s = d * sum(q).
void quantize_block_q8(const float* x, int8_t* q, float& d, float& s);

}  // namespace kvserve_cpu
