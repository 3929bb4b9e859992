// A decode step of GGUF block layers (gguf_int8's int8 activations or gguf's lossless
// float ones) inside one OpenMP parallel region.
//
// Through the per-op path (decode_stack.cpp) a single-stream step opens five parallel
// regions per layer, and between them one thread runs the small row operations (norms,
// rotary embedding, quantizing x) while the other waits: on a 2-core VM about a third of
// the step was the second core idling. Here the threads stay in one region for the whole
// stack. Each projection is split between them by groups of output features, attention
// by heads; the row operations are repeated on every thread (each keeps its own copy of
// the residual stream and of the quantized input) rather than run once and waited for.
// Only the q/k norms, the rotary embedding and the KV-cache write, which change shared
// data, run on one thread. Every value is computed by the same functions as the per-op path, in the same
// order, so the step's output is the same bit for bit.

#include <ATen/ops/empty.h>
#include <omp.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "block_gemm.h"
#include "decode_attention.h"
#include "decode_stack.h"

namespace kvserve_cpu {
namespace {

// This thread's share [begin, end) of n items.
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int threads) {
  return {n * tid / threads, n * (tid + 1) / threads};
}

// A projection's part as the step multiplies it: gguf_int8's interleaved copy (int8
// activations) or the lossless gguf blocks (float activations: block_gemm.h's GEMV, or the
// digit matmul for the interleaved kinds), into the output's columns [column, column + N).
struct PartView {
  const uint8_t* packed;  // nullptr: the float block GEMV on `blocks`
  BlockWeight blocks;
  int64_t kind, N, K, column;

  PartView(const ProjectionPart& p, int64_t column)
      : packed(p.packed_int8() ? p.packed->data_ptr<uint8_t>() : nullptr),
        blocks(block_weight(p.weight, p.d, p.m, p.kind)), kind(p.kind), N(p.out_features()),
        K(p.in_features()), column(column) {}
};

struct ProjectionView {
  std::vector<PartView> parts;
  int64_t N;
  const float* bias;  // nullptr: none

  explicit ProjectionView(const Projection& p)
      : N(p.out_features()), bias(p.bias ? p.bias->data_ptr<float>() : nullptr) {
    int64_t column = 0;
    for (const ProjectionPart& part : p.parts) {
      parts.emplace_back(part, column);
      column += part.out_features();
    }
  }
  // The widest part of a projection of several: their outputs that a kernel writes with
  // its own row stride pass through a thread's buffer of this many columns a row.
  int64_t staged_columns() const {
    int64_t n = 0;
    if (parts.size() > 1)
      for (const PartView& part : parts) n = std::max(n, part.N);
    return n;
  }
};

// A thread's copy of what a projection needs of its input: x quantized (int8), in digits
// (ExactInput) or as the float GEMV reads it (GemvInput).
struct ThreadInput {
  CacheAligned<int8_t> q;
  CacheAligned<uint8_t> u;  // Q8_0 weights take x as unsigned bytes
  CacheAligned<float> d, s;
  GemvInput gemv;
  ExactInput exact;  // the interleaved kinds' digits of x
  CacheAligned<float> staged;  // a part's outputs, [rows, its N] (ProjectionView::staged_columns)
  ThreadInput(int64_t rows, int64_t max_k, int64_t staged_columns)
      : q(rows * max_k), u(rows * max_k), d(rows * max_k / kBlock), s(rows * max_k / kBlock),
        staged(rows * staged_columns) {
    gemv.reserve(rows, max_k);
    exact.reserve(rows, max_k);
  }
};

// This thread's features [n0, n1) of a part's out = x W^T, x: [T, K], out's rows ldo apart.
// Prepares all of x (a few hundred values per row: cheaper than a barrier), multiplies its
// own features. The float GEMV takes x 6 rows at a time as block_linear does; a result
// depends only on its own row of x and of W either way.
void part_share(const PartView& w, const float* x, int64_t T, ThreadInput& in, float* out,
                int64_t ldo, int64_t g0, int64_t g1) {
  const int64_t n0 = g0 * kPackedGroup, n1 = std::min(w.N, g1 * kPackedGroup);
  if (exact_packed_kind(w.kind) && w.packed == nullptr) {
    in.exact.prepare(x, T, w.K, w.kind);
    groups_exact(w.blocks, T, in.exact, out, ldo, g0, g1);
    return;
  }
  // The other kernels write rows w.N apart: one row needs no stride, several go through
  // this thread's staging buffer.
  float* dst = (T == 1 || ldo == w.N) ? out : in.staged.data();
  if (w.packed != nullptr) {
    const int64_t blocks = T * w.K / kBlock;
    for (int64_t i = 0; i < blocks; ++i)
      quantize_block_q8(x + i * kBlock, in.q.data() + i * kBlock, in.d[i], in.s[i]);
    if (w.kind == 0) unsigned_activations(in.q.data(), in.u.data(), T * w.K);
    packed_groups_vnni(w.packed, w.kind, w.N, w.K, T, in.q.data(), in.u.data(), in.d.data(),
                       in.s.data(), dst, g0, g1);
  } else if (n0 < n1) {
    in.gemv.prepare(w.blocks, x, T);
    const int64_t pass_rows = w.blocks.gemv_pass_rows();
    for (int64_t r0 = 0; r0 < T; r0 += pass_rows)
      w.blocks.gemv(std::min(pass_rows, T - r0), in.gemv.rows_from(r0), dst + r0 * w.N, n0, n1);
  }
  if (dst != out)
    for (int64_t r = 0; r < T; ++r)
      std::copy(dst + r * w.N + n0, dst + r * w.N + n1, out + r * ldo + n0);
}

// This thread's features of out = x W^T (+ bias), part by part, in groups of 16 (a cache
// line of each output row) split between the threads.
void linear_share(const ProjectionView& w, const float* x, int64_t T, ThreadInput& in,
                  float* out, int tid, int threads) {
  for (const PartView& part : w.parts) {
    const auto [g0, g1] = share(packed_groups(part.N), tid, threads);
    part_share(part, x, T, in, out + part.column, w.N, g0, g1);
    if (w.bias == nullptr) continue;
    const int64_t n0 = part.column + g0 * kPackedGroup;
    const int64_t n1 = part.column + std::min(part.N, g1 * kPackedGroup);
    for (int64_t r = 0; r < T; ++r)
      for (int64_t n = n0; n < n1; ++n) out[r * w.N + n] = out[r * w.N + n] + w.bias[n];
  }
}

const float* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<float>() : nullptr;
}

