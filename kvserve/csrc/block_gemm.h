// GGUF block weights shared by the block matmuls: the planes (kinds and loads in
// block_quants.h), their dequantization and the float GEMV (block_gemm.cpp), used by the
// int8 paths too (block_gemm_int8.cpp, block_gemm_vnni.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#ifdef __SSE__
#include <xmmintrin.h>  // _mm_prefetch
#endif

#include "block_quants.h"
#include "cpu_common.h"

namespace kvserve_cpu {

// ---- The float GEMV ------------------------------------------------------------------
constexpr int64_t kPrefetchRows = 4;
// The float GEMV also asks, every 64 bytes of a row it reads, for the quants this far
// ahead: a GEMV whose unpacking keeps the core busy had its DRAM time added to its
// compute time rather than hidden under it (the hardware prefetcher and the row-ahead
// requests at each group of outputs did not cover it). Intel Xeon with AMX, 2 threads,
// weights streamed from DRAM: Q4_1 1.5x, Q8_0 1.7x, the lossless single stream 150 ->
// 226 tok/s.
constexpr int64_t kStreamAheadBytes = 4096;
#ifdef __AVX512F__
// The AVX-512 float GEMV asks further ahead in int8 quants (Q8_0: a 1B model's tied LM
// head, a third of a token's bytes), which waited on DRAM at 4 KiB (two 2048-wide rows).
// A 32768 x 2048 Q8_0 weight from DRAM on huge pages, AMD EPYC Zen 4, CPU ns per block
// (medians of 5 interleaved runs, load 9-12): one thread 3.58 at 4 KiB, 3.11 at 8, 2.99
// at 16, 3.01 at 32; two threads 5.12 -> 3.96 at 16. Q4_1 does not gain (one thread 2.0
// at 4-32 KiB) and lost at two (3.3 -> 3.6), so 4-bit quants keep kStreamAheadBytes.
constexpr int64_t kGemvStreamAheadBytes = 16384;
#endif
// Rows of x per float GEMV pass at most (gemv's largest R; BlockWeight::gemv_pass_rows):
// a pass converts each block's quants once for all its rows. AVX-512's 32 registers hold
// 16 rows' sums beside the weights (the minimum term joins them), so decode steps of up to
// 16 requests take one pass; AVX2's 16 registers hold 6 rows' sums and minimum terms.
#ifdef __AVX512F__
constexpr int64_t kGemvRows = 16;
#else
constexpr int64_t kGemvRows = 6;
#endif

// sums[i] = x[32 i] + ... + x[32 i + 31] for each of `blocks` blocks, added in order (the
// float GEMV's Q4_1 minimum term; one order everywhere, so every caller agrees bit for bit).
inline void block_sums(const float* x, int64_t blocks, float* sums) {
  for (int64_t i = 0; i < blocks; ++i) {
    float sum = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) sum += x[i * kBlock + j];
    sums[i] = sum;
  }
}

// The rows of x one float GEMV pass reads (GemvInput, block_gemm_planes.h, prepares them).
struct GemvRows {
  const float* x;        // [R, cols]: x itself, or its nibble-plane form (kinds 5-6, AVX2)
  const float* xsum;     // [R, cols / 32]: x's per-block sums (the minimum term)
  const float* unscale;  // [R]: 1, or 2^-S for a row scaled by 2^S in nibble-plane form
};

struct BlockWeight;
#if defined(__AVX2__) && !defined(__AVX512F__)
// The float GEMV's outputs n .. n + NO - 1 on nibble planes (block_gemm_planes.h).
template <int KIND, int R, int NO>
void gemv_planes_outputs(const BlockWeight& w, const GemvRows& in, float* __restrict out,
                         int64_t ldo, int64_t n);
#endif

struct BlockWeight {
  int64_t kind, rows, cols, row_bytes;
  const uint8_t* qs;
  const uint16_t* d;  // float16 bits (kinds 0-2; kinds 13-15: per super-block)
  const uint16_t* m;
  const float* d32 = nullptr;  // kinds 3-4: float32 scales; kind 3: float32 minimums
  const float* m32 = nullptr;
  const uint8_t* sub = nullptr;  // kinds 13-15: the blocks' 8-bit sub-scales (m)

