// GGUF block weights: dequantization and the float block matmul behind --quantization
// (gguf_int8's integer paths: block_gemm_int8.cpp, block_gemm_vnni.cpp). Registered with
// the other torch.ops.kvserve kernels (schemas in cpu_ops.cpp).

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <memory>
#include <vector>

#include "block_gemm.h"

// Fortran BLAS sgemm (LP64), which torch's MKL exports; ATen's own cpublas::gemm is not.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

namespace kvserve_cpu {

BlockWeight block_weight(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                         int64_t kind) {
  TORCH_CHECK(kind >= 0 && kind < kNumKinds, "unknown block kind ", kind);
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous() && qs.dim() == 2, "qs must be contiguous 2-D");
  const at::ScalarType scale_type = float32_scales(kind) ? at::kFloat : at::kHalf;
  TORCH_CHECK(d.scalar_type() == scale_type, "block scales d must be ",
              float32_scales(kind) ? "float32" : "float16", " for kind ", kind);
  const int64_t rows = qs.size(0);
  TORCH_CHECK(qs.size(1) % block_bytes_of(kind) == 0 || kind != 12,
              "5-bit blocks take 20 bytes a row and block");
  TORCH_CHECK(qs.size(1) % block_bytes_of(kind) == 0 || kind != 15,
              "6-bit blocks take 24 bytes a row and block");
  const int64_t cols = weight_cols(kind, qs.size(1));
  TORCH_CHECK(cols % kBlock == 0, "columns must be a multiple of 32");
  TORCH_CHECK(!nibble_planes(kind) || cols % (2 * kBlock) == 0,
              "nibble planes take rows of a multiple of 64 weights");
  TORCH_CHECK(!interleaved(kind) || rows % kInterleavedRows == 0,
              "interleaved blocks take a multiple of ", kInterleavedRows, " rows");
  if (compact_scales(kind)) {
    TORCH_CHECK(cols % kSuperBlock == 0, "kind ", kind, " takes whole super-blocks of ",
                kSuperBlock, " weights");
    TORCH_CHECK(d.numel() == rows * cols / kSuperBlock * (kind == 13 ? 2 : 1),
                "one float16 field set per super-block expected");
    TORCH_CHECK(m.scalar_type() == (kind == 13 ? at::kByte : at::kChar),
                "sub-block scales m must be ", kind == 13 ? "uint8" : "int8", " for kind ", kind);
    TORCH_CHECK(m.is_contiguous() && m.numel() == rows * cols / kBlock * 2,
                "two sub-block fields per block expected");
    BlockWeight w{kind, rows, cols, qs.size(1), static_cast<const uint8_t*>(qs.data_ptr()),
                  static_cast<const uint16_t*>(d.data_ptr()), nullptr};
    w.sub = static_cast<const uint8_t*>(m.data_ptr());
    return w;
  }
  TORCH_CHECK(d.numel() == rows * cols / kBlock * scales_per_block(kind),
              scales_per_block(kind), " scale(s) per block expected");
  const uint16_t* m_ptr = nullptr;
  if (base_kind(kind) == 1) {
    TORCH_CHECK(m.scalar_type() == at::kHalf, "block minimums m must be float16");
    TORCH_CHECK(m.is_contiguous() && m.numel() == d.numel(), "one minimum per block expected");
    m_ptr = static_cast<const uint16_t*>(m.data_ptr());
  }
  if (base_kind(kind) == 3) {
    TORCH_CHECK(m.scalar_type() == at::kFloat, "block minimums m must be float32 for kind ", kind);
    TORCH_CHECK(m.is_contiguous() && m.numel() == d.numel(), "one minimum per block expected");
    BlockWeight w{kind, rows, cols, qs.size(1), static_cast<const uint8_t*>(qs.data_ptr()),
                  nullptr, nullptr};
    w.d32 = d.data_ptr<float>();
    w.m32 = m.data_ptr<float>();
    return w;
  }
  if (base_kind(kind) == 4) {
    BlockWeight w{kind, rows, cols, qs.size(1), static_cast<const uint8_t*>(qs.data_ptr()),
                  nullptr, nullptr};
    w.d32 = d.data_ptr<float>();
    return w;
  }
  return {kind, rows, cols, qs.size(1), static_cast<const uint8_t*>(qs.data_ptr()),
          static_cast<const uint16_t*>(d.data_ptr()), m_ptr};
}

