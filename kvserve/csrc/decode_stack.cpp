// A Llama-family or Gemma 3 decoder stack, run for a decode step as one call from Python.
//
// A single-stream decode step does about 15 small ops per layer. Through the Python
// modules and the dispatcher each costs a few microseconds of framework time, which for
// a 30-layer model is several milliseconds per token: as much as reading the quantized
// weights. Here the same kernels (the ones torch.ops.kvserve registers) are called
// directly, in the same order on the same operands, so the result is bit for bit what
// the per-layer Python path computes. Prefill steps keep the Python path (their
// attention is SDPA over gathered blocks).
//
// Registered as torch.classes.kvserve.DecoderStack; built by
// kvserve/model_executor/models/llama_decode_stack.py, which holds the eligibility rules.

#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "block_gemm.h"
#include "decode_stack.h"

namespace kvserve_cpu {

at::Tensor ProjectionPart::operator()(const at::Tensor& x) const {
  return kind < 0              ? dense_linear(x, weight)
         : int8_activations ? block_linear_int8(x, weight, d, m, kind, packed)
                               : block_linear(x, weight, d, m, kind);
}

int64_t ProjectionPart::in_features() const {
  return kind < 0 ? weight.size(1) : weight_cols(kind, weight.size(1));
}

at::Tensor Projection::operator()(const at::Tensor& x) const {
  at::Tensor y;
  if (parts.size() == 1) {
    y = parts.front()(x);
  } else {
    std::vector<at::Tensor> outs;
    outs.reserve(parts.size());
    for (const ProjectionPart& part : parts) outs.push_back(part(x));
    y = at::cat(outs, -1);
  }
  return bias ? at::add(y, *bias) : y;
}

int64_t Projection::out_features() const {
  int64_t n = 0;
  for (const ProjectionPart& part : parts) n += part.out_features();
  return n;
}

bool Projection::fused_step_ready() const {
  return std::all_of(parts.begin(), parts.end(),
                     [](const ProjectionPart& part) { return part.fused_step_ready(); });
}

namespace {

void check_rope_table(const at::Tensor& cos_sin_cache) {
  check_float(cos_sin_cache, "cos_sin_cache");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be a contiguous [max_pos, rot_dim]");
}

void check_norm(const at::Tensor& w, int64_t n, const char* name) {
  check_float(w, name);
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.numel() == n, name,
              " must be contiguous, ", n, " weights");
}

}  // namespace