  // Where block i (= n nb + b) keeps its scale and minimum: at i, or for the interleaved
  // kinds in its group of 16 rows (block_quants.h).
  template <int KIND>
  int64_t scale_index(int64_t i) const {
    if constexpr (!interleaved(KIND)) return i;
    const int64_t nb = cols / kBlock, n = i / nb, b = i % nb;
    return ((n / kInterleavedRows) * nb + b) * kInterleavedRows + n % kInterleavedRows;
  }
  // Block i's scale and minimum as floats, whichever plane holds them; scale_hi is the
  // scale of its weights 16-31 (kind 4's second scale, the block's scale otherwise).
  template <int KIND>
  float scale(int64_t i) const {
    if constexpr (KIND == 4) return d32[2 * i];
    else if constexpr (KIND == 11) return d32[half_scale_index(i, 0)];
    else if constexpr (compact_scales(KIND)) return compact_product<KIND>(i, 0);
    else if constexpr (float32_scales(KIND)) return d32[scale_index<KIND>(i)];
    else return f16(d[scale_index<KIND>(i)]);
  }
  template <int KIND>
  float scale_hi(int64_t i) const {
    if constexpr (KIND == 4) return d32[2 * i + 1];
    else if constexpr (KIND == 11) return d32[half_scale_index(i, 1)];
    else if constexpr (KIND == 14 || KIND == 15) return compact_product<KIND>(i, 1);
    else return scale<KIND>(i);
  }
  template <int KIND>
  float minimum(int64_t i) const {
    if constexpr (KIND == 13) return -compact_product<KIND>(i, 1);
    else if constexpr (base_kind(KIND) == 3) return m32[scale_index<KIND>(i)];
    else if constexpr (base_kind(KIND) == 1) return f16(m[scale_index<KIND>(i)]);
    else return 0.f;
  }
  // Kinds 13-15: block i's super-block field times its sub-block field p (block_quants.h;
  // kind 13: p = 0 d * sc, 1 dmin * min; kinds 14-15: d * sc of half p), as gguf computes it.
  template <int KIND>
  float compact_product(int64_t i, int p) const {
    constexpr int64_t G = kInterleavedRows, P = KIND == 13 ? 2 : 1;
    const int64_t nb = cols / kBlock, n = i / nb, b = i % nb, g = n / G, r = n % G;
    const int64_t s = g * (cols / kSuperBlock) + b / (kSuperBlock / kBlock);
    const float super_scale = f16(d[(s * P + (KIND == 13 ? p : 0)) * G + r]);
    const uint8_t field = sub[((g * nb + b) * 2 + p) * G + r];
    return super_scale * (KIND == 13 ? static_cast<float>(field)
                                     : static_cast<float>(static_cast<int8_t>(field)));
  }
  // Kind 11's scale of block i's half: each group's blocks keep their 16 rows' low-half
  // scales, then their high-half ones.
  int64_t half_scale_index(int64_t i, int half) const {
    const int64_t nb = cols / kBlock, n = i / nb, b = i % nb;
    return (((n / kInterleavedRows) * nb + b) * 2 + half) * kInterleavedRows + n % kInterleavedRows;
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
  // Block b of row n, and the request for the quants kAhead bytes beyond it when b starts
  // a new 64-byte stretch of the row.
  template <int64_t kAhead = kStreamAheadBytes>
  const uint8_t* streamed_block(int64_t n, int64_t b, int64_t block_bytes) const {
    const uint8_t* block = qs + n * row_bytes + b * block_bytes;
#if defined(__SSE__)
    if (((b * block_bytes) & 63) == 0)
      _mm_prefetch(reinterpret_cast<const char*>(block + kAhead), _MM_HINT_T0);
#endif
    return block;
  }

  // The float16 scale planes' counterpart of streamed_block, at each group of 16 blocks:
  // prefetch_row asks for only the first line of a row's scales and minimums (a 2048-wide
  // Q4_1 row has two of each, an 8192-wide one eight), and the rest waited on DRAM. The
  // Q4_1 GEMV from DRAM (65536 x 2048, huge pages, AMD EPYC Zen 4, CPU ns per block,
  // medians of 5-7 interleaved runs, load 12-14): one thread 1.99 -> 1.78, two threads
  // 3.00 -> 2.72; Q8_0 unchanged. 256 blocks ahead: kStreamAheadBytes of 4-bit quants.
  template <int KIND>
  void stream_scales(int64_t i) const {
#if defined(__SSE__)
    constexpr int64_t kAheadBlocks = 256;
    if constexpr (!float32_scales(KIND)) {
      _mm_prefetch(reinterpret_cast<const char*>(d + i + kAheadBlocks), _MM_HINT_T0);
      if constexpr (has_min(KIND))
        _mm_prefetch(reinterpret_cast<const char*>(m + i + kAheadBlocks), _MM_HINT_T0);
    }
#else
    (void)i;
#endif
  }

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
    const int64_t nb = cols / kBlock;
    alignas(32) uint8_t plain[kBlock];
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = plain_block<KIND>(n, b, plain);
        float* o = out + (n - begin) * cols + b * kBlock;
        const float db = scale<KIND>(n * nb + b), mb = minimum<KIND>(n * nb + b);
        const float dh = scale_hi<KIND>(n * nb + b);
#ifdef __AVX2__
        __m256 q[4];
        load_quants<base_kind(KIND)>(block, q);
        const __m256 dv = _mm256_set1_ps(db), hv = _mm256_set1_ps(dh), mv = _mm256_set1_ps(mb);
        for (int i = 0; i < 4; ++i) {
          // Multiply, then add: the gguf package's rounding, not a fused multiply-add.
          __m256 v = _mm256_mul_ps(i < 2 ? dv : hv, q[i]);
          if constexpr (has_min(KIND)) v = _mm256_add_ps(v, mv);
          _mm256_storeu_ps(o + 8 * i, v);
        }
#else
        dequant_block<base_kind(KIND)>(block, db, mb, dh, o);
#endif
      }
  }

  // Block b of row n in its kind's plain layout: in place, or (nibble planes, interleaved
  // kinds) copied to `plain`, kBlock bytes.
  template <int KIND>
  const uint8_t* plain_block(int64_t n, int64_t b, uint8_t* plain) const {
    if constexpr (nibble_planes(KIND)) {
      planes_to_plain(qs + n * row_bytes + (b & ~int64_t{1}) * 16, static_cast<int>(b & 1), plain);
      return plain;
    } else if constexpr (KIND == 12) {  // Q8_0's int8 quants from nibbles and fifth bits
      constexpr int64_t G = kInterleavedRows;
      const int64_t nb = cols / kBlock, i = n % G;
      const uint8_t* group = qs + ((n / G) * nb + b) * G * block_bytes_of(KIND);
      for (int j = 0; j < kBlock; ++j) {
        const int c = (j % 16) / 4, half = j / 16;
        const uint8_t nibbles = group[(c * G + i) * 4 + j % 4];
        const uint8_t* mask = group + G * 16 + c * 16 + half * 8;
        const int bit = (mask[(4 * i + j % 4) / 8] >> ((4 * i + j % 4) % 8)) & 1;
        plain[j] = static_cast<uint8_t>(((half ? nibbles >> 4 : nibbles & 15) | bit << 4) - 16);
      }
      return plain;
    } else if constexpr (KIND == 15) {  // Q6_K's int8 q - 32 from nibbles and bits 4 and 5
      constexpr int64_t G = kInterleavedRows;
      const int64_t nb = cols / kBlock, i = n % G;
      const uint8_t* group = qs + ((n / G) * nb + b) * G * block_bytes_of(KIND);
      for (int j = 0; j < kBlock; ++j) {
        const int c = (j % 16) / 4, half = j / 16, bit = 4 * static_cast<int>(i) + j % 4;
        const uint8_t nibbles = group[(c * G + i) * 4 + j % 4];
        const uint8_t* masks = group + G * 16 + c * 32 + half * 16;
        const int high =
            ((masks[bit / 8] >> (bit % 8)) & 1) | ((masks[8 + bit / 8] >> (bit % 8)) & 1) << 1;
        plain[j] = static_cast<uint8_t>(((half ? nibbles >> 4 : nibbles & 15) | high << 4) - 32);
      }
      return plain;
    } else if constexpr (interleaved(KIND)) {
      constexpr int64_t bb = block_bytes_of(KIND), G = kInterleavedRows;
      const int64_t nb = cols / kBlock, i = n % G;
      const uint8_t* group = qs + ((n / G) * nb + b) * G * bb;
      for (int64_t c = 0; c < bb / 4; ++c) std::memcpy(plain + 4 * c, group + (c * G + i) * 4, 4);
      if constexpr (byte_quants(KIND))  // stored as q + 128
        for (int64_t j = 0; j < bb; ++j) plain[j] = static_cast<uint8_t>(plain[j] ^ 0x80);
      return plain;
    } else {
      (void)plain;
      return qs + n * row_bytes + b * block_bytes_of(KIND);
    }
  }

  void dequant_rows(int64_t begin, int64_t end, float* out) const {
    if (kind == 0) dequant_rows_t<0>(begin, end, out);
    else if (kind == 1) dequant_rows_t<1>(begin, end, out);
    else if (kind == 2) dequant_rows_t<2>(begin, end, out);
    else if (kind == 3) dequant_rows_t<3>(begin, end, out);
    else if (kind == 4) dequant_rows_t<4>(begin, end, out);
    else if (kind == 5) dequant_rows_t<5>(begin, end, out);
    else if (kind == 6) dequant_rows_t<6>(begin, end, out);
    else if (kind == 7) dequant_rows_t<7>(begin, end, out);
    else if (kind == 8) dequant_rows_t<8>(begin, end, out);
    else if (kind == 9) dequant_rows_t<9>(begin, end, out);
    else if (kind == 10) dequant_rows_t<10>(begin, end, out);
    else if (kind == 11) dequant_rows_t<11>(begin, end, out);
    else if (kind == 12) dequant_rows_t<12>(begin, end, out);
    else if (kind == 13) dequant_rows_t<13>(begin, end, out);
    else if (kind == 14) dequant_rows_t<14>(begin, end, out);
    else dequant_rows_t<15>(begin, end, out);
  }

  // out[r * ldo + n] = sum_k x[r, k] * W[n, k] for n in [begin, end), R rows of x.
  // Per block, sum_i (d q_i + m) x_i = (d q) . x + m sum(x) (AVX2: d (q . x) + m sum(x)):
  // the minimum multiplies a per-block sum of x computed once per call.
  // With AVX-512, 1-4 rows of x take four outputs per pass and 5-8 rows two
  // (gemv_outputs): each output's sums are one chain of dependent adds per row, and
  // chains side by side keep the FMA units busy where one waited on its own latency (two
  // outputs with the table lookup of load_weights16: 1.3-2x for 1-4 rows, in cache, Intel
  // Xeon Ice Lake; four outputs and two for 5-8 rows: 1.05-1.1x more on Zen 5). An output's
  // arithmetic is the same either way, so its value does not depend on its neighbours,
  // on R or on how [begin, end) was split.
  template <int KIND, int R>
  void gemv_t(const GemvRows& in, float* __restrict out, int64_t ldo, int64_t begin,
              int64_t end) const {
#ifdef __AVX512F__
    constexpr int kPair = R <= 4 ? 4 : R <= 8 ? 2 : 1;
#else  // AVX2's 16 registers do not hold two outputs' sums beside the quants
    constexpr int kPair = 1;
#endif
    int64_t n = begin;
    for (; n + kPair <= end; n += kPair) gemv_outputs<KIND, R, kPair>(in, out, ldo, n);
    for (; n < end; ++n) gemv_outputs<KIND, R, 1>(in, out, ldo, n);
  }

  // Outputs n .. n + NO - 1 of gemv_t.
  template <int KIND, int R, int NO>
  void gemv_outputs(const GemvRows& in, float* __restrict out, int64_t ldo, int64_t n) const {
    // The interleaved kinds' matmul is block_gemm_exact.cpp's; this serves them correctly,
    // not fast.
    if constexpr (interleaved(KIND)) return gemv_outputs_scalar<KIND, R, NO>(in, out, ldo, n);
#if defined(__AVX2__) && !defined(__AVX512F__)
    if constexpr (nibble_planes(KIND)) return gemv_planes_outputs<KIND, R, NO>(*this, in, out, ldo, n);
#elif defined(__AVX512F__)
    // Nibble planes are AVX2's layout: AVX-512 builds never make them, but take them.
    if constexpr (nibble_planes(KIND)) return gemv_outputs_scalar<KIND, R, NO>(in, out, ldo, n);
#endif
    const float* __restrict x = in.x;
    const float* __restrict xsum = in.xsum;
    const int64_t nb = cols / kBlock, bb = block_bytes_of(KIND);
    for (int o = 0; o < NO; ++o) prefetch_row(n + o + kPrefetchRows);
#if defined(__AVX512F__)
    // A block's quants become its weights' d * q before any row touches them (exact in
    // float32 for the file's float16 scales), so each row costs two multiply-adds per
    // block instead of three (a multiply, then the scale applied to the partial sums);
    // with the table lookup the scale multiplies the 16-entry table, one instruction. The
    // minimum term joins a row's sums once per 16 blocks. One thread, in cache, against
    // the scaled partial sums (AMD EPYC Zen 5): 1 row as fast, 4 rows 1.2x, 8 rows 1.3x,
    // and 9-16 rows in one pass instead of two.
    constexpr int64_t kAhead = byte_quants(KIND) ? kGemvStreamAheadBytes : kStreamAheadBytes;
    __m512 acc[NO][R];
    for (int o = 0; o < NO; ++o)
      for (int r = 0; r < R; ++r) acc[o][r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
      const int64_t count = std::min<int64_t>(16, nb - b0);
      alignas(64) float scales[NO][16], scales_hi[NO][16];
      __m512 mins[NO];
      for (int o = 0; o < NO; ++o) {
        stream_scales<KIND>((n + o) * nb + b0);
        mins[o] = load_block_scales16<KIND>((n + o) * nb + b0, count, scales[o], scales_hi[o]);
      }
      for (int64_t b = b0; b < b0 + count; ++b)
        for (int o = 0; o < NO; ++o) {
          __m512 w[2];
          const float* d = scales[o] + (b - b0);
          load_weights16<KIND, (R <= 4)>(streamed_block<kAhead>(n + o, b, bb), d,
                                         KIND == 4 ? scales_hi[o] + (b - b0) : d, w);
          for (int r = 0; r < R; ++r) {
            const float* xb = x + r * cols + b * kBlock;
            acc[o][r] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb), acc[o][r]);
            acc[o][r] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + 16), acc[o][r]);
          }
        }
      if constexpr (has_min(KIND)) {
        const __mmask16 keep = static_cast<__mmask16>((1u << count) - 1);
        for (int r = 0; r < R; ++r) {
          const __m512 sums = _mm512_maskz_loadu_ps(keep, xsum + r * nb + b0);
          for (int o = 0; o < NO; ++o) acc[o][r] = _mm512_fmadd_ps(mins[o], sums, acc[o][r]);
        }
      }
    }
    for (int o = 0; o < NO; ++o)
      for (int r = 0; r < R; ++r) out[r * ldo + n + o] = _mm512_reduce_add_ps(acc[o][r]);
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
          load_quants<KIND, (R == 1)>(streamed_block(n + o, b, bb), q);
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
    (void)x, (void)xsum, (void)bb, (void)nb;
    gemv_outputs_scalar<KIND, R, NO>(in, out, ldo, n);