struct LayerViews {
  ProjectionView qkv, o, gate_up, down;
  const float *input_norm, *post_norm;
  const float *pre_ff_norm, *post_ff_norm;  // null: Llama's scheme
  const float *q_norm, *k_norm;             // null: none
  const float* cos_sin;
  int64_t rot_dim;
  Activation activation;
  DecodeAttentionPlan attention;
  KVWritePlan kv_write;

  bool sandwich() const { return pre_ff_norm != nullptr; }
};

// out = norm(residual += norm(y)), row by row: the sandwich scheme's residual add of a
// sublayer's output (y_norm) and the next norm (w), `tmp` the normed output.
void sandwich_add_norm(const float* y, const float* y_norm, float* residual, const float* w,
                       float* out, float* tmp, int64_t T, int64_t H, float eps) {
  for (int64_t r = 0; r < T; ++r) {
    rms_norm_row(tmp + r * H, y + r * H, y_norm, H, eps);
    add_row(residual + r * H, tmp + r * H, H);
    rms_norm_row(out + r * H, residual + r * H, w, H, eps);
  }
}

}  // namespace

bool fused_step_supports(const std::vector<Layer>& layers, int64_t tokens) {
  if (tokens < 1 || tokens > kFusedStepMaxRows || layers.empty()) return false;
  return std::all_of(layers.begin(), layers.end(), [](const Layer& l) {
    return l.qkv.fused_step_ready() && l.o.fused_step_ready() && l.gate_up.fused_step_ready() &&
           l.down.fused_step_ready() && !l.gate_up.bias && !l.down.bias;
  });
}

