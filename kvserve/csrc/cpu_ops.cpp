// CPU kernels for the hot per-layer ops that plain torch runs as many small passes
// (or, for paged decode attention, as a gather that copies every request's whole KV
// history per layer). Registered as torch.ops.kvserve.*; loaded by kvserve/_custom_ops.py.
//
// Built with -ffp-contract=off so that the elementwise kernels round exactly like the
// torch expressions they replace (no fused multiply-add where torch does mul then add).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <cmath>
#include <vector>

// Fortran BLAS sgemm (LP64), which torch's MKL exports; ATen's own cpublas::gemm is not.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

namespace {

// 16 independent lanes so the compiler emits full-width vector code without -ffast-math.
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += a[i + l] * b[i + l];
  float acc = 0.f;
  for (; i < n; ++i) acc += a[i] * b[i];
  for (int l = 0; l < 16; ++l) acc += lanes[l];
  return acc;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// exp(x) for x <= 0 (softmax after subtracting the max), written so that a loop over it
// vectorizes: 2^k * p(r) with x = k ln2 + r, |r| <= ln2/2, a degree-6 polynomial (about
// 2 ulp). Inputs below -87 flush to 0, as expf does within rounding.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  // Round x / ln2 to the nearest integer with the 1.5 * 2^23 trick (vectorizes, unlike
  // nearbyint); the integer then sits in the low mantissa bits of t.
  const float t = x * 1.44269504088896341f + 12582912.f;
  const float k = t - 12582912.f;
  const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  union {
    float f;
    int32_t i;
  } tb{t}, pb{p};
  pb.i += (tb.i - 0x4B400000) << 23;
  return x <= -87.f ? 0.f : pb.f;
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

// Decode attention straight from the paged cache: one task per (request, kv head) reads
// that head's keys and values once and serves all query heads of its GQA group.
//   out, query: [T, Hq, hd] (rows of the flattened batch; only token_indices are touched)
//   k_cache, v_cache: [num_blocks, block_size, Hkv, hd], contiguous
//   block_table: int32 [D, max_blocks]; seq_lens: int32 [D]; token_indices: int64 [D]
//   sliding_window <= 0: no window (else keys at positions >= seq_len - window).
void paged_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& seq_lens, const at::Tensor& token_indices,
                            double scale, int64_t sliding_window) {
  check_float(out, "out");
  check_float(query, "query");
  check_float(k_cache, "k_cache");
  check_float(v_cache, "v_cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [T, Hq, hd], hd contiguous");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1, "out must be [T, Hq, hd], hd contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
              "block_table must be contiguous int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt, "seq_lens must be int32");
  TORCH_CHECK(token_indices.scalar_type() == at::kLong, "token_indices must be int64");

  const int64_t num_reqs = block_table.size(0);
  const int64_t max_blocks = block_table.size(1);
  const int64_t num_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_size, "head size mismatch between query and cache");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = block_size > 0 ? num_kv_heads * head_size : 0;
  const int64_t block_stride = block_size * token_stride;

  const float* q_base = query.data_ptr<float>();
  float* o_base = out.data_ptr<float>();
  const float* k_base = k_cache.data_ptr<float>();
  const float* v_base = v_cache.data_ptr<float>();
  const int32_t* tables = block_table.data_ptr<int32_t>();
  const auto lens = seq_lens.contiguous();
  const auto toks = token_indices.contiguous();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  const int64_t* tok_ptr = toks.data_ptr<int64_t>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_reqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> qs(group * head_size), acc(group * head_size), inv_sum(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / num_kv_heads;
      const int64_t h = task % num_kv_heads;
      const int64_t seq_len = len_ptr[r];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
      const int64_t n = seq_len - first;
      const int64_t tok = tok_ptr[r];
      const int32_t* table = tables + r * max_blocks;
      if (n <= 0) {
        for (int64_t g = 0; g < group; ++g)
          std::fill_n(o_base + tok * os0 + (h * group + g) * os1, head_size, 0.f);
        continue;
      }
      scores.resize(group * n);
      for (int64_t g = 0; g < group; ++g) {
        const float* q = q_base + tok * qs0 + (h * group + g) * qs1;
        for (int64_t i = 0; i < head_size; ++i) qs[g * head_size + i] = q[i];
      }

      // Visits this head's row of every context position in [first, seq_len) of one cache,
      // block by block: one table lookup per block, not per token.
      auto for_each_position = [&](const float* cache, auto&& visit) {
        for (int64_t t0 = first - first % block_size; t0 < seq_len; t0 += block_size) {
          const float* block = cache + table[t0 / block_size] * block_stride + h * head_size;
          const int64_t lo = std::max(t0, first), hi = std::min(t0 + block_size, seq_len);
          for (int64_t t = lo; t < hi; ++t) visit(t - first, block + (t - t0) * token_stride);
        }
      };
      for_each_position(k_base, [&](int64_t i, const float* k) {
        for (int64_t g = 0; g < group; ++g)
          scores[g * n + i] = dot(qs.data() + g * head_size, k, head_size) * fscale;
      });
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        float m = -INFINITY;
        for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          s[i] = exp_nonpositive(s[i] - m);
          sum += s[i];
        }
        inv_sum[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_position(v_base, [&](int64_t i, const float* v) {
        for (int64_t g = 0; g < group; ++g)
          axpy(acc.data() + g * head_size, scores[g * n + i], v, head_size);
      });
      for (int64_t g = 0; g < group; ++g) {
        float* o = o_base + tok * os0 + (h * group + g) * os1;
        const float* a = acc.data() + g * head_size;
        for (int64_t i = 0; i < head_size; ++i) o[i] = a[i] * inv_sum[g];
      }
    }
  });
}

