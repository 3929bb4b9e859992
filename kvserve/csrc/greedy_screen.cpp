// The greedy screen of a block-weight LM head (model_executor/layers/greedy_screen.py has
// the bound's derivation): gguf_int8's integer GEMV gives every logit approximately, each
// within a proven bound; the exact float GEMV then runs on the rows whose bound reaches
// the largest lower bound. One call per step, so the screen's selection costs no trips
// through torch's dispatcher and no parallel regions for vocabulary-wide elementwise work.

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "block_gemm.h"
#include "cpu_common.h"

namespace kvserve_cpu {

namespace {

// The rows of one x row's approximate logits that may hold the exact maximum, ascending;
// empty when the screen cannot tell (non-finite or all-zero x, too many candidates).
std::vector<int64_t> screen_candidates(const float* approx, const float* x, int64_t cols,
                                       const float* row_coeffs, const float* block_coeffs,
                                       int64_t vocab, int64_t max_candidates) {
  const int64_t nb = cols / kBlock;
  std::vector<double> block_max(nb);
  double largest = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    float a = 0.f;
    for (int i = 0; i < kBlock; ++i) a = std::max(a, std::fabs(x[b * kBlock + i]));
    if (!std::isfinite(a)) return {};
    block_max[b] = a;
    largest = std::max(largest, static_cast<double>(a));
  }
  if (largest == 0.0) return {};  // every logit ties
  // The comparisons run in double; the slack covers their rounding, the bounds' own
  // margin (1% in the coefficients) the float32 rounding of the coefficients.
  double floor = -std::numeric_limits<double>::infinity(), biggest = 0.0;
  int64_t n = 0;
#ifdef __AVX2__
  // Vocabulary-wide passes: four lanes, and independent maxima rather than one chain.
  const __m256d scale = _mm256_set1_pd(largest);
  const __m256d sign = _mm256_set1_pd(-0.0);
  __m256d lows = _mm256_set1_pd(floor), mags = _mm256_setzero_pd(), nans = _mm256_setzero_pd();
  for (; n + 4 <= vocab; n += 4) {
    const __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(approx + n));
    const __m256d bound = _mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(row_coeffs + n)), scale);
    lows = _mm256_max_pd(lows, _mm256_sub_pd(a, bound));
    mags = _mm256_max_pd(mags, _mm256_andnot_pd(sign, a));
    nans = _mm256_or_pd(nans, _mm256_cmp_pd(a, a, _CMP_UNORD_Q));  // max_pd would drop them
  }
  if (_mm256_movemask_pd(nans)) return {};
  alignas(32) double lanes[2][4];
  _mm256_store_pd(lanes[0], lows);
  _mm256_store_pd(lanes[1], mags);
  for (int i = 0; i < 4; ++i) {
    floor = std::max(floor, lanes[0][i]);
    biggest = std::max(biggest, lanes[1][i]);
  }
#endif
  for (; n < vocab; ++n) {
    const double a = approx[n];
    if (std::isnan(a)) return {};
    floor = std::max(floor, a - row_coeffs[n] * largest);
    biggest = std::max(biggest, std::fabs(a));
  }
  if (!std::isfinite(floor) || !std::isfinite(biggest)) return {};  // an infinite logit
  const double threshold = floor - 2 * std::ldexp(biggest, -40);
  std::vector<int64_t> candidates;
  n = 0;
#ifdef __AVX2__
  const __m256d at_least = _mm256_set1_pd(threshold);
  for (; n + 4 <= vocab; n += 4) {
    const __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(approx + n));
    const __m256d high = _mm256_add_pd(
        a, _mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(row_coeffs + n)), scale));
    int mask = _mm256_movemask_pd(_mm256_cmp_pd(high, at_least, _CMP_GE_OQ));
    for (; mask; mask &= mask - 1) candidates.push_back(n + __builtin_ctz(mask));
  }