#endif
  }

  // gemv_outputs on dequantized blocks, for builds without AVX2 (x in weight order).
  template <int KIND, int R, int NO>
  void gemv_outputs_scalar(const GemvRows& in, float* __restrict out, int64_t ldo,
                           int64_t n) const {
    const int64_t nb = cols / kBlock;
    for (int o = 0; o < NO; ++o) {
      float acc[R] = {};
      alignas(64) float wb[kBlock];
      alignas(32) uint8_t plain[kBlock];
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t i = (n + o) * nb + b;
        dequant_block<base_kind(KIND)>(plain_block<KIND>(n + o, b, plain), scale<KIND>(i),
                                       minimum<KIND>(i), scale_hi<KIND>(i), wb);
        for (int r = 0; r < R; ++r) acc[r] += dot(wb, in.x + r * cols + b * kBlock, kBlock);
      }
      // The dequantized block already carries the minimum.
      for (int r = 0; r < R; ++r) out[r * ldo + n + o] = acc[r];
    }
  }

  template <int KIND>
  void gemv_kind(int64_t rows_x, const GemvRows& in, float* out, int64_t begin,
                 int64_t end) const {
    switch (rows_x) {
      case 1: return gemv_t<KIND, 1>(in, out, rows, begin, end);
      case 2: return gemv_t<KIND, 2>(in, out, rows, begin, end);
      case 3: return gemv_t<KIND, 3>(in, out, rows, begin, end);
      case 4: return gemv_t<KIND, 4>(in, out, rows, begin, end);
      case 5: return gemv_t<KIND, 5>(in, out, rows, begin, end);
#ifdef __AVX512F__
      case 6: return gemv_t<KIND, 6>(in, out, rows, begin, end);
      case 7: return gemv_t<KIND, 7>(in, out, rows, begin, end);
      case 8: return gemv_t<KIND, 8>(in, out, rows, begin, end);
      case 9: return gemv_t<KIND, 9>(in, out, rows, begin, end);
      case 10: return gemv_t<KIND, 10>(in, out, rows, begin, end);
      case 11: return gemv_t<KIND, 11>(in, out, rows, begin, end);
      case 12: return gemv_t<KIND, 12>(in, out, rows, begin, end);
      case 13: return gemv_t<KIND, 13>(in, out, rows, begin, end);
      case 14: return gemv_t<KIND, 14>(in, out, rows, begin, end);
      case 15: return gemv_t<KIND, 15>(in, out, rows, begin, end);
      default: return gemv_t<KIND, 16>(in, out, rows, begin, end);
#else
      default: return gemv_t<KIND, 6>(in, out, rows, begin, end);
#endif
    }
  }

  // Rows of x per GEMV pass: kGemvRows while those rows fit in 40 KiB (each output's pass
  // reads all of them, from L1), else at most 8 (what AVX-512 took before it took 16).
  // 16 rows of a 1536-wide x (96 KiB) took 2.1x as long per row as 8 (AMD EPYC Zen 5,
  // 48 KiB L1). Rows do not share arithmetic, so how they are split never changes a value.
  int64_t gemv_pass_rows() const {
    constexpr int64_t kFitBytes = 40 << 10;
    const bool fits = kGemvRows * cols * int64_t{sizeof(float)} <= kFitBytes;
    return fits ? kGemvRows : std::min<int64_t>(kGemvRows, 8);
  }

  // out[r, n] for rows_x rows of x as `in` holds them (GemvInput::rows_from).
  void gemv(int64_t rows_x, const GemvRows& in, float* out, int64_t begin, int64_t end) const {
    if (kind == 0) gemv_kind<0>(rows_x, in, out, begin, end);
    else if (kind == 1) gemv_kind<1>(rows_x, in, out, begin, end);
    else if (kind == 2) gemv_kind<2>(rows_x, in, out, begin, end);
    else if (kind == 3) gemv_kind<3>(rows_x, in, out, begin, end);
    else if (kind == 4) gemv_kind<4>(rows_x, in, out, begin, end);
    else if (kind == 5) gemv_kind<5>(rows_x, in, out, begin, end);
    else if (kind == 6) gemv_kind<6>(rows_x, in, out, begin, end);
    else if (kind == 7) gemv_kind<7>(rows_x, in, out, begin, end);
    else if (kind == 8) gemv_kind<8>(rows_x, in, out, begin, end);
    else if (kind == 9) gemv_kind<9>(rows_x, in, out, begin, end);
    else if (kind == 10) gemv_kind<10>(rows_x, in, out, begin, end);
    else if (kind == 11) gemv_kind<11>(rows_x, in, out, begin, end);
    else if (kind == 12) gemv_kind<12>(rows_x, in, out, begin, end);
    else if (kind == 13) gemv_kind<13>(rows_x, in, out, begin, end);
    else if (kind == 14) gemv_kind<14>(rows_x, in, out, begin, end);
    else gemv_kind<15>(rows_x, in, out, begin, end);
  }
};

}  // namespace kvserve_cpu