// Neox-style rotary embedding in place. query/key: [T, heads * head_size] with any row
// stride (views into the fused qkv output); cos_sin_cache: [max_pos, rot_dim] holding
// cos in the first half of each row and sin in the second, as vLLM lays it out.
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      int64_t head_size, const at::Tensor& cos_sin_cache) {
  check_float(query, "query");
  check_float(key, "key");
  check_float(cos_sin_cache, "cos_sin_cache");
  TORCH_CHECK(positions.scalar_type() == at::kLong, "positions must be int64");
  TORCH_CHECK(query.stride(1) == 1 && key.stride(1) == 1, "rows must be contiguous");
  TORCH_CHECK(cos_sin_cache.is_contiguous(), "cos_sin_cache must be contiguous");
  const int64_t num_tokens = positions.size(0);
  const int64_t rot_dim = cos_sin_cache.size(1);
  const int64_t half = rot_dim / 2;
  const int64_t max_pos = cos_sin_cache.size(0);
  const int64_t nq = query.size(1) / head_size;
  const int64_t nk = key.size(1) / head_size;
  const auto pos = positions.contiguous();
  const int64_t* pos_ptr = pos.data_ptr<int64_t>();
  const float* cache = cos_sin_cache.data_ptr<float>();
  float* q_base = query.data_ptr<float>();
  float* k_base = key.data_ptr<float>();
  const int64_t qs = query.stride(0), ks = key.stride(0);
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(pos_ptr[t] >= 0 && pos_ptr[t] < max_pos, "position ", pos_ptr[t],
                " outside the rotary cache of ", max_pos);

  auto rotate = [&](float* x, const float* cos, const float* sin) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      const float c = cos[i], s = sin[i];
      x[i] = x1 * c - x2 * s;
      x[i + half] = x2 * c + x1 * s;
    }
  };
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cache + pos_ptr[t] * rot_dim;
      const float* sin = cos + half;
      for (int64_t h = 0; h < nq; ++h) rotate(q_base + t * qs + h * head_size, cos, sin);
      for (int64_t h = 0; h < nk; ++h) rotate(k_base + t * ks + h * head_size, cos, sin);
    }
  });
}

inline float inv_rms(const float* x, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// out = weight * (x * rsqrt(mean(x^2) + eps)), row by row. x: [T, H] contiguous.
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float(out, "out");
  check_float(x, "x");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "rms_norm needs contiguous rows");
  const int64_t hidden = x.size(-1);
  const int64_t rows = x.numel() / hidden;
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * hidden;
      float* orow = op + r * hidden;
      const float inv = inv_rms(xr, hidden, e);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) orow[i] = w[i] * (xr[i] * inv);
    }
  });
}

