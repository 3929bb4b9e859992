// The float GEMV's input preparation (GemvInput) and its AVX2 form on nibble planes
// (kinds 5-6, block_quants.h), included by block_gemm.h after BlockWeight.
//
// Why: on AVX2 the plain 4-bit GEMV spends per 32 weights 6 instructions unpacking
// (widen, mask, shift), 4 converting and 5 multiplying-adding. In nibble planes a pair of
// blocks is one 32-byte load, and each 8 weights are one AND (the top nibble a shift) and
// one conversion, giving 2^(4k) q, exactly. x is prepared once per call in the same
// plane order, each plane's values scaled by 2^(S - 4k) (powers of two: exact), so every
// product is 2^S (q x) and every sum 2^S times today's, rounded identically: rounding
// commutes with scaling by a power of two while nothing overflows or becomes subnormal.
// The result, times 2^-S, is the plain AVX2 GEMV's float32 result bit for bit: the same
// products, the same order (per block q . x over its 4 vectors, then d times that into
// the accumulator). S is 24 unless a row's largest |x| would make 2^S x overflow in the
// sums (|x| >= 2^66: no model's activations), where it shrinks; only then can a tiny
// element's product lose bits as a subnormal. The quants stream as before: the same bytes
// per block, reordered.
#pragma once

#include <cmath>

namespace kvserve_cpu {

// A cache-aligned buffer that keeps its memory across calls and grows as needed.
template <typename T>
class GrowingBuffer {
 public:
  T* reserve(int64_t n) {
    if (n > capacity_) {
      data_ = CacheAligned<T>(n);
      capacity_ = n;
    }
    return data_.data();
  }
  T* data() { return data_.data(); }
  const T* data() const { return data_.data(); }

 private:
  CacheAligned<T> data_{0};
  int64_t capacity_ = 0;
};

// Nibble planes (AVX2): x's row in plane order, nibble k's 8 values at 64 g + 8 k (pair
// g), scaled by 2^(S - 4k) (the top nibble, taken by a shift, by 2^S); returns 2^-S.
inline float nibble_plane_row(const float* x, int64_t cols, float* out) {
  float amax = 0.f;
  for (int64_t i = 0; i < cols; ++i) amax = std::max(amax, std::fabs(x[i]));
  int s = 24;
  if (std::isfinite(amax) && amax > 0.f) {
    int e = 0;
    std::frexp(amax, &e);  // amax < 2^e
    // Sums reach 2^33 |x| at most (float16 scales, 15-quants, 8192 blocks): keep 2^S times
    // them below 2^123.
    s = std::min(s, 90 - e);
  }
  float scale[8];
  for (int k = 0; k < 8; ++k) scale[k] = std::ldexp(1.f, s - (k == 7 ? 0 : 4 * k));
  for (int64_t g = 0; g < cols; g += 2 * kBlock)
    for (int k = 0; k < 8; ++k)
      for (int j = 0; j < 8; ++j)
        out[g + 8 * k + j] = x[g + kBlock * (k & 1) + 8 * (k >> 1) + j] * scale[k];
  return std::ldexp(1.f, -s);
}

// x as a weight's float GEMV reads it, prepared once per call (its buffers are reused).
class GemvInput {
 public:
  // Room for `rows` rows of `cols` values up front, so prepare allocates nothing (for
  // callers inside a parallel region, where nothing may throw).
  void reserve(int64_t rows, int64_t cols) {
    xsum_.reserve(rows * cols / kBlock);
    unscale_.reserve(rows);
    planes_.reserve(rows * cols);
  }
  void prepare(const BlockWeight& w, const float* x, int64_t rows) {
    cols_ = w.cols;
    nb_ = w.cols / kBlock;
    x_ = x;
    block_sums(x, rows * nb_, xsum_.reserve(rows * nb_));
    float* unscale = unscale_.reserve(rows);
#if defined(__AVX2__) && !defined(__AVX512F__)
    if (nibble_planes(w.kind)) {
      float* planes = planes_.reserve(rows * cols_);
      for (int64_t r = 0; r < rows; ++r)
        unscale[r] = nibble_plane_row(x + r * cols_, cols_, planes + r * cols_);
      x_ = planes;
      return;
    }
#endif
    for (int64_t r = 0; r < rows; ++r) unscale[r] = 1.f;
  }
  // Rows r, r + 1, ... for BlockWeight::gemv.
  GemvRows rows_from(int64_t r) const {
    return {x_ + r * cols_, xsum_.data() + r * nb_, unscale_.data() + r};
  }

