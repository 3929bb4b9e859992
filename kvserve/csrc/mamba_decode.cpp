// The Mamba-2 mixer's decode step for R requests, one token each, in one call: the
// causal conv1d (state shift + depthwise conv + SiLU) and the SSM recurrence
// (state = exp(dt A) state + dt x B^T, y = state C + D x), reading each request's state
// from its block of the shared KV pool and writing the new state to its write block,
// in place (the same block, or the next one under prefix caching's align mode).
//
// Why C++: the torch form of this step is ~15 aten ops per layer, several of them over
// the whole state (gather, decay, update, readout, scatter) and each of those a parallel
// region. On a busy machine every region's barrier waits for a descheduled thread, so a
// state of ~70k floats cost 8-13 ms per layer instead of tens of microseconds. Here the
// state is touched once per row, and a step only goes parallel when it has enough heads
// to pay for it. kvserve/model_executor/layers/mamba/mamba_mixer2.py keeps the torch form
// as the reference (and the path for prefill and mixed steps).
//
// The pool: ``pages`` is ``[S, num_blocks, page]`` float32 (state/cache.py's view); a
// state is the flat concatenation of conv ``[K-1, D]`` then ssm ``[H, P, N]`` over the
// S planes of its block, so a run of floats may cross from one plane to the next.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace kvserve_cpu {
namespace {

// One block's state as flat floats spread over the planes of the pool.
struct BlockState {
  float* base;  // pages[0, block, 0]
  int64_t plane_stride;
  int64_t page;

  float* at(int64_t f) const { return base + (f / page) * plane_stride + f % page; }

  void load(int64_t f, int64_t n, float* dst) const {
    while (n > 0) {
      int64_t run = std::min(n, page - f % page);
      std::memcpy(dst, at(f), run * sizeof(float));
      dst += run, f += run, n -= run;
    }
  }

  void store(int64_t f, int64_t n, const float* src) const {
    while (n > 0) {
      int64_t run = std::min(n, page - f % page);
      std::memcpy(at(f), src, run * sizeof(float));
      src += run, f += run, n -= run;
    }
  }
};

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// torch.nn.functional.softplus (beta 1, threshold 20).
inline float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }

}  // namespace