#endif
  for (; n < vocab; ++n)
    if (approx[n] + row_coeffs[n] * largest >= threshold) candidates.push_back(n);
  if (candidates.size() > 16) {
    // The per-block bound on the survivors; a floor from any of them is still a lower
    // bound of the maximum, which is among them.
    std::vector<double> bound(candidates.size());
    double tight_floor = -std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < candidates.size(); ++i) {
      const float* c = block_coeffs + candidates[i] * nb;
      double sum = 0.0;
      for (int64_t b = 0; b < nb; ++b) sum += c[b] * block_max[b];
      bound[i] = sum;
      tight_floor = std::max(tight_floor, approx[candidates[i]] - sum);
    }
    size_t kept = 0;
    for (size_t i = 0; i < candidates.size(); ++i)
      if (approx[candidates[i]] + bound[i] >= tight_floor - 2 * std::ldexp(biggest, -40))
        candidates[kept++] = candidates[i];
    candidates.resize(kept);
  }
  if (static_cast<int64_t>(candidates.size()) > max_candidates) return {};
  return candidates;
}

// gguf_int8's arithmetic for the repacked k-quants, which gguf_int8 itself keeps on the
// exact path (kind 3: Q4_1 with float32 d and m; kind 4: int8 quants with a float32 scale
// per 16 weights): x quantized per 32 values (quantize_block_q8), a block's dot product in
// integer SIMD. The screen's bound holds for any such approximation: it needs only
// |x_i - d_x q_i| <= d_x / 2 and the float32 roundings of at most cols + 2 nb terms.
template <int KIND>
void approx_rows(const BlockWeight& w, const int8_t* xq, const float* xd, const float* xs,
                 int64_t rows_x, float* out, int64_t begin, int64_t end) {
  static_assert(KIND == 3 || KIND == 4);
  const int64_t nb = w.cols / kBlock, K = w.cols, N = w.rows;
  constexpr int64_t bb = KIND == 4 ? 32 : 16;
  for (int64_t n = begin; n < end; ++n) {
    w.prefetch_row(n + kPrefetchRows);
    const uint8_t* row = w.qs + n * w.row_bytes;
    const float* d = w.d32 + n * nb * (KIND == 4 ? 2 : 1);
    for (int64_t r = 0; r < rows_x; ++r) {
      const int8_t* xr = xq + r * K;
      const float* dx = xd + r * nb;
      float result = 0.f;
#ifdef __AVX2__
      const __m256i ones = _mm256_set1_epi16(1);
      __m256 acc = _mm256_setzero_ps();
      float mins = 0.f;  // kind 3's sum over blocks of m * s
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = row + b * bb;
        __m256i wu, xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + b * kBlock));
        __m256 scale;
        if constexpr (KIND == 4) {
          // maddubs multiplies unsigned by signed bytes: the weights' signs move to x.
          const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
          wu = _mm256_sign_epi8(wq, wq);
          xv = _mm256_sign_epi8(xv, wq);
          // int32 lanes 0-3 sum weights 0-15, lanes 4-7 weights 16-31.
          scale = _mm256_set_m128(_mm_set1_ps(d[2 * b + 1] * dx[b]), _mm_set1_ps(d[2 * b] * dx[b]));
        } else {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
          wu = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes),
                                _mm256_set1_epi8(15));
          scale = _mm256_set1_ps(d[b] * dx[b]);
          mins += w.m32[n * nb + b] * xs[r * nb + b];
        }
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv), ones);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc);
      }
      result = hsum(acc) + mins;