#include "block_gemm_planes.h"

namespace kvserve_cpu {

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
// without AVX2 + F16C + FMA), and its matmul for any number of rows of int8-quantized x
// (false, nothing written, in those builds), on AVX-512 VNNI or AVX2.
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

// block_gemm_packed_avx2.cpp: packed_groups_vnni's work in AVX2 builds without VNNI (false,
// nothing written, without AVX2). record, quant_bytes: bytes per group and block, quants.
bool packed_groups_avx2(const uint8_t* packed, int64_t kind, int64_t record,
                        int64_t quant_bytes, int64_t N, int64_t K, int64_t rows,
                        const int8_t* xq, const float* xd, const float* xs, float* out,
                        int64_t g_begin, int64_t g_end);

// ---- The lossless digit matmul on interleaved blocks (block_gemm_exact.cpp) -----------
// x as it reads it, prepared once per call into reused buffers. Each block of 32 values
// is split exactly into four int8 digits: with 2^(e-1) <= max|x| < 2^e, X = x 2^(30-e)
// rounded to an integer (|X| <= 2^30), X = a0 + 2^8 a1 + 2^16 a2 + 2^24 a3, every digit in
// -128..127. X is x itself (times a power of two) for every value within 2^7 of the
// block's largest; smaller ones round at 2^-31 of it.
class ExactInput {
 public:
  static constexpr int kDigits = 4;
  // Room for `rows` rows of `cols` values, so prepare allocates nothing (callers inside
  // a parallel region, where nothing may throw).
  void reserve(int64_t rows, int64_t cols) {
    const int64_t blocks = rows * cols / kBlock;
    digits_.reserve(blocks * kDigits * kBlock);
    scale_.reserve(blocks);
    sum_.reserve(blocks);
    digit_sums_.reserve(blocks * 2 * kDigits);
  }
  // kind: the weight's (7-15); digit sums are kept for the kinds without a minimum.
  void prepare(const float* x, int64_t rows, int64_t cols, int64_t kind);

