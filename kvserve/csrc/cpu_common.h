// Helpers shared by kvserve's CPU kernels (cpu_ops.cpp, decode_attention.cpp, block_gemm*.cpp).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <optional>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvserve_cpu {

// A heap array of n values starting on a cache line (std::vector's start only 16 bytes
// apart): the GEMVs load their input 64 bytes at a time, and a load that straddles two
// lines costs two (an 8-row float GEMV 1.5x slower from a vector's data on an Intel Xeon
// Ice Lake). Contents start uninitialized; n = 0 allocates nothing (data() is null).
template <typename T>
class CacheAligned {
 public:
  explicit CacheAligned(int64_t n)
      : data_(n > 0 ? static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64))
                    : nullptr) {
    if (n > 0 && data_ == nullptr) throw std::bad_alloc();
  }
  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  T& operator[](int64_t i) { return data_.get()[i]; }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
};

#ifdef __AVX2__
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

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

inline void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

// Row kernels (cpu_ops.cpp), shared by the registered ops and the fused decode step.
// rope_token: one token's query and key heads, neox style; cos_sin: the position's row
// of the cache (cos in the first half, sin in the second).
void rope_token(float* q, int64_t nq, float* k, int64_t nk, int64_t head_size,
                const float* cos_sin, int64_t half);
void rms_norm_row(float* out, const float* x, const float* w, int64_t n, float eps);
// residual += y; out = w * norm(residual). y may be out.
void add_rms_norm_row(const float* y, float* residual, const float* w, float* out, int64_t n,
                      float eps);
// out = silu(gate) * up.
void silu_mul_row(float* out, const float* gate, const float* up, int64_t d);
// out = gelu_tanh(gate) * up (Gemma's GELU, tanh approximation).
void gelu_tanh_mul_row(float* out, const float* gate, const float* up, int64_t d);

// The kernels registered as torch.ops.kvserve.*, callable directly from other kernels
// (decode_stack.cpp runs a whole decoder stack through them without the dispatcher).
void cache_and_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, at::Tensor& kv_cache,
                                const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                const at::Tensor& seq_lens, const at::Tensor& token_indices,
                                double scale, int64_t sliding_window);
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      int64_t head_size, const at::Tensor& cos_sin_cache);
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps);
void silu_and_mul(at::Tensor& out, const at::Tensor& x);
void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& x);
at::Tensor block_linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                        const at::Tensor& m, int64_t kind);
// x's 32 values as int8 q with scale d (max|x| / 127) and s = d * sum(q) (block_gemm_int8.cpp).
void quantize_block_q8(const float* x, int8_t* q, float& d, float& s);
at::Tensor block_linear_int8(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                             const at::Tensor& m, int64_t kind,
                             const std::optional<at::Tensor>& packed);

}  // namespace kvserve_cpu