#else
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = row + b * bb;
        int32_t lo = 0, hi = 0;
        for (int i = 0; i < 16; ++i) {
          const int32_t q0 = KIND == 4 ? static_cast<int8_t>(block[i]) : block[i] & 15;
          const int32_t q1 = KIND == 4 ? static_cast<int8_t>(block[16 + i]) : block[i] >> 4;
          lo += q0 * xr[b * kBlock + i];
          hi += q1 * xr[b * kBlock + 16 + i];
        }
        if constexpr (KIND == 4) {
          result += dx[b] * (d[2 * b] * static_cast<float>(lo) + d[2 * b + 1] * static_cast<float>(hi));
        } else {
          result += d[b] * dx[b] * static_cast<float>(lo + hi) + w.m32[n * nb + b] * xs[r * nb + b];
        }
      }
#endif
      out[r * N + n] = result;
    }
  }
}

float block_minimum(const BlockWeight& w, int64_t i) {
  if (w.kind == 3) return w.m32[i];
  if (base_kind(w.kind) == 1) return f16(w.m[i]);
  return 0.f;
}

}  // namespace

// The bound's coefficients of the first `vocab` rows (greedy_screen.py derives them):
// c_rb = 1.01 (L1_rb 0.5001 / 127 + eps (L1_rb + 64 |m_b|)), eps = (K + 2 nb + 128) 2^-24,
// float32 [vocab, nb], and each row's sum 1.001 sum_b c_rb, float32 [vocab]. One pass over
// the weight at load (Gemma 3's 262,144-row head: torch's chunked version took 0.6 s).
std::tuple<at::Tensor, at::Tensor> greedy_screen_coeffs(const at::Tensor& qs, const at::Tensor& d,
                                                        const at::Tensor& m, int64_t kind,
                                                        int64_t vocab) {
  const BlockWeight w = block_weight(qs, d, m, kind);
  TORCH_CHECK(vocab > 0 && vocab <= w.rows, "vocab must be in [1, rows]");
  const int64_t nb = w.cols / kBlock;
  const double eps = std::ldexp(static_cast<double>(w.cols + 2 * nb + 128), -24);
  at::Tensor blocks = at::empty({vocab, nb}, d.options().dtype(at::kFloat));
  at::Tensor rows = at::empty({vocab}, d.options().dtype(at::kFloat));
  float* bp = blocks.data_ptr<float>();
  float* rp = rows.data_ptr<float>();
  at::parallel_for(0, vocab, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(w.cols);
    for (int64_t n = begin; n < end; ++n) {
      w.dequant_rows(n, n + 1, weights.data());
      double row = 0.0;
      for (int64_t b = 0; b < nb; ++b) {
        double l1 = 0.0;
        for (int i = 0; i < kBlock; ++i) l1 += std::fabs(weights[b * kBlock + i]);
        const double minimum = std::fabs(block_minimum(w, n * nb + b));
        const double c = 1.01 * (l1 * (0.5001 / 127) + eps * (l1 + 64 * minimum));
        bp[n * nb + b] = static_cast<float>(c);
        row += c;
      }
      rp[n] = static_cast<float>(1.001 * row);
    }
  });
  return {blocks, rows};
}

// The screen's approximate logits [R, N] for contiguous float32 x [R, K]: gguf_int8's own
// GEMV where it takes the kind (its bound is checked against these in the tests).
at::Tensor greedy_screen_approx(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                                const at::Tensor& m, int64_t kind) {
  if (kind != 3 && kind != 4) return block_linear_int8(x, qs, d, m, kind, std::nullopt);
  const BlockWeight w = block_weight(qs, d, m, kind);
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.cols && x.is_contiguous(),
              "x must be contiguous [rows, ", w.cols, "]");
  const int64_t rows_x = x.size(0), nb = w.cols / kBlock, N = w.rows;
  std::vector<int8_t> xq(rows_x * w.cols);
  std::vector<float> xd(rows_x * nb), xs(rows_x * nb);
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < rows_x * nb; ++i)
    quantize_block_q8(xp + i * kBlock, xq.data() + i * kBlock, xd[i], xs[i]);
  at::Tensor out = at::empty({rows_x, N}, x.options());
  float* op = out.data_ptr<float>();
  constexpr int64_t kTileRows = 16;
  at::parallel_for(0, (N + kTileRows - 1) / kTileRows, 1, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * kTileRows, n1 = std::min(N, end * kTileRows);
    if (kind == 3) approx_rows<3>(w, xq.data(), xd.data(), xs.data(), rows_x, op, n0, n1);
    else approx_rows<4>(w, xq.data(), xd.data(), xs.data(), rows_x, op, n0, n1);
  });
  return out;
}