// residual += x; x = weight * norm(residual), in place (the decoder-layer pattern).
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_float(x, "x");
  check_float(residual, "residual");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous(), "fused_add_rms_norm needs contiguous rows");
  const int64_t hidden = x.size(-1);
  const int64_t rows = x.numel() / hidden;
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * hidden;
      float* rr = rp + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) rr[i] = xr[i] + rr[i];
      const float inv = inv_rms(rr, hidden, e);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) xr[i] = w[i] * (rr[i] * inv);
    }
  });
}

// out[t, i] = silu(x[t, i]) * x[t, d + i] for the fused gate/up projection output [T, 2d].
// silu(g) = g / (1 + exp(-g)), with exp(-g) = 1 / exp(g) for g > 0 so that one
// vectorizable exp of a non-positive argument covers both signs.
void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  check_float(out, "out");
  check_float(x, "x");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "silu_and_mul needs contiguous rows");
  const int64_t d = x.size(-1) / 2;
  const int64_t rows = x.numel() / (2 * d);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = xp + r * 2 * d;
      const float* up = gate + d;
      float* o = op + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        const float g = gate[i];
        const float e = exp_nonpositive(-std::fabs(g));  // exp(-|g|)
        const float sig = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
        o[i] = g * sig * up[i];
      }
    }
  });
}

// ---- GGUF block weights ------------------------------------------------------------
// Linear layers can keep llama.cpp's 32-weight blocks instead of float32 weights, split
// into planes: qs (the quants), d (block scale) and m (block minimum, Q4_1 only), both
// scales as float32 (converted losslessly from the file's float16). Dequantization is
// the gguf package's own expression, so a dequantized block equals the float32 weight
// the model would otherwise load, bit for bit.
//   kind 0, Q8_0: w = d * q, q int8;                 qs: int8  [N, K]
//   kind 1, Q4_1: w = d * q + m, q in 0..15;         qs: uint8 [N, K/2]
//   kind 2, Q4_0: w = d * (q - 8), q in 0..15;       qs: uint8 [N, K/2]
// In a 4-bit block, byte j holds weight j in its low nibble and weight j + 16 in its high.
constexpr int64_t kBlock = 32;