at::Tensor dequantize_blocks(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                             int64_t kind) {
  const BlockWeight w = block_weight(qs, d, m, kind);
  at::Tensor out = at::empty({w.rows, w.cols}, d.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, w.rows, 64, [&](int64_t begin, int64_t end) {
    w.dequant_rows(begin, end, o + begin * w.cols);
  });
  return out;
}

// Rows ``ids`` of the weight as float32 [ids..., cols], each exactly as dequantize_blocks
// gives it: a tied LM head's blocks serve the embedding lookups, so no float32 table is
// kept beside them. Rows are spread over threads from 16 on: a 1-2k-token prompt's lookup
// is as much arithmetic as a small layer's matmul, a decode step's a few hundred ns.
at::Tensor dequantize_rows(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                           int64_t kind, const at::Tensor& ids_in) {
  const BlockWeight w = block_weight(qs, d, m, kind);
  TORCH_CHECK(!ids_in.is_floating_point() && !ids_in.is_complex(), "ids must be integers");
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  // An IndexError in Python, as F.embedding's for the same id.
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_INDEX(id[i] >= 0 && id[i] < w.rows, "row ", id[i], " out of range for ",
                      w.rows, " rows");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(w.cols);
  at::Tensor out = at::empty(shape, d.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) w.dequant_rows(id[i], id[i] + 1, o + i * w.cols);
  });
  return out;
}

// y = x @ W^T for x [M, K] float32 and W in blocks [N, K]. Weights cross the memory bus
// as 4-8 bits per value on every path; decode-sized inputs never materialize them.
//   < kDenseRows rows (64; AVX2: 128): the GEMV over cache-sized tiles of W, 6-16 rows
//     of x at a time.
//   >= kDenseRows: all of W dequantized, then the float32 engine's own GEMM (dense_linear,
//     so the two paths agree bit for bit); an LM head too large for that takes
//     dequantized tiles into single-threaded BLAS instead.
// MKL's sgemm runs a third of its rate below 64 rows of x (Intel Xeon Ice Lake, the
// layers' shapes, 2 threads: 22-38 GFLOP/s for 16-32 rows as dequantized tiles, 58-67 for
// 32-48 rows on all of W, 135-140 from 64), while the GEMV holds 60-78 GFLOP/s at any
// number of rows; decode batches of 16-63 requests were 2-3x slower on BLAS.
constexpr int64_t kTileRows = 64;
#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2's GEMV (6 rows a pass) stays ahead of dequantizing W for MKL's GEMM until ~110
// rows on one thread, and further on two: AMD EPYC Zen 3, SmolLM2's four layer shapes x
// 30 layers, the two paths interleaved in one process (load average 5), dequantize + GEMM
// over GEMV 1.70x at 48 rows, 1.36x at 64, 1.10x at 96, 0.98x at 112, 0.88x at 128 (one
// thread, CPU time); 2.3x at 64, 1.7x at 112, 1.4x at 128 (two threads, wall). Prompts
// up to 127 tokens keep the GEMV, whose rows never depend on their neighbours.
constexpr int64_t kDenseRows = 128;
#else
constexpr int64_t kDenseRows = 64;
#endif
// The digit matmul (block_gemm_exact.cpp) stays ahead of dequantizing W for the GEMM to
// twice kDenseRows: AMD EPYC Zen 4, two threads, SmolLM2's gate/up, down and q/k/v and a
// 1B model's gate/up, ms a call (best of 3) digit / dense: 64 rows 1.75 / 4.20, 0.94 /
// 1.93, 0.57 / 0.70, 23.9 / 33.7; 128 rows 3.63 / 5.95, 1.83 / 2.67, 1.10 / 1.04, 49.0 /
// 51.0; 256 rows 7.26 / 5.17, 3.69 / 3.31, 2.40 / 2.32, 93.9 / 101.1.
// AVX2's digit matmul, which takes x a row at a time, falls behind at the float GEMV's
// own crossover: one thread, AMD EPYC Zen 5 running the haswell build, Q4_1, ms CPU time a
// call digit / dense: SmolLM2's 1536x576 at 64 rows 2.49 / 1.65, 128 rows 4.41 / 2.92; a
// 1B model's 2048x8192 at 64 rows 65 / 87, 128 rows 115 / 110.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
constexpr int64_t kDigitDenseRows = 256;
#else
constexpr int64_t kDigitDenseRows = kDenseRows;
#endif
constexpr int64_t kBlasTileRows = 128;
constexpr int64_t kOneDnnRows = 256;  // dense_linear: oneDNN from here on
constexpr int64_t kDequantGemmMaxWeights = 16 << 20;  // layers, not a 100 MB LM head

