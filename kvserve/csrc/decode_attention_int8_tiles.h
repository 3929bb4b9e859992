// The int8 KV cache's decode attention kernel (decode_attention_int8.cpp), its tile
// kernels: kTile cache rows widened to float32 once, then scored against each query head
// of their kv head's group or accumulated into each head's output. AVX-512 where a row
// fills whole registers, AVX2 (KVSERVE_MARCH=haswell) where it fills 8-lane ones,
// portable loops otherwise; the same values whichever runs, up to float32 rounding.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_common.h"

namespace kvserve_cpu {
namespace int8_kv {

// Each (token, head) row: head_size int8 values, then its bfloat16 scale.
constexpr int64_t kScaleBytes = 2;
// Rows widened to float32 together: one AVX-512 register of q.k sums.
constexpr int64_t kTile = 16;

inline float row_scale(const int8_t* row, int64_t head_size) {
  c10::BFloat16 s;
  std::memcpy(&s, row + head_size, kScaleBytes);
  return static_cast<float>(s);
}

// The widest vector code a row of head_size values fills exactly.
enum class Simd { kScalar, kAvx2, kAvx512 };

inline Simd simd_for(int64_t head_size) {
#ifdef __AVX512F__
  if (head_size % 16 == 0) return Simd::kAvx512;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (head_size % 8 == 0) return Simd::kAvx2;
#endif
  (void)head_size;
  return Simd::kScalar;
}

// fn(std::integral_constant<int, n>) for n in 1..8: accumulators as compile-time arrays
// stay in registers (a runtime count sent them through the stack).
template <typename Fn>
inline void with_chunks(int64_t n, Fn&& fn) {
  switch (n) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    case 6: return fn(std::integral_constant<int, 6>{});
    case 7: return fn(std::integral_constant<int, 7>{});
    case 8: return fn(std::integral_constant<int, 8>{});
    default: return;
  }
}

// f[j * head_size + i] = row j's integer values as float32 (exact), scales[j] = its
// scale times `mul`; rows m..kTile-1 zero, so the score kernels run whole tiles.
inline void widen_tile(const int8_t* const* rows, int64_t offset, int64_t m, int64_t head_size,
                float mul, Simd simd, float* f, float* scales) {
  for (int64_t j = 0; j < m; ++j) {
    const int8_t* row = rows[j] + offset;
    float* fj = f + j * head_size;
    scales[j] = row_scale(row, head_size) * mul;
    switch (simd) {
#ifdef __AVX512F__
      case Simd::kAvx512:
        for (int64_t c = 0; c < head_size; c += 16) {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c));
          _mm512_storeu_ps(fj + c, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
        }
        break;
#endif
#if defined(__AVX2__) && defined(__FMA__)
      case Simd::kAvx2:
        for (int64_t c = 0; c < head_size; c += 8) {
          const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c));
          _mm256_storeu_ps(fj + c, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
        }
        break;
#endif
      default:
        for (int64_t i = 0; i < head_size; ++i) fj[i] = static_cast<float>(row[i]);
    }
  }
  std::fill(f + m * head_size, f + kTile * head_size, 0.f);
  std::fill(scales + m, scales + kTile, 0.f);
}

#ifdef __AVX512F__
// Lane j of the result: the sum of a[j]'s 16 lanes (a 16x16 transpose folded into adds).
inline __m512 reduce16(const __m512* a) {
  __m512 quads[4];  // quads[t]: each 128-bit lane holds partial sums of rows 4t..4t+3
  for (int t = 0; t < 4; ++t) {
    const __m512* x = a + 4 * t;
    const auto pair = [](__m512 u, __m512 v) {
      return _mm512_add_ps(_mm512_unpacklo_ps(u, v), _mm512_unpackhi_ps(u, v));
    };
    const __m512 s01 = pair(x[0], x[1]), s23 = pair(x[2], x[3]);
    quads[t] = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const auto fold = [](__m512 lo, __m512 hi) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return fold(fold(quads[0], quads[1]), fold(quads[2], quads[3]));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Lane j of the result: the sum of a[j]'s 8 lanes.
inline __m256 reduce8(const __m256* a) {
  const __m256 s03 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s47 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20),
                       _mm256_permute2f128_ps(s03, s47, 0x31));
}
#endif