std::tuple<at::Tensor, at::Tensor> fused_decode_step(
    const std::vector<Layer>& layers, const StackShape& shape, const at::Tensor& hidden,
    const at::Tensor& positions, const std::vector<at::Tensor>& kv_caches,
    const GroupInputs& groups, const std::optional<FinalNorm>& final_norm) {
  // Everything that can fail is checked here: nothing may throw inside the region.
  const int64_t T = hidden.size(0), H = hidden.size(1);
  const int64_t head_size = shape.head_size;
  const int64_t q_size = shape.num_heads * head_size, kv_size = shape.num_kv_heads * head_size;
  const Layer& first = layers.front();
  const int64_t qkv_n = first.qkv.out_features(), inter = first.gate_up.out_features() / 2;
  for (const Layer& l : layers) {
    TORCH_CHECK(l.qkv.out_features() == qkv_n && qkv_n == q_size + 2 * kv_size &&
                    l.qkv.in_features() == H && l.o.out_features() == H &&
                    l.o.in_features() == q_size && l.gate_up.out_features() == 2 * inter &&
                    l.gate_up.in_features() == H && l.down.out_features() == H &&
                    l.down.in_features() == inter,
                "a layer's projections do not fit the stack's sizes");
  }
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == T,
              "positions must be int64, one per row");
  const at::Tensor pos = positions.contiguous();
  const int64_t* pos_ptr = pos.data_ptr<int64_t>();
  for (const Layer& l : layers) {
    const int64_t max_pos = l.cos_sin_cache.size(0);
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(pos_ptr[t] >= 0 && pos_ptr[t] < max_pos, "position ", pos_ptr[t],
                  " outside the rotary cache of ", max_pos);
  }

  const auto options = hidden.options();
  at::Tensor qkv = at::empty({T, qkv_n}, options), attn = at::empty({T, q_size}, options);
  at::Tensor o = at::empty({T, H}, options), gate_up = at::empty({T, 2 * inter}, options);
  at::Tensor down = at::empty({T, H}, options), residual_out = at::empty({T, H}, options);
  at::Tensor attn_heads = attn.view({T, shape.num_heads, head_size});
  const at::Tensor q_heads = qkv.narrow(1, 0, q_size).view({T, shape.num_heads, head_size});
  const at::Tensor k_heads = qkv.narrow(1, q_size, kv_size).view({T, shape.num_kv_heads, head_size});
  const at::Tensor v_heads =
      qkv.narrow(1, q_size + kv_size, kv_size).view({T, shape.num_kv_heads, head_size});

  const int threads_wanted = static_cast<int>(std::max<int64_t>(1, at::get_num_threads()));
  // One plan per KV cache group, from its first layer; the others take it over.
  std::vector<DecodeAttentionPlan> group_plans;
  std::vector<KVWritePlan> group_writes;
  for (size_t g = 0; g < groups.size(); ++g) {
    size_t i = 0;
    while (i < layers.size() && layers[i].kv_group != static_cast<int64_t>(g)) ++i;
    TORCH_CHECK(i < layers.size(), "KV cache group ", g, " has no layer");
    at::Tensor cache = kv_caches[i];
    group_plans.push_back(plan_decode_attention(
        attn_heads, q_heads, cache, groups.block_tables[g], groups.seq_lens[g],
        groups.token_indices[g], shape.scale, layers[i].sliding_window, threads_wanted));
    group_writes.push_back(plan_kv_write(k_heads, v_heads, cache, groups.slot_mappings[g]));
  }
  std::vector<LayerViews> views;
  views.reserve(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    const Layer& l = layers[i];
    DecodeAttentionPlan attention =
        group_plans[l.kv_group].for_layer(kv_caches[i], l.sliding_window);
    KVWritePlan kv_write = group_writes[l.kv_group];
    kv_write.k_cache = kv_caches[i].data_ptr();  // same shape and type: for_layer checked
    views.push_back({ProjectionView(l.qkv), ProjectionView(l.o), ProjectionView(l.gate_up),
                     ProjectionView(l.down), l.input_norm.data_ptr<float>(),
                     l.post_norm.data_ptr<float>(), data_or_null(l.pre_ff_norm),
                     data_or_null(l.post_ff_norm), data_or_null(l.q_norm),
                     data_or_null(l.k_norm), l.cos_sin_cache.data_ptr<float>(),
                     l.cos_sin_cache.size(1), l.activation, std::move(attention),
                     std::move(kv_write)});
  }

  const float* final_weight = final_norm ? final_norm->weight.data_ptr<float>() : nullptr;
  const float final_eps = final_norm ? static_cast<float>(final_norm->eps) : 0.0f;
  const float eps = static_cast<float>(shape.eps);
  const float* hidden_ptr = hidden.data_ptr<float>();
  float* qkv_ptr = qkv.data_ptr<float>();
  float* o_ptr = o.data_ptr<float>();
  float* gate_up_ptr = gate_up.data_ptr<float>();
  float* down_ptr = down.data_ptr<float>();
  const float* attn_ptr = attn.data_ptr<float>();
  const int64_t max_k = std::max({H, q_size, inter});
  int64_t staged_columns = 0;
  for (const LayerViews& l : views)
    for (const ProjectionView* p : {&l.qkv, &l.o, &l.gate_up, &l.down})
      staged_columns = std::max(staged_columns, p->staged_columns());