// Row-major out[M, ldc] (columns n0.. of it) = x[M, K] @ w[nw, K]^T, via column-major BLAS:
// C^T[nw, M] = w (a K x nw matrix, transposed) @ x^T (K x M).
void sgemm_nt(int64_t nw, int64_t rows_x, int64_t K, const float* w, const float* x, float* out,
              int64_t ldc) {
  const int m = static_cast<int>(nw), n = static_cast<int>(rows_x), k = static_cast<int>(K);
  const int ld = static_cast<int>(ldc);
  const float one = 1.f, zero = 0.f;
  sgemm_("T", "N", &m, &n, &k, &one, w, &k, x, &k, &zero, out, &ld);
}

// From kOneDnnRows rows on, oneDNN's matmul (torch's mkldnn::_linear_pointwise,
// taking w in its plain layout) where torch has it; shorter inputs, and torch builds
// without oneDNN, at::linear (MKL). On an AMD EPYC (Zen 4) oneDNN's AVX-512 kernels
// multiply the layers' shapes at 1.2-1.4x MKL's rate from 256 rows on (one thread), and a
// workload of long prompts ran 1.17x faster end to end, same tokens.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w) {
  check_float(x, "x");
  check_float(w, "w");
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "x has ", x.size(-1),
              " features, w's shape is ", w.sizes());
  static const std::optional<c10::OperatorHandle> onednn =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  const int64_t rows = x.size(-1) == 0 ? 0 : x.numel() / x.size(-1);
  if (!onednn.has_value() || rows < kOneDnnRows) return at::linear(x, w);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = w.size(0);
  torch::jit::Stack stack{x.reshape({-1, x.size(-1)}).contiguous(),
                          w.contiguous(),
                          c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue()};
  onednn->callBoxed(&stack);
  return stack.back().toTensor().view(out_shape);
}

std::pair<at::Tensor, at::Tensor> linear_operands(const at::Tensor& x_in, const BlockWeight& w) {
  check_float(x_in, "x");
  TORCH_CHECK(x_in.size(-1) == w.cols, "x has ", x_in.size(-1), " features, weight ", w.cols);
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = w.rows;
  return {x_in.reshape({-1, w.cols}).contiguous(), at::empty(out_shape, x_in.options())};
}