 private:
  int64_t cols_ = 0, nb_ = 0;
  const float* x_ = nullptr;
  GrowingBuffer<float> xsum_, unscale_, planes_;
};

#if defined(__AVX2__) && !defined(__AVX512F__)
// Nibble K of every lane of v as 8 floats: 2^(4K) q, for Q4_0 2^(4K) (q - 8); the top
// nibble (K = 7) unscaled. Exact: at most 5 significant bits.
template <int KIND, int K>
inline __m256 nibble_plane(__m256i v) {
  __m256i q = K == 7 ? _mm256_srli_epi32(v, 28) : _mm256_and_si256(v, _mm256_set1_epi32(15 << (4 * K)));
  if constexpr (KIND == 6) q = _mm256_sub_epi32(q, _mm256_set1_epi32(K == 7 ? 8 : 8 << (4 * K)));
  return _mm256_cvtepi32_ps(q);
}

// One block of a pair (HALF 0: nibbles 0, 2, 4, 6; 1: 1, 3, 5, 7) times R rows of x in
// plane order, scaled by the block's d into acc: the plain GEMV's arithmetic, times 2^S.
template <int KIND, int R, int HALF>
inline void planes_block(__m256i v, __m256 d, const float* __restrict x, int64_t cols,
                         __m256 (&acc)[R]) {
  const __m256 q[4] = {nibble_plane<KIND, HALF>(v), nibble_plane<KIND, 2 + HALF>(v),
                       nibble_plane<KIND, 4 + HALF>(v), nibble_plane<KIND, 6 + HALF>(v)};
  for (int r = 0; r < R; ++r) {
    const float* xp = x + r * cols + 8 * HALF;
    __m256 qx = _mm256_mul_ps(q[0], _mm256_loadu_ps(xp));
    qx = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xp + 16), qx);
    qx = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xp + 32), qx);
    qx = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xp + 48), qx);
    acc[r] = _mm256_fmadd_ps(d, qx, acc[r]);
  }
}

template <int KIND, int R, int NO>
void gemv_planes_outputs(const BlockWeight& w, const GemvRows& in, float* __restrict out,
                         int64_t ldo, int64_t n) {
  const int64_t nb = w.cols / kBlock;
  for (int o = 0; o < NO; ++o) w.prefetch_row(n + o + kPrefetchRows);
  __m256 acc[NO][R], min_acc[NO][R];
  for (int o = 0; o < NO; ++o)
    for (int r = 0; r < R; ++r) acc[o][r] = min_acc[o][r] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int64_t count = std::min<int64_t>(8, nb - b0);  // even: rows are pairs of blocks
    alignas(32) float scales[NO][8], unused[NO][8];
    __m256 mins[NO];
    for (int o = 0; o < NO; ++o)
      mins[o] = w.load_block_scales<KIND>((n + o) * nb + b0, count, scales[o], unused[o]);
    for (int64_t b = b0; b < b0 + count; b += 2)
      for (int o = 0; o < NO; ++o) {
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.streamed_block(n + o, b, 16)));
        const float* x = in.x + b * kBlock;
        planes_block<KIND, R, 0>(v, _mm256_broadcast_ss(scales[o] + (b - b0)), x, w.cols, acc[o]);
        planes_block<KIND, R, 1>(v, _mm256_broadcast_ss(scales[o] + (b - b0) + 1), x, w.cols,
                                 acc[o]);
      }
    if constexpr (has_min(KIND)) {
      const __m256i keep = BlockWeight::lane_mask(count);
      for (int r = 0; r < R; ++r) {
        const __m256 sums = _mm256_maskload_ps(in.xsum + r * nb + b0, keep);
        for (int o = 0; o < NO; ++o) min_acc[o][r] = _mm256_fmadd_ps(mins[o], sums, min_acc[o][r]);
      }
    }
  }
  for (int o = 0; o < NO; ++o)
    for (int r = 0; r < R; ++r) {
      const float min_term = has_min(KIND) ? hsum(min_acc[o][r]) : 0.f;
      out[r * ldo + n + o] = hsum(acc[o][r]) * in.unscale[r] + min_term;
    }
}
#endif

}  // namespace kvserve_cpu