// y [R, H*P] (out): SSM output plus the D skip, before the gated norm.
// xbc [R, D] and dt [R, H]: the in_proj slices (rows may be strided, channels not).
void mamba_decode_step(at::Tensor& y, const at::Tensor& xbc, const at::Tensor& dt,
                       at::Tensor& pages, const at::Tensor& read_blocks,
                       const at::Tensor& write_blocks, const at::Tensor& has_initial_state,
                       const at::Tensor& conv_weight, const std::optional<at::Tensor>& conv_bias,
                       const at::Tensor& dt_bias, const at::Tensor& A, const at::Tensor& D,
                       double dt_min, double dt_max, int64_t n_groups, int64_t state_size) {
  TORCH_CHECK(pages.dim() == 3 && pages.scalar_type() == at::kFloat && pages.stride(2) == 1,
              "mamba_decode_step: pages must be a [S, num_blocks, page] float32 view");
  TORCH_CHECK(xbc.stride(1) == 1 && dt.stride(1) == 1 && y.is_contiguous(),
              "mamba_decode_step: channels must be contiguous");
  TORCH_CHECK(read_blocks.scalar_type() == at::kLong && write_blocks.scalar_type() == at::kLong &&
                  has_initial_state.scalar_type() == at::kBool && read_blocks.is_contiguous() &&
                  write_blocks.is_contiguous() && has_initial_state.is_contiguous(),
              "mamba_decode_step: block ids must be contiguous int64, flags contiguous bool");
  const int64_t R = xbc.size(0), Dc = xbc.size(1), H = dt.size(1);
  const int64_t K = conv_weight.size(1), N = state_size, G = n_groups;
  const int64_t I = Dc - 2 * G * N, P = I / H;
  TORCH_CHECK(y.size(0) == R && y.size(1) == I && conv_weight.is_contiguous(),
              "mamba_decode_step: shapes");
  const int64_t conv_numel = (K - 1) * Dc;
  const int64_t ssm_numel = H * P * N;
  const int64_t page = pages.size(2), plane_stride = pages.stride(0);
  TORCH_CHECK(conv_numel + ssm_numel <= page * pages.size(0),
              "mamba_decode_step: the state does not fit a block");
  const int64_t* reads = read_blocks.data_ptr<int64_t>();
  const int64_t* writes = write_blocks.data_ptr<int64_t>();
  const bool* initial = has_initial_state.data_ptr<bool>();
  const float* w = conv_weight.data_ptr<float>();
  const float* cb = conv_bias ? conv_bias->data_ptr<float>() : nullptr;
  const float* dtb = dt_bias.data_ptr<float>();
  const float* a = A.data_ptr<float>();
  const float* d = D.data_ptr<float>();
  float* pool = pages.data_ptr<float>();
  auto block = [&](int64_t id) { return BlockState{pool + id * pages.stride(1), plane_stride, page}; };

  // The conv for every row first (small: R x D x K), into activated inputs [R, D].
  std::vector<float> act(R * Dc);
  std::vector<float> state(conv_numel);
  for (int64_t r = 0; r < R; ++r) {
    const float* in = xbc.data_ptr<float>() + r * xbc.stride(0);
    if (initial[r]) {
      block(reads[r]).load(0, conv_numel, state.data());
    } else {
      std::fill(state.begin(), state.end(), 0.0f);
    }
    float* out = act.data() + r * Dc;
    for (int64_t c = 0; c < Dc; ++c) {
      // The same order of terms as the torch reference's sum over the window.
      float acc = 0.0f;
      for (int64_t k = 0; k < K - 1; ++k) acc += state[k * Dc + c] * w[c * K + k];
      acc += in[c] * w[c * K + K - 1];
      if (cb) acc += cb[c];
      out[c] = silu(acc);
    }
    // Shift the window: the state after this token is its last K-1 inputs.
    for (int64_t k = 0; k + 1 < K - 1; ++k)
      std::memcpy(&state[k * Dc], &state[(k + 1) * Dc], Dc * sizeof(float));
    std::memcpy(&state[(K - 2) * Dc], in, Dc * sizeof(float));
    block(writes[r]).store(0, conv_numel, state.data());
  }

  // The recurrence per (row, head): its [P, N] state read, updated and written once.
  // Serial below ~256k state floats: a parallel region costs more than it saves there,
  // and much more when other processes hold the cores.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (P * N));
  const int64_t heads_per_group = H / G;
  at::parallel_for(0, R * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(N);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / H, h = i % H, g = h / heads_per_group;
      const float* x = act.data() + r * Dc + h * P;
      const float* B = act.data() + r * Dc + I + g * N;
      const float* C = act.data() + r * Dc + I + G * N + g * N;
      float step = softplus(dt.data_ptr<float>()[r * dt.stride(0) + h] + dtb[h]);
      step = std::min(std::max(step, static_cast<float>(dt_min)), static_cast<float>(dt_max));
      const float decay = std::exp(step * a[h]);
      const BlockState src = block(reads[r]), dst = block(writes[r]);
      float* out = y.data_ptr<float>() + r * I + h * P;
      for (int64_t p = 0; p < P; ++p) {
        const int64_t f = conv_numel + (h * P + p) * N;
        if (initial[r]) {
          src.load(f, N, row.data());
        } else {
          std::fill(row.begin(), row.end(), 0.0f);
        }
        const float u = step * x[p];
        float acc = 0.0f;
        for (int64_t n = 0; n < N; ++n) {
          row[n] = row[n] * decay + u * B[n];
          acc += row[n] * C[n];
        }
        dst.store(f, N, row.data());
        out[p] = acc + d[h] * x[p];
      }
    }
  });
}

}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "mamba_decode_step(Tensor(a!) y, Tensor xbc, Tensor dt, Tensor(b!) pages, "
      "Tensor read_blocks, Tensor write_blocks, Tensor has_initial_state, Tensor conv_weight, "
      "Tensor? conv_bias, Tensor dt_bias, Tensor A, Tensor D, float dt_min, float dt_max, "
      "int n_groups, int state_size) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("mamba_decode_step", &kvserve_cpu::mamba_decode_step); }
