// The layers of a Llama-family decoder stack as decode_stack.cpp holds them, shared with
// the fused decode step (decode_step.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

#include "cpu_common.h"

namespace kvserve_cpu {

// A run of a linear layer's output features held in one form: a float32 weight (kind < 0)
// or GGUF block planes (kinds as in block_gemm.h).
struct ProjectionPart {
  at::Tensor weight;  // float32 [N, K], or the block quants
  at::Tensor d, m;
  std::optional<at::Tensor> packed;  // gguf_int8's interleaved copy (block_gemm_vnni.cpp)
  int64_t kind = -1;
  bool int8_activations = false;

  at::Tensor operator()(const at::Tensor& x) const;  // x W^T
  int64_t out_features() const { return weight.size(0); }
  int64_t in_features() const;
  // int8 activations on gguf_int8's packed copy.
  bool packed_int8() const { return kind >= 0 && int8_activations && packed.has_value(); }
  // Whether the fused decode step can run it: the packed copy, or float activations on
  // the blocks (gguf); not a float32 weight, nor int8 activations without the copy.
  bool fused_step_ready() const { return packed_int8() || (kind >= 0 && !int8_activations); }
};

// One linear layer, with an optional bias added after the product, as the modules do. Its
// output features are one part, or several in order where a GGUF file's fused shards
// differ in block type (Llama Q4_K_M files' Q4_K q and k beside a Q6_K v).
struct Projection {
  std::vector<ProjectionPart> parts;
  std::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const;
  int64_t out_features() const;
  int64_t in_features() const { return parts.front().in_features(); }
  bool fused_step_ready() const;
};

// The MLP's gate activation.
enum class Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

// One decoder layer. Two residual schemes: Llama's (post_norm is the fused add + norm
// before the MLP) and Gemma's sandwich (pre_ff_norm defined: post_norm normalises the
// attention output before its residual add, pre_ff_norm the MLP input, post_ff_norm the
// MLP output before its add). Norm weights are the kernels' factors (Gemma's 1 + w).
struct Layer {
  at::Tensor input_norm, post_norm;
  at::Tensor pre_ff_norm, post_ff_norm;  // undefined: Llama's scheme
  at::Tensor q_norm, k_norm;  // per-head norms of q and k before RoPE; undefined: none
  Projection qkv, o, gate_up, down;
  at::Tensor cos_sin_cache;  // this layer's RoPE table (Gemma: local or global base)
  Activation activation = Activation::kSilu;
  int64_t sliding_window = 0;  // <= 0: none
  int64_t kv_group = 0;        // which of the step's KV cache groups' inputs it reads

  bool sandwich() const { return pre_ff_norm.defined(); }
};

struct StackShape {
  int64_t num_heads, num_kv_heads, head_size;
  double eps, scale;
};

// The model's norm after the last layer, when the stack applies it: Llama's fused add +
// norm of (last MLP output, residual), or in the sandwich scheme the norm of the residual.
struct FinalNorm {
  at::Tensor weight;
  double eps;
};

// residual += y, row by row (the sandwich scheme's add after a norm).
inline void add_row(float* residual, const float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) residual[i] = residual[i] + y[i];
}

// One token's query and key heads normalised in place, head by head (Gemma's and
// Qwen3's q/k norms); k_w null: no norms.
inline void qk_norm_token(float* q, int64_t nq, float* k, int64_t nk, int64_t head_size,
                          const float* q_w, const float* k_w, float eps) {
  if (k_w == nullptr) return;
  for (int64_t h = 0; h < nq; ++h)
    rms_norm_row(q + h * head_size, q + h * head_size, q_w, head_size, eps);
  for (int64_t h = 0; h < nk; ++h)
    rms_norm_row(k + h * head_size, k + h * head_size, k_w, head_size, eps);
}

// A step's attention inputs (CPUAttentionMetadata's kernel inputs), one entry per KV
// cache group: a hybrid model's sliding-window and global layers have their own block
// tables and slots.
struct GroupInputs {
  std::vector<at::Tensor> slot_mappings, block_tables, seq_lens, token_indices;
  size_t size() const { return block_tables.size(); }
};

// Decode steps of at most this many rows may take the fused step.
constexpr int64_t kFusedStepMaxRows = 8;

// Whether fused_decode_step can run these layers for a step of `tokens` rows.
bool fused_step_supports(const std::vector<Layer>& layers, int64_t tokens);

// The whole stack for a decode step inside one parallel region: every projection split
// between the threads by output features, attention by heads, the small row operations
// repeated on each thread instead of waited for. Same kernels, same order of arithmetic
// as the per-op path, so the same result bit for bit. Returns (last MLP output, residual),
// or with `final_norm` (norm(last MLP output + residual), that sum); in the sandwich
// scheme (final norm of the residual stream, or the stream itself, the stream).
std::tuple<at::Tensor, at::Tensor> fused_decode_step(
    const std::vector<Layer>& layers, const StackShape& shape, const at::Tensor& hidden,
    const at::Tensor& positions, const std::vector<at::Tensor>& kv_caches,
    const GroupInputs& groups, const std::optional<FinalNorm>& final_norm);

}  // namespace kvserve_cpu