#pragma omp parallel num_threads(threads_wanted)
  {
    const int tid = omp_get_thread_num(), threads = omp_get_num_threads();
    CacheAligned<float> residual(T * H), x(T * H), act(T * inter), tmp(T * H);
    std::copy(hidden_ptr, hidden_ptr + T * H, residual.data());
    ThreadInput in(T, max_k, staged_columns);
    for (int64_t r = 0; r < T; ++r)
      rms_norm_row(x.data() + r * H, hidden_ptr + r * H, views[0].input_norm, H, eps);
    for (size_t i = 0; i < views.size(); ++i) {
      const LayerViews& l = views[i];
      if (i > 0 && views[i - 1].sandwich())
        sandwich_add_norm(down_ptr, views[i - 1].post_ff_norm, residual.data(), l.input_norm,
                          x.data(), tmp.data(), T, H, eps);
      else if (i > 0)
        for (int64_t r = 0; r < T; ++r)
          add_rms_norm_row(down_ptr + r * H, residual.data() + r * H, l.input_norm,
                           x.data() + r * H, H, eps);
      linear_share(l.qkv, x.data(), T, in, qkv_ptr, tid, threads);
#pragma omp barrier
      if (tid == 0) {
        for (int64_t t = 0; t < T; ++t) {
          float* row = qkv_ptr + t * qkv_n;
          qk_norm_token(row, shape.num_heads, row + q_size, shape.num_kv_heads, head_size,
                        l.q_norm, l.k_norm, eps);
          rope_token(row, shape.num_heads, row + q_size, shape.num_kv_heads, head_size,
                     l.cos_sin + pos_ptr[t] * l.rot_dim, l.rot_dim / 2);
        }
        l.kv_write.run();
      }
#pragma omp barrier
      const auto [t0, t1] = share(l.attention.num_tasks, tid, threads);
      l.attention.run(t0, t1);
#pragma omp barrier
      linear_share(l.o, attn_ptr, T, in, o_ptr, tid, threads);
#pragma omp barrier
      if (l.sandwich())
        sandwich_add_norm(o_ptr, l.post_norm, residual.data(), l.pre_ff_norm, x.data(),
                          tmp.data(), T, H, eps);
      else
        for (int64_t r = 0; r < T; ++r)
          add_rms_norm_row(o_ptr + r * H, residual.data() + r * H, l.post_norm,
                           x.data() + r * H, H, eps);
      linear_share(l.gate_up, x.data(), T, in, gate_up_ptr, tid, threads);
#pragma omp barrier
      for (int64_t r = 0; r < T; ++r) {
        const float* gate = gate_up_ptr + r * 2 * inter;
        if (l.activation == Activation::kGeluTanh)
          gelu_tanh_mul_row(act.data() + r * inter, gate, gate + inter, inter);
        else
          silu_mul_row(act.data() + r * inter, gate, gate + inter, inter);
      }
      linear_share(l.down, act.data(), T, in, down_ptr, tid, threads);
#pragma omp barrier
    }
    if (tid == 0) {
      const LayerViews& last = views.back();
      if (last.sandwich()) {
        // The last MLP output's residual add, then the model's final norm of the stream
        // (or the stream itself) into `down`, which no thread reads any more.
        for (int64_t r = 0; r < T; ++r) {
          rms_norm_row(tmp.data() + r * H, down_ptr + r * H, last.post_ff_norm, H, eps);
          add_row(residual.data() + r * H, tmp.data() + r * H, H);
          if (final_weight != nullptr)
            rms_norm_row(down_ptr + r * H, residual.data() + r * H, final_weight, H, final_eps);
          else
            std::copy(residual.data() + r * H, residual.data() + (r + 1) * H, down_ptr + r * H);
        }
      } else if (final_weight != nullptr) {
        // The model's final fused add + norm, as its module would run it on (down, residual).
        for (int64_t r = 0; r < T; ++r)
          add_rms_norm_row(down_ptr + r * H, residual.data() + r * H, final_weight,
                           down_ptr + r * H, H, final_eps);
      }
      std::copy(residual.data(), residual.data() + T * H, residual_out.data_ptr<float>());
    }
  }
  return {down, residual_out};
}

}  // namespace kvserve_cpu