template <int KIND>
inline void dequant_block(const uint8_t* __restrict qs, float d, float m, float* __restrict w) {
  if constexpr (KIND == 0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(qs);
#pragma omp simd
    for (int i = 0; i < 32; ++i) w[i] = d * static_cast<float>(q[i]);
  } else {
    int32_t lo[16], hi[16];
#pragma omp simd
    for (int j = 0; j < 16; ++j) {
      lo[j] = qs[j] & 15;
      hi[j] = qs[j] >> 4;
    }
    if constexpr (KIND == 1) {
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
template <int KIND>
inline void load_quants(const uint8_t* qs, __m256 q[4]) {
  if constexpr (KIND == 0) {
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(qs + 8 * i))));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(bytes, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    if constexpr (KIND == 2) {
      lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
      hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    }
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
  }
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

inline int64_t block_bytes_of(int64_t kind) { return kind == 0 ? 32 : 16; }

struct BlockWeight {
  int64_t kind, rows, cols, row_bytes;
  const uint8_t* qs;
  const float* d;
  const float* m;

  template <int KIND>
  void dequant_rows_t(int64_t begin, int64_t end, float* out) const {
    const int64_t nb = cols / kBlock, bb = block_bytes_of(KIND);
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = qs + n * row_bytes + b * bb;
        float* o = out + (n - begin) * cols + b * kBlock;
        const float db = d[n * nb + b], mb = KIND == 1 ? m[n * nb + b] : 0.f;
#ifdef __AVX2__
        __m256 q[4];
        load_quants<KIND>(block, q);
        const __m256 dv = _mm256_set1_ps(db), mv = _mm256_set1_ps(mb);
        for (int i = 0; i < 4; ++i) {
          // Multiply, then add: the gguf package's rounding, not a fused multiply-add.
          __m256 v = _mm256_mul_ps(dv, q[i]);
          if constexpr (KIND == 1) v = _mm256_add_ps(v, mv);
          _mm256_storeu_ps(o + 8 * i, v);
        }
#else
        dequant_block<KIND>(block, db, mb, o);
#endif
      }
  }

  void dequant_rows(int64_t begin, int64_t end, float* out) const {
    if (kind == 0) dequant_rows_t<0>(begin, end, out);
    else if (kind == 1) dequant_rows_t<1>(begin, end, out);
    else dequant_rows_t<2>(begin, end, out);
  }

  // out[r * ldo + n] = sum_k x[r, k] * W[n, k] for n in [begin, end), R rows of x.
  // out[r * ldo + n] = sum_k x[r, k] * W[n, k] for n in [begin, end), R rows of x.
  // Per block, sum_i (d q_i + m) x_i = d (q . x) + m sum(x): the scale multiplies one
  // vector of partial sums, and the minimum a per-block sum of x computed once per call.
  template <int KIND, int R>
  void gemv_t(const float* __restrict x, const float* __restrict xsum, float* __restrict out,
              int64_t ldo, int64_t begin, int64_t end) const {
    const int64_t nb = cols / kBlock, bb = block_bytes_of(KIND);
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = qs + n * row_bytes;
      const float* dn = d + n * nb;
#ifdef __AVX2__
      float min_term[R] = {};
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        __m256 q[4];
        load_quants<KIND>(row + b * bb, q);
        const __m256 scale = _mm256_set1_ps(dn[b]);
        for (int r = 0; r < R; ++r) {
          const float* xb = x + r * cols + b * kBlock;
          __m256 qx = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
          qx = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), qx);
          qx = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), qx);
          qx = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), qx);
          acc[r] = _mm256_fmadd_ps(scale, qx, acc[r]);
          if constexpr (KIND == 1) min_term[r] += m[n * nb + b] * xsum[r * nb + b];
        }
      }
      for (int r = 0; r < R; ++r) out[r * ldo + n] = hsum(acc[r]) + min_term[r];
#else
      float acc[R] = {};
      alignas(64) float wb[kBlock];
      for (int64_t b = 0; b < nb; ++b) {
        dequant_block<KIND>(row + b * bb, dn[b], KIND == 1 ? m[n * nb + b] : 0.f, wb);
        for (int r = 0; r < R; ++r) acc[r] += dot(wb, x + r * cols + b * kBlock, kBlock);
      }
      for (int r = 0; r < R; ++r) out[r * ldo + n] = acc[r];
      (void)xsum;  // the dequantized block already carries the minimum
#endif
    }
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
      default: return gemv_t<KIND, 6>(x, xsum, out, rows, begin, end);
    }
  }

  // xsum: [rows_x, cols / 32] sums of x per block (used by Q4_1's minimum).
  void gemv(int64_t rows_x, const float* x, const float* xsum, float* out, int64_t begin,
            int64_t end) const {
    if (kind == 0) gemv_kind<0>(rows_x, x, xsum, out, begin, end);
    else if (kind == 1) gemv_kind<1>(rows_x, x, xsum, out, begin, end);
    else gemv_kind<2>(rows_x, x, xsum, out, begin, end);
  }
};

BlockWeight block_weight(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                         int64_t kind) {
  TORCH_CHECK(kind >= 0 && kind <= 2, "unknown block kind ", kind);
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous() && qs.dim() == 2, "qs must be contiguous 2-D");
  check_float(d, "d");
  const int64_t rows = qs.size(0);
  const int64_t cols = kind == 0 ? qs.size(1) : qs.size(1) * 2;
  TORCH_CHECK(cols % kBlock == 0, "columns must be a multiple of 32");
  TORCH_CHECK(d.numel() == rows * cols / kBlock, "one scale per block expected");
  const float* m_ptr = nullptr;
  if (kind == 1) {
    check_float(m, "m");
    TORCH_CHECK(m.is_contiguous() && m.numel() == d.numel(), "one minimum per block expected");
    m_ptr = m.data_ptr<float>();
  }
  return {kind, rows, cols, qs.size(1), static_cast<const uint8_t*>(qs.data_ptr()),
          d.data_ptr<float>(), m_ptr};
}