class DecoderStack : public torch::CustomClassHolder {
 public:
  // cos_sin_cache: the RoPE table of every layer that add_layer gives none of its own.
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_size, double eps,
               double scale, at::Tensor cos_sin_cache)
      : shape_{num_heads, num_kv_heads, head_size, eps, scale},
        default_rope_(std::move(cos_sin_cache)) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
                "query heads must be a positive multiple of kv heads");
    check_rope_table(default_rope_);
  }

  // planes: (weight, d, m, packed) of each part of qkv, o, gate_up and down in that
  // order, packed empty where there is none; kinds and int8_activations: one per part,
  // kind -1 for a float32 weight (its d, m and packed are ignored); part_counts: how many
  // parts each of the 4 projections has (Projection: several where block types differ). sandwich_norms: empty
  // (Llama's scheme) or Gemma's (pre-feedforward, post-feedforward) norms; q_norm and
  // k_norm: per-head norms before RoPE, both or neither; cos_sin_cache: this layer's
  // RoPE table (the stack's by default); activation: Activation's value.
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::vector<at::Tensor> planes,
                 std::vector<int64_t> kinds, c10::List<bool> int8_activations,
                 std::vector<int64_t> part_counts, std::optional<at::Tensor> qkv_bias, std::optional<at::Tensor> o_bias,
                 int64_t sliding_window, std::vector<at::Tensor> sandwich_norms,
                 std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                 std::optional<at::Tensor> cos_sin_cache, int64_t activation) {
    TORCH_CHECK(part_counts.size() == 4 &&
                    std::all_of(part_counts.begin(), part_counts.end(),
                                [](int64_t n) { return n >= 1; }),
                "add_layer takes 4 projections of at least one part each");
    const size_t num_parts = static_cast<size_t>(
        std::accumulate(part_counts.begin(), part_counts.end(), int64_t{0}));
    TORCH_CHECK(planes.size() == 4 * num_parts && kinds.size() == num_parts &&
                    int8_activations.size() == num_parts,
                "add_layer takes each part as (weight, d, m, packed), a kind and an int8 flag");
    TORCH_CHECK(sandwich_norms.empty() || sandwich_norms.size() == 2,
                "sandwich_norms: none, or the pre- and post-feedforward norms");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm go together");
    TORCH_CHECK(activation == static_cast<int64_t>(Activation::kSilu) ||
                    activation == static_cast<int64_t>(Activation::kGeluTanh),
                "activation must be 0 (SiLU) or 1 (GELU, tanh)");
    const int64_t hidden = input_norm.numel();
    check_norm(input_norm, hidden, "input_norm");
    check_norm(post_norm, hidden, "post_norm");
    Layer layer;
    layer.input_norm = std::move(input_norm);
    layer.post_norm = std::move(post_norm);
    if (!sandwich_norms.empty()) {
      check_norm(sandwich_norms[0], hidden, "pre_ff_norm");
      check_norm(sandwich_norms[1], hidden, "post_ff_norm");
      layer.pre_ff_norm = sandwich_norms[0];
      layer.post_ff_norm = sandwich_norms[1];
    }
    if (q_norm) {
      check_norm(*q_norm, shape_.head_size, "q_norm");
      check_norm(*k_norm, shape_.head_size, "k_norm");
      layer.q_norm = *q_norm;
      layer.k_norm = *k_norm;
    }
    if (cos_sin_cache) check_rope_table(*cos_sin_cache);
    layer.cos_sin_cache = cos_sin_cache ? *cos_sin_cache : default_rope_;
    layer.activation = static_cast<Activation>(activation);
    Projection* projections[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    size_t i = 0;
    for (int p = 0; p < 4; ++p) {
      Projection& proj = *projections[p];
      for (int64_t n = 0; n < part_counts[p]; ++n, ++i) {
        ProjectionPart part;
        part.weight = planes[4 * i];
        part.d = planes[4 * i + 1];
        part.m = planes[4 * i + 2];
        if (planes[4 * i + 3].numel() > 0) part.packed = planes[4 * i + 3];
        part.kind = kinds[i];
        part.int8_activations = int8_activations.get(i);
        if (part.kind < 0) check_float(part.weight, "float32 weight");
        if (part.packed_int8())
          check_packed_vnni(*part.packed, part.kind, part.out_features(), part.in_features());
        TORCH_CHECK(proj.parts.empty() || part.in_features() == proj.in_features(),
                    "a projection's parts take inputs of one size");
        proj.parts.push_back(std::move(part));
      }
    }
    layer.qkv.bias = std::move(qkv_bias);
    layer.o.bias = std::move(o_bias);
    layer.sliding_window = sliding_window;
    layers_.push_back(std::move(layer));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The model's norm after the last layer: forward then applies it (Llama's RMSNorm, as
  // the model's fused add + norm would) and returns the normed states.
  void set_final_norm(at::Tensor weight, double eps) {
    check_float(weight, "final norm");
    TORCH_CHECK(!layers_.empty() && weight.dim() == 1 && weight.is_contiguous() &&
                    weight.numel() == layers_.front().input_norm.numel(),
                "the final norm must be contiguous, one weight per hidden feature");
    final_norm_ = FinalNorm{std::move(weight), eps};
  }

  // One KV cache per layer, kept until the runner binds new ones: a Python list of 30
  // tensors converted on every call was a measurable part of a single-stream step.
  void set_kv_caches(std::vector<at::Tensor> kv_caches) {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer expected, got ",
                kv_caches.size(), " for ", layers_.size());
    kv_caches_ = std::move(kv_caches);
  }

  // Each layer's KV cache group (an index into forward's per-group lists); all 0 by
  // default, the single group of a model without hybrid attention.
  void set_kv_groups(std::vector<int64_t> kv_groups) {
    TORCH_CHECK(kv_groups.size() == layers_.size(), "one KV cache group per layer expected");
    num_kv_groups_ = 0;
    for (size_t i = 0; i < layers_.size(); ++i) {
      TORCH_CHECK(kv_groups[i] >= 0, "KV cache groups are numbered from 0");
      layers_[i].kv_group = kv_groups[i];
      num_kv_groups_ = std::max(num_kv_groups_, kv_groups[i] + 1);
    }
  }

  // hidden: [T, H] embeddings of the step's tokens, every one a decode row; returns
  // (last layer's MLP output, residual stream) for the model's final fused add + norm, or
  // with set_final_norm (the normed states, residual stream); in the sandwich scheme
  // (the final norm of the residual stream, or without one the stream itself; the
  // stream). The attention arguments are CPUAttentionMetadata's kernel inputs, one of
  // each per KV cache group; rows at and past num_actual_tokens are padding, whose
  // attention output is zero.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, at::Tensor positions,
                                             std::vector<at::Tensor> slot_mappings,
                                             std::vector<at::Tensor> block_tables,
                                             std::vector<at::Tensor> seq_lens,
                                             std::vector<at::Tensor> token_indices,
                                             int64_t num_actual_tokens) {
    const GroupInputs groups{std::move(slot_mappings), std::move(block_tables),
                             std::move(seq_lens), std::move(token_indices)};
    TORCH_CHECK(static_cast<int64_t>(groups.size()) == num_kv_groups_ &&
                    groups.slot_mappings.size() == groups.size() &&
                    groups.seq_lens.size() == groups.size() &&
                    groups.token_indices.size() == groups.size(),
                "attention inputs for ", num_kv_groups_, " KV cache groups expected");
    TORCH_CHECK(!layers_.empty(), "the decoder stack has no layers");
    TORCH_CHECK(kv_caches_.size() == layers_.size(), "set_kv_caches first: ",
                kv_caches_.size(), " KV caches for ", layers_.size(), " layers");
    std::vector<at::Tensor>& kv_caches = kv_caches_;
    check_float(hidden, "hidden");
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be contiguous [T, H]");
    const int64_t tokens = hidden.size(0);
    const bool padded = num_actual_tokens != tokens;
    if (!padded && fused_step_supports(layers_, tokens))
      return fused_decode_step(layers_, shape_, hidden, positions, kv_caches, groups,
                               final_norm_);
    const int64_t num_heads = shape_.num_heads, num_kv_heads = shape_.num_kv_heads;
    const int64_t head_size = shape_.head_size;
    const double eps = shape_.eps;
    const int64_t q_size = num_heads * head_size, kv_size = num_kv_heads * head_size;
    auto norm = [eps](const at::Tensor& x, const at::Tensor& w) {
      at::Tensor out = at::empty_like(x);
      rms_norm(out, x, w, eps);
      return out;
    };

    // Llama's scheme updates the residual stream in place (as the modules' fused add +
    // norm does); the sandwich scheme adds into a new tensor (as Gemma's modules do).
    at::Tensor residual = hidden;
    at::Tensor x = norm(hidden, layers_[0].input_norm);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const size_t g = static_cast<size_t>(layer.kv_group);
      if (i > 0 && layers_[i - 1].sandwich()) {
        residual = at::add(residual, norm(x, layers_[i - 1].post_ff_norm));
        x = norm(residual, layer.input_norm);
      } else if (i > 0) {
        fused_add_rms_norm(x, residual, layer.input_norm, eps);
      }

      const at::Tensor qkv = layer.qkv(x);
      if (layer.q_norm.defined()) {
        float* row = qkv.data_ptr<float>();
        const int64_t stride = qkv.size(1);
        for (int64_t t = 0; t < tokens; ++t)
          qk_norm_token(row + t * stride, num_heads, row + t * stride + q_size, num_kv_heads,
                        head_size, layer.q_norm.data_ptr<float>(),
                        layer.k_norm.data_ptr<float>(), static_cast<float>(eps));
      }
      at::Tensor q = qkv.narrow(1, 0, q_size);
      at::Tensor k = qkv.narrow(1, q_size, kv_size);
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
      rotary_embedding(positions, q, k, head_size, layer.cos_sin_cache);
      at::Tensor attn = padded ? at::zeros({tokens, q_size}, hidden.options())
                               : at::empty({tokens, q_size}, hidden.options());
      at::Tensor attn_heads = attn.view({tokens, num_heads, head_size});
      cache_and_decode_attention(attn_heads, q.view({tokens, num_heads, head_size}),
                                 k.view({tokens, num_kv_heads, head_size}),
                                 v.view({tokens, num_kv_heads, head_size}), kv_caches[i],
                                 groups.slot_mappings[g], groups.block_tables[g],
                                 groups.seq_lens[g], groups.token_indices[g], shape_.scale,
                                 layer.sliding_window);

      x = layer.o(attn);
      if (layer.sandwich()) {
        residual = at::add(residual, norm(x, layer.post_norm));
        x = norm(residual, layer.pre_ff_norm);
      } else {
        fused_add_rms_norm(x, residual, layer.post_norm, eps);
      }
      const at::Tensor gate_up = layer.gate_up(x);
      at::Tensor act = at::empty({tokens, gate_up.size(1) / 2}, hidden.options());
      if (layer.activation == Activation::kGeluTanh)
        gelu_tanh_and_mul(act, gate_up);
      else
        silu_and_mul(act, gate_up);
      x = layer.down(act);
    }
    if (layers_.back().sandwich()) {
      residual = at::add(residual, norm(x, layers_.back().post_ff_norm));
      if (!final_norm_) return {residual, residual};
      at::Tensor out = at::empty_like(residual);
      rms_norm(out, residual, final_norm_->weight, final_norm_->eps);
      return {out, residual};
    }
    if (final_norm_) fused_add_rms_norm(x, residual, final_norm_->weight, final_norm_->eps);
    return {x, residual};
  }

 private:
  StackShape shape_;
  at::Tensor default_rope_;
  std::vector<Layer> layers_;
  std::vector<at::Tensor> kv_caches_;
  std::optional<FinalNorm> final_norm_;
  int64_t num_kv_groups_ = 1;
};

}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.class_<kvserve_cpu::DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor>())
      .def("add_layer", &kvserve_cpu::DecoderStack::add_layer)
      .def("num_layers", &kvserve_cpu::DecoderStack::num_layers)
      .def("set_final_norm", &kvserve_cpu::DecoderStack::set_final_norm)
      .def("set_kv_caches", &kvserve_cpu::DecoderStack::set_kv_caches)
      .def("set_kv_groups", &kvserve_cpu::DecoderStack::set_kv_groups)
      .def("forward", &kvserve_cpu::DecoderStack::forward);
}
