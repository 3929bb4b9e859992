// CPU kernels for the hot per-layer ops that plain torch runs as many small passes
// (or, for paged decode attention, as a gather that copies every request's whole KV
// history per layer). Registered as torch.ops.kvserve.*; loaded by kvserve/_custom_ops.py.
// The GGUF block matmul lives in block_gemm.cpp.
//
// Built with -ffp-contract=off so that the elementwise kernels round exactly like the
// torch expressions they replace (no fused multiply-add where torch does mul then add).

#include <torch/library.h>

#include <vector>

#include "cpu_common.h"

namespace {

using namespace kvserve_cpu;

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
}