// int64 [R]: each row's greedy token over the first `vocab` rows of the weight, or -1
// where the screen cannot tell (the caller then computes the logits).
at::Tensor greedy_screen(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                         const at::Tensor& m, int64_t kind, const at::Tensor& row_coeffs,
                         const at::Tensor& block_coeffs, int64_t vocab, int64_t max_candidates) {
  const BlockWeight w = block_weight(qs, d, m, kind);
  check_float(row_coeffs, "row_coeffs");
  check_float(block_coeffs, "block_coeffs");
  TORCH_CHECK(vocab > 0 && vocab <= w.rows, "vocab must be in [1, rows]");
  TORCH_CHECK(row_coeffs.is_contiguous() && row_coeffs.numel() == vocab,
              "row_coeffs: one per vocabulary row");
  TORCH_CHECK(block_coeffs.is_contiguous() && block_coeffs.numel() == vocab * (w.cols / kBlock),
              "block_coeffs: one per block of each vocabulary row");
  check_float(x_in, "x");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == w.cols, "x must be [rows, ", w.cols, "]");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor approx = greedy_screen_approx(x, qs, d, m, kind);
  const int64_t rows_x = x.size(0), N = w.rows;
  at::Tensor tokens = at::full({rows_x}, -1, x.options().dtype(at::kLong));
  int64_t* token = tokens.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  const float* ap = approx.data_ptr<float>();
  // The GEMV writes output n at index n: a vocabulary-wide row, kept between calls.
  thread_local std::vector<float> exact;
  if (static_cast<int64_t>(exact.size()) < N) exact.resize(N);
  GemvInput input;
  for (int64_t r = 0; r < rows_x; ++r) {
    const float* xr = xp + r * w.cols;
    const std::vector<int64_t> candidates =
        screen_candidates(ap + r * N, xr, w.cols, row_coeffs.data_ptr<float>(),
                          block_coeffs.data_ptr<float>(), vocab, max_candidates);
    if (candidates.empty()) continue;
    // The exact GEMV, one output at a time: an output's value does not depend on which
    // others the call computes (block_gemm.h), so these are the full head's logits.
    input.prepare(w, xr, 1);
    int64_t best = -1;
    float best_value = 0.f;
    for (const int64_t n : candidates) {
      w.gemv(1, input.rows_from(0), exact.data(), n, n + 1);
      if (std::isnan(exact[n])) {
        best = -1;  // the full head's argmax takes the first NaN: not the screen's to give
        break;
      }
      if (best < 0 || exact[n] > best_value) best = n, best_value = exact[n];
    }
    token[r] = best;
  }
  return tokens;
}

}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("greedy_screen_approx(Tensor x, Tensor qs, Tensor d, Tensor m, int kind) -> Tensor");
  m.def(
      "greedy_screen_coeffs(Tensor qs, Tensor d, Tensor m, int kind, int vocab) -> "
      "(Tensor, Tensor)");
  m.def(
      "greedy_screen(Tensor x, Tensor qs, Tensor d, Tensor m, int kind, Tensor row_coeffs, "
      "Tensor block_coeffs, int vocab, int max_candidates) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("greedy_screen_approx", &kvserve_cpu::greedy_screen_approx);
  m.impl("greedy_screen_coeffs", &kvserve_cpu::greedy_screen_coeffs);
  m.impl("greedy_screen", &kvserve_cpu::greedy_screen);
}