at::Tensor block_linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                        const at::Tensor& m, int64_t kind) {
  const BlockWeight w = block_weight(qs, d, m, kind);
  const auto [x, out] = linear_operands(x_in, w);
  const int64_t rows_x = x.size(0), N = w.rows, K = w.cols, nb = K / kBlock;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (rows_x == 0) return out;

  if (rows_x < kDigitDenseRows && exact_packed_kind(kind)) {
    linear_exact(w, xp, rows_x, op);
    return out;
  }
  if (rows_x < kDenseRows) {
    // Tiles of W small enough to stay in cache while every group of x rows passes over
    // them; the quants are converted once per group, not once per row.
    GemvInput input;
    input.prepare(w, xp, rows_x);
    const int64_t num_tiles = (N + kTileRows - 1) / kTileRows, pass_rows = w.gemv_pass_rows();
    at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
      const int64_t n_begin = begin * kTileRows, n_end = std::min(N, end * kTileRows);
      for (int64_t n0 = n_begin; n0 < n_end; n0 += kTileRows) {
        const int64_t n1 = std::min(n_end, n0 + kTileRows);
        for (int64_t r0 = 0; r0 < rows_x; r0 += pass_rows) {
          w.gemv(std::min(pass_rows, rows_x - r0), input.rows_from(r0), op + r0 * N, n0, n1);
        }
      }
    });
    return out;
  }

  if (N * K <= kDequantGemmMaxWeights) {
    // All of W dequantized into this thread's reused buffer (at most 64 MB), then a
    // multi-threaded GEMM on it (dense_linear). Dequantizing is one pass over W, against
    // 128+ FLOPs per weight in the GEMM at this many rows, and the GEMM on whole W ran
    // 1.4-1.5x the rate of the tiles below at 96-160 rows (Ice Lake, as above).
    thread_local at::Tensor scratch;
    if (!scratch.defined() || scratch.numel() < N * K)
      scratch = at::empty({N * K}, x.options());
    at::Tensor dense = scratch.narrow(0, 0, N * K).view({N, K});
    float* dp = dense.data_ptr<float>();
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      w.dequant_rows(begin, end, dp + begin * K);
    });
    return dense_linear(x_in, dense);
  }

  // A weight too large to dequantize whole (an LM head): each thread dequantizes a tile
  // of W into a cache-sized float32 buffer and multiplies it with single-threaded BLAS,
  // so W is still read once, in its quantized form.
  const int64_t num_tiles = (N + kBlasTileRows - 1) / kBlasTileRows;
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    // Uninitialized: every element is written by dequant_rows before BLAS reads it.
    std::unique_ptr<float[]> tile(new float[kBlasTileRows * K]);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kBlasTileRows, nt = std::min(kBlasTileRows, N - n0);
      w.dequant_rows(n0, n0 + nt, tile.get());
      sgemm_nt(nt, rows_x, K, tile.get(), xp, op + n0, N);
    }
  });
  return out;
}

// A Q4_1 or Q4_0 weight's quants (kind 1 or 2) in nibble planes (kind 5 or 6), same shape.
at::Tensor nibble_planes_of(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                            int64_t kind) {
  TORCH_CHECK(kind == 1 || kind == 2, "nibble planes take block kinds 1-2, not ", kind);
  const BlockWeight w = block_weight(qs, d, m, kind);
  TORCH_CHECK(w.cols % (2 * kBlock) == 0, "nibble planes take rows of a multiple of 64 weights");
  at::Tensor out = at::empty(qs.sizes(), qs.options());
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, w.rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t off = 0; off < w.row_bytes; off += 32) {
        const uint8_t* pair = w.qs + n * w.row_bytes + off;
        plain_to_planes(pair, pair + 16, o + n * w.row_bytes + off);
      }
  });
  return out;
}

// Rows of x from which block_linear dequantizes W for the dense GEMM (below: the GEMV,
// each row's result independent of the others).
int64_t block_linear_dense_rows() { return kDenseRows; }

// Whether this build's float GEMV runs nibble planes faster than the plain 4-bit layout
// (AVX2 without AVX-512, whose wider conversions already halve the unpacking).
bool gemv_prefers_nibble_planes() {
#if defined(__AVX2__) && !defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// On AVX2 the exact float GEMV is bound by its arithmetic (~2x the integer GEMV's
// instructions per weight: Gemma 3's Q8_0 head 7.4 ms against 4.7 on one thread, AMD EPYC
// Zen 5 running the haswell build); with AVX-512 both read the weights at the memory's
// rate on two threads (3.7-4.2 ms each), and the integer one is the slower on one.
bool integer_gemv_is_cheaper() {
#if defined(__AVX2__) && !defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace kvserve_cpu

// No tensor to dispatch on: a catch-all kernel.
TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("gemv_prefers_nibble_planes() -> bool", &kvserve_cpu::gemv_prefers_nibble_planes);
  m.def("integer_gemv_is_cheaper() -> bool", &kvserve_cpu::integer_gemv_is_cheaper);
  m.def("block_linear_dense_rows() -> int", &kvserve_cpu::block_linear_dense_rows);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("dequantize_blocks", &kvserve_cpu::dequantize_blocks);
  m.impl("dequantize_rows", &kvserve_cpu::dequantize_rows);
  m.impl("block_linear", &kvserve_cpu::block_linear);
  m.impl("dense_linear", &kvserve_cpu::dense_linear);
  m.impl("nibble_planes", &kvserve_cpu::nibble_planes_of);
}