at::Tensor dequantize_blocks(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                             int64_t kind) {
  const BlockWeight w = block_weight(qs, d, m, kind);
  at::Tensor out = at::empty({w.rows, w.cols}, d.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, w.rows, 64, [&](int64_t begin, int64_t end) {
    w.dequant_rows(begin, end, o + begin * w.cols);
  });
  return out;
}

// y = x @ W^T for x [M, K] float32 and W in blocks [N, K]. Weights cross the memory bus
// as 4-8 bits per value on every path; decode-sized inputs never materialize them.
constexpr int64_t kGemvRows = 6;
constexpr int64_t kTileRows = 64;
constexpr int64_t kWholeRows = 16;  // from here on: dequantized tiles + BLAS
constexpr int64_t kBlasTileRows = 128;

// Row-major out[M, ldc] (columns n0.. of it) = x[M, K] @ w[nw, K]^T, via column-major BLAS:
// C^T[nw, M] = w (a K x nw matrix, transposed) @ x^T (K x M).
void sgemm_nt(int64_t nw, int64_t rows_x, int64_t K, const float* w, const float* x, float* out,
              int64_t ldc) {
  const int m = static_cast<int>(nw), n = static_cast<int>(rows_x), k = static_cast<int>(K);
  const int ld = static_cast<int>(ldc);
  const float one = 1.f, zero = 0.f;
  sgemm_("T", "N", &m, &n, &k, &one, w, &k, x, &k, &zero, out, &ld);
}

at::Tensor block_linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                        const at::Tensor& m, int64_t kind) {
  const BlockWeight w = block_weight(qs, d, m, kind);
  check_float(x_in, "x");
  TORCH_CHECK(x_in.size(-1) == w.cols, "x has ", x_in.size(-1), " features, weight ", w.cols);
  const at::Tensor x = x_in.reshape({-1, w.cols}).contiguous();
  const int64_t rows_x = x.size(0), N = w.rows, K = w.cols, nb = K / kBlock;
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  at::Tensor out = at::empty(out_shape, x_in.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (rows_x == 0) return out;

  if (rows_x < kWholeRows) {
    // Tiles of W small enough to stay in cache while every group of x rows passes over
    // them; the quants are converted once per group, not once per row.
    std::vector<float> xsum(rows_x * nb);
    for (int64_t i = 0; i < rows_x * nb; ++i) {
      float sum = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) sum += xp[i * kBlock + j];
      xsum[i] = sum;
    }
    const int64_t num_tiles = (N + kTileRows - 1) / kTileRows;
    at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
      const int64_t n_begin = begin * kTileRows, n_end = std::min(N, end * kTileRows);
      for (int64_t n0 = n_begin; n0 < n_end; n0 += kTileRows) {
        const int64_t n1 = std::min(n_end, n0 + kTileRows);
        for (int64_t r0 = 0; r0 < rows_x; r0 += kGemvRows) {
          w.gemv(std::min(kGemvRows, rows_x - r0), xp + r0 * K, xsum.data() + r0 * nb,
                 op + r0 * N, n0, n1);
        }
      }
    });
    return out;
  }

  // Larger inputs (prefill chunks, big batches): each thread dequantizes a tile of W
  // into a cache-sized float32 buffer and multiplies it with single-threaded BLAS, so the
  // GEMM runs at full speed while W is still read once, in its quantized form.
  const int64_t num_tiles = (N + kBlasTileRows - 1) / kBlasTileRows;
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(kBlasTileRows * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kBlasTileRows, nt = std::min(kBlasTileRows, N - n0);
      w.dequant_rows(n0, n0 + nt, tile.data());
      sgemm_nt(nt, rows_x, K, tile.data(), xp, op + n0, N);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvserve, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor block_table, Tensor seq_lens, Tensor token_indices, float scale, "
      "int sliding_window) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, int head_size, "
      "Tensor cos_sin_cache) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("dequantize_blocks(Tensor qs, Tensor d, Tensor m, int kind) -> Tensor");
  m.def("block_linear(Tensor x, Tensor qs, Tensor d, Tensor m, int kind) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("dequantize_blocks", &dequantize_blocks);
  m.impl("block_linear", &block_linear);
}