  // Block i (= r nb + b) of x, digit k: 32 bytes in weight order.
  const int8_t* digits(int64_t i, int k) const { return digits_.data() + (i * kDigits + k) * kBlock; }
  float scale(int64_t i) const { return scale_.data()[i]; }  // x = scale X
  float sum(int64_t i) const { return sum_.data()[i]; }      // the block's 32 x, added in order
  // Block i's digit sums: kDigits over its 32 values, then kDigits over its last 16.
  const int32_t* digit_sums(int64_t i) const { return digit_sums_.data() + i * 2 * kDigits; }
  // Block i of x itself (the caller's buffer, read while the matmul runs): AVX2's float
  // path for several rows of x.
  const float* values(int64_t i) const { return x_ + i * kBlock; }

 private:
  const float* x_ = nullptr;
  GrowingBuffer<int8_t> digits_;
  GrowingBuffer<float> scale_, sum_;
  GrowingBuffer<int32_t> digit_sums_;
};

// Whether this build's digit matmul runs an interleaved kind (AVX-512 VNNI: all of
// 7-14; AVX2: the 4-bit ones, 8-10 and 13); kinds it does not run are never made, and
// block_linear serves them through the float GEMV's scalar path.
bool exact_packed_kind(int64_t kind);
// The kinds it runs (exact_packed_kind), ascending.
std::vector<int64_t> exact_packed_kinds();
// Up to how many rows of x the digit matmul takes them (AVX2: one; several rows take a
// float32 path on the same interleaved blocks, as fast as the float GEMV there).
int64_t digit_matmul_rows();
// out[r * ldo + n] for every row of x (as prepared) and the outputs of groups
// [g_begin, g_end) of 16 rows of an interleaved weight, on the calling thread.
void groups_exact(const BlockWeight& w, int64_t rows, const ExactInput& x, float* out,
                  int64_t ldo, int64_t g_begin, int64_t g_end);
// out [rows, w.rows] = x [rows, w.cols] W^T, threads splitting the groups.
void linear_exact(const BlockWeight& w, const float* x, int64_t rows, float* out);

// block_gemm_int8.cpp: x's 32 values quantized as gguf_int8 does (llama.cpp's Q8_1):
// int8 quants q, scale d and s = d * sum(q).
void quantize_block_q8(const float* x, int8_t* q, float& d, float& s);

}  // namespace kvserve_cpu