// out[j] = scales[j] * (q . f_j) for the tile's kTile rows.
inline void score_tile(const float* q, const float* f, const float* scales, int64_t head_size,
                Simd simd, float* out) {
  switch (simd) {
#ifdef __AVX512F__
    case Simd::kAvx512: {
      __m512 acc[kTile];
      for (int j = 0; j < kTile; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t c = 0; c < head_size; c += 16) {
        const __m512 qv = _mm512_loadu_ps(q + c);
        for (int j = 0; j < kTile; ++j)
          acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(f + j * head_size + c), acc[j]);
      }
      _mm512_storeu_ps(out, _mm512_mul_ps(reduce16(acc), _mm512_loadu_ps(scales)));
      return;
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    case Simd::kAvx2:
      for (int half = 0; half < kTile; half += 8) {
        __m256 acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
        const float* fh = f + half * head_size;
        for (int64_t c = 0; c < head_size; c += 8) {
          const __m256 qv = _mm256_loadu_ps(q + c);
          for (int j = 0; j < 8; ++j)
            acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(fh + j * head_size + c), acc[j]);
        }
        _mm256_storeu_ps(out + half, _mm256_mul_ps(reduce8(acc), _mm256_loadu_ps(scales + half)));
      }
      return;
#endif
    default:
      for (int64_t j = 0; j < kTile; ++j) out[j] = dot(q, f + j * head_size, head_size) * scales[j];
  }
}

// acc[0, head_size) += sum_j w[j] f_j over the tile's first m rows.
inline void accumulate_tile(const float* w, const float* f, int64_t m, int64_t head_size, Simd simd,
                     float* acc) {
  switch (simd) {
#ifdef __AVX512F__
    case Simd::kAvx512:
      for (int64_t c0 = 0; c0 < head_size; c0 += 128)
        with_chunks(std::min<int64_t>(8, (head_size - c0) / 16), [&](auto chunks) {
          constexpr int C = decltype(chunks)::value;
          __m512 a[C];
          for (int c = 0; c < C; ++c) a[c] = _mm512_loadu_ps(acc + c0 + 16 * c);
          for (int64_t j = 0; j < m; ++j) {
            const __m512 wj = _mm512_set1_ps(w[j]);
            const float* row = f + j * head_size + c0;
            for (int c = 0; c < C; ++c)
              a[c] = _mm512_fmadd_ps(wj, _mm512_loadu_ps(row + 16 * c), a[c]);
          }
          for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + c0 + 16 * c, a[c]);
        });
      return;
#endif
#if defined(__AVX2__) && defined(__FMA__)
    case Simd::kAvx2:
      for (int64_t c0 = 0; c0 < head_size; c0 += 64)
        with_chunks(std::min<int64_t>(8, (head_size - c0) / 8), [&](auto chunks) {
          constexpr int C = decltype(chunks)::value;
          __m256 a[C];
          for (int c = 0; c < C; ++c) a[c] = _mm256_loadu_ps(acc + c0 + 8 * c);
          for (int64_t j = 0; j < m; ++j) {
            const __m256 wj = _mm256_set1_ps(w[j]);
            const float* row = f + j * head_size + c0;
            for (int c = 0; c < C; ++c)
              a[c] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(row + 8 * c), a[c]);
          }
          for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + c0 + 8 * c, a[c]);
        });
      return;
#endif
    default:
      for (int64_t j = 0; j < m; ++j) {
        const float* row = f + j * head_size;
        for (int64_t i = 0; i < head_size; ++i) acc[i] += w[j] * row[i];
      }
  }
}

// Asks for `bytes` from each of m rows (at rows[j] + offset) while the current tile is
// worked on: the cache is usually out of every CPU cache by the next step, and its
// rows are scattered by the block table.
inline void prefetch_rows(const int8_t* const* rows, int64_t m, int64_t offset, int64_t bytes) {
  for (int64_t j = 0; j < m; ++j) {
    const char* p = reinterpret_cast<const char*>(rows[j] + offset);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
    __builtin_prefetch(p + bytes - 1);
  }
}

}  // namespace int8_kv
}  // namespace kvserve_cpu
