// CPU kernels for the hot per-layer ops that plain torch runs as many small passes.
// Registered as torch.ops.kvserve.*; loaded by kvserve/_custom_ops.py.
// The GGUF block matmuls live in block_gemm*.cpp, paged decode attention in
// decode_attention.cpp.
//
// Built with -ffp-contract=off so that the elementwise kernels round exactly like the
// torch expressions they replace (no fused multiply-add where torch does mul then add).

// Without this GCC keeps float selects (a ? b : c on a comparison) as branches, which
// blocks vectorizing the exp-based loops. It only drops the assumption that FP exceptions
// are observed; no value changes. Placed first so the shared header's helpers get it too.
#pragma GCC optimize("no-trapping-math")

#include <torch/library.h>

#include <vector>

#include "cpu_common.h"

namespace kvserve_cpu {

// Below this much work (multiply-adds) a kernel runs on the calling thread: waking the
// OpenMP team costs more than the whole job (e.g. one decode row of a small model), and
// on a busy machine far more. Chunks of a parallel job get at least this much each.
constexpr int64_t kMinParallelWork = 1 << 18;

inline int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kMinParallelWork / std::max<int64_t>(1, work_per_item));
}

// ---- one row at a time: the registered ops below and the fused decode step
// (decode_step.cpp) call these same functions, so both round identically.

void rope_token(float* q, int64_t nq, float* k, int64_t nk, int64_t head_size,
                const float* cos_sin, int64_t half) {
  const float* cos = cos_sin;
  const float* sin = cos_sin + half;
  auto rotate = [&](float* x) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      const float c = cos[i], s = sin[i];
      x[i] = x1 * c - x2 * s;
      x[i + half] = x2 * c + x1 * s;
    }
  };
  for (int64_t h = 0; h < nq; ++h) rotate(q + h * head_size);
  for (int64_t h = 0; h < nk; ++h) rotate(k + h * head_size);
}

static float inv_rms(const float* x, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

void rms_norm_row(float* out, const float* x, const float* w, int64_t n, float eps) {
  const float inv = inv_rms(x, n, eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

void add_rms_norm_row(const float* y, float* residual, const float* w, float* out, int64_t n,
                      float eps) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) residual[i] = y[i] + residual[i];
  const float inv = inv_rms(residual, n, eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (residual[i] * inv);
}

// silu(g) = g / (1 + exp(-g)), with exp(-g) = 1 / exp(g) for g > 0 so that one
// vectorizable exp of a non-positive argument covers both signs.
void silu_mul_row(float* out, const float* gate, const float* up, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const float g = gate[i];
    const float e = exp_nonpositive(-std::fabs(g));  // exp(-|g|)
    // Same quotient either way; choosing the numerator first leaves no branch, so the
    // loop vectorizes.
    const float sig = (g >= 0.f ? 1.f : e) / (1.f + e);
    out[i] = g * sig * up[i];
  }
}

// gelu_tanh(g) = 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), written as
// g * sigmoid(2u) (the same function: 0.5 (1 + tanh(u)) = sigmoid(2u)) so that the
// sigmoid above's one vectorizable exp of a non-positive argument serves here too.
void gelu_tanh_mul_row(float* out, const float* gate, const float* up, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const float g = gate[i];
    const float z = 1.5957691216057308f * (g + 0.044715f * (g * g * g));  // 2u
    const float e = exp_nonpositive(-std::fabs(z));
    const float sig = (z >= 0.f ? 1.f : e) / (1.f + e);
    out[i] = g * sig * up[i];
  }
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

  at::parallel_for(0, num_tokens, grain_for((nq + nk) * head_size), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      rope_token(q_base + t * qs, nq, k_base + t * ks, nk, head_size, cache + pos_ptr[t] * rot_dim,
                 half);
  });
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
  at::parallel_for(0, rows, grain_for(2 * hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(op + r * hidden, xp + r * hidden, w, hidden, e);
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
  at::parallel_for(0, rows, grain_for(2 * hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * hidden;
      add_rms_norm_row(xr, rp + r * hidden, w, xr, hidden, e);
    }
  });
}

// out[t, i] = silu(x[t, i]) * x[t, d + i] for the fused gate/up projection output [T, 2d].
void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  check_float(out, "out");
  check_float(x, "x");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "silu_and_mul needs contiguous rows");
  const int64_t d = x.size(-1) / 2;
  const int64_t rows = x.numel() / (2 * d);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_for(8 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      silu_mul_row(op + r * d, xp + r * 2 * d, xp + r * 2 * d + d, d);
  });
}

// out[t, i] = gelu_tanh(x[t, i]) * x[t, d + i] (Gemma's gated MLP).
void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& x) {
  check_float(out, "out");
  check_float(x, "x");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "gelu_tanh_and_mul needs contiguous rows");
  const int64_t d = x.size(-1) / 2;
  const int64_t rows = x.numel() / (2 * d);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_for(10 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      gelu_tanh_mul_row(op + r * d, xp + r * 2 * d, xp + r * 2 * d + d, d);
  });
}

}  // namespace kvserve_cpu

TORCH_LIBRARY(kvserve, m) {
  m.def(
      "cache_and_decode_attention(Tensor(a!) out, Tensor query, Tensor key, Tensor value, "
      "Tensor(b!) kv_cache, Tensor slot_mapping, Tensor block_table, Tensor seq_lens, "
      "Tensor token_indices, float scale, int sliding_window) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, int head_size, "
      "Tensor cos_sin_cache) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("dequantize_blocks(Tensor qs, Tensor d, Tensor m, int kind) -> Tensor");
  m.def("dequantize_rows(Tensor qs, Tensor d, Tensor m, int kind, Tensor ids) -> Tensor");
  m.def("block_linear(Tensor x, Tensor qs, Tensor d, Tensor m, int kind) -> Tensor");
  m.def("dense_linear(Tensor x, Tensor w) -> Tensor");
  m.def(
      "block_linear_int8(Tensor x, Tensor qs, Tensor d, Tensor m, int kind, Tensor? packed=None) "
      "-> Tensor");
  m.def("pack_blocks_vnni(Tensor qs, Tensor d, Tensor m, int kind) -> Tensor");
  m.def("nibble_planes(Tensor qs, Tensor d, Tensor m, int kind) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("rotary_embedding", &kvserve_cpu::rotary_embedding);
  m.impl("rms_norm", &kvserve_cpu::rms_norm);
  m.impl("fused_add_rms_norm", &kvserve_cpu::fused_add_rms_norm);
  m.impl("silu_and_mul", &kvserve_cpu::silu_and_mul);
  m.impl("gelu_tanh_and_mul", &kvserve_cpu::gelu_tanh_and_mul);
}
