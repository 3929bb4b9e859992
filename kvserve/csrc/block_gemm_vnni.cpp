// gguf_int8's matmul on AVX-512 VNNI, from a row-interleaved copy of the blocks
// (llama.cpp's AMX/repack buffers do the same kind of thing). AVX2 builds without VNNI
// run the same copy through block_gemm_packed_avx2.cpp. It serves every row count:
// single-stream decode, batched decode and prefill chunks alike. Batches of rows reuse
// each loaded weight vector for up to kRowTile rows of x, which makes the integer path
// 2-6x faster than the float path's dequantize-and-BLAS at 4-512 rows.
//
// In the plain layout every output row is a dot product of its own: per pair of blocks,
// unpack, multiply-add, convert, scale, and a horizontal sum per row at the end. Here
// 16 rows' blocks are interleaved 4 bytes at a time, so one vpdpbusd multiplies 4 quants
// of each of 16 rows with the same 4 (broadcast) quants of x, and the 16 int32 lanes are
// the 16 rows' partial sums: scales apply as vectors and no horizontal sums remain.
//
// Packed weight: groups of 16 rows (the last one zero-padded); per group and block one
// record of
//   quants   16 rows x 4 bytes per chunk: Q8_0 8 chunks (weights 4c..4c+3), Q4 4 chunks
//            (the file's bytes 4c..4c+3: low nibbles weights 4c.., high nibbles 16+4c..)
//   d        16 x float16
//   m        16 x float16 (Q4_1 only)
//   wsum     16 x int32, 128 * sum of the block's quants (Q8_0 in VNNI builds only:
//            dpbusd takes x as unsigned x + 128, and this takes the excess back out;
//            AVX2's kernel moves the quants' signs to x instead)

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstring>
#include <vector>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define KVSERVE_PACKED_VNNI 1
constexpr bool kPackedVnni = true;
#else
constexpr bool kPackedVnni = false;
#endif
// The copy is made where either kernel runs it.
#if defined(KVSERVE_PACKED_VNNI) || \
    (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
constexpr bool kPacked = true;
#else
constexpr bool kPacked = false;
#endif

#include "block_gemm.h"

namespace kvserve_cpu {
namespace {

constexpr int64_t kGroup = kPackedGroup;

struct PackedLayout {
  int64_t quant_bytes, record;
  explicit PackedLayout(int64_t kind) {
    quant_bytes = kGroup * block_bytes_of(kind);
    record = quant_bytes + 2 * kGroup + (kind == 1 ? 2 * kGroup : 0) +
             (kind == 0 && kPackedVnni ? 4 * kGroup : 0);
  }
};

#ifdef KVSERVE_PACKED_VNNI
inline __m512i broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// acc[r] (16 output rows as lanes) += the group's blocks times R rows of x. The integer
// sums are exact, so a row's result is the same whatever R and the chain count are: an
// output row does not depend on which other rows share its matmul.
template <int KIND, int R>
void group_dot(const uint8_t* group, int64_t nb, const PackedLayout& L, const int8_t* xq,
               const uint8_t* xu, const float* xd, const float* xs, int64_t K, __m512 acc[R]) {
  // With 1-3 rows, two chains per row: a block's 8 multiply-adds would otherwise wait on
  // each other's latency. More rows are independent chains already.
  constexpr int C = R < 4 ? 2 : 1;
  const __m512i nibble = _mm512_set1_epi8(15);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = group + b * L.record;
    const __m512 dv = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + L.quant_bytes)));
    __m512i sum[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) sum[c][r] = _mm512_setzero_si512();
    if constexpr (KIND == 0) {
      for (int c = 0; c < 8; ++c) {
        const __m512i w = _mm512_loadu_si512(rec + c * 64);
        for (int r = 0; r < R; ++r) {
          const __m512i x4 = broadcast4(xu + r * K + b * kBlock + 4 * c);
          sum[c % C][r] = _mm512_dpbusd_epi32(sum[c % C][r], x4, w);
        }
      }
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(rec + c * 64);
        const __m512i lo = _mm512_and_si512(v, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        for (int r = 0; r < R; ++r) {
          const int8_t* xb = xq + r * K + b * kBlock;
          sum[0][r] = _mm512_dpbusd_epi32(sum[0][r], lo, broadcast4(xb + 4 * c));
          sum[C - 1][r] = _mm512_dpbusd_epi32(sum[C - 1][r], hi, broadcast4(xb + 16 + 4 * c));
        }
      }
    }
    const __m512i wsum = KIND == 0 ? _mm512_loadu_si512(rec + L.quant_bytes + 2 * kGroup)
                                   : _mm512_setzero_si512();
    for (int r = 0; r < R; ++r) {
      __m512i total = C == 2 ? _mm512_add_epi32(sum[0][r], sum[C - 1][r]) : sum[0][r];
      if constexpr (KIND == 0) total = _mm512_sub_epi32(total, wsum);
      const __m512 dot = _mm512_cvtepi32_ps(total);
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(xd[r * nb + b])), acc[r]);
      if constexpr (KIND == 1) {
        // sum (d q + m) x = d (q . x) + m sum(x), sum(x) = xs (already times x's scale).
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(rec + L.quant_bytes + 2 * kGroup)));
        acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * nb + b]), acc[r]);
      } else if constexpr (KIND == 2) {
        // Quants were taken unsigned: d (q - 8) . x = d (q . x) - 8 d sum(x).
        acc[r] = _mm512_fmadd_ps(dv, _mm512_set1_ps(-8.f * xs[r * nb + b]), acc[r]);
      }
    }
  }
}

// Rows of x per pass over a group: enough independent chains to keep vpdpbusd busy, few
// enough that the accumulators stay in registers.
constexpr int64_t kRowTile = 8;

// out[r0:r0+R, group g] for R rows of x starting at r0.
template <int KIND, int R>
void group_tile(const uint8_t* packed, const PackedLayout& L, int64_t N, int64_t K, int64_t g,
                int64_t r0, const int8_t* xq, const uint8_t* xu, const float* xd,
                const float* xs, float* out) {
  const int64_t nb = K / kBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  group_dot<KIND, R>(packed + g * nb * L.record, nb, L, xq + r0 * K, xu ? xu + r0 * K : nullptr,
                     xd + r0 * nb, xs + r0 * nb, K, acc);
  const int64_t valid = std::min(kGroup, N - g * kGroup);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  for (int r = 0; r < R; ++r)
    _mm512_mask_storeu_ps(out + (r0 + r) * N + g * kGroup, mask, acc[r]);
}

// Groups [g_begin, g_end) of the output for every row of x, on the calling thread.
template <int KIND>
void packed_kind(const uint8_t* packed, const PackedLayout& L, int64_t N, int64_t K,
                 int64_t rows, const int8_t* xq, const uint8_t* xu, const float* xd,
                 const float* xs, float* out, int64_t g_begin, int64_t g_end) {
  // Each group (at most a few KB per block column) stays in L1 while every tile of x
  // rows passes over it.
  for (int64_t g = g_begin; g < g_end; ++g)
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      const auto run = [&](auto fn) { fn(packed, L, N, K, g, r0, xq, xu, xd, xs, out); };
      switch (std::min(kRowTile, rows - r0)) {
        case 1: run(group_tile<KIND, 1>); break;
        case 2: run(group_tile<KIND, 2>); break;
        case 3: run(group_tile<KIND, 3>); break;
        case 4: run(group_tile<KIND, 4>); break;
        case 5: run(group_tile<KIND, 5>); break;
        case 6: run(group_tile<KIND, 6>); break;
        case 7: run(group_tile<KIND, 7>); break;
        default: run(group_tile<KIND, 8>); break;
      }
    }
}
#endif

}  // namespace

at::Tensor pack_blocks_vnni(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                            int64_t kind) {
  TORCH_CHECK(kind >= 0 && kind <= 2, "int8 activations take block kinds 0-2, not ", kind);
  const BlockWeight w = block_weight(qs, d, m, kind);
  if (!kPacked) return at::empty({0}, qs.options().dtype(at::kByte));
  const PackedLayout L(kind);
  const int64_t N = w.rows, bpb = block_bytes_of(kind), nb = w.cols / kBlock;
  const int64_t groups = (N + kGroup - 1) / kGroup;
  at::Tensor packed = at::zeros({groups * nb * L.record}, qs.options().dtype(at::kByte));
  uint8_t* p = packed.data_ptr<uint8_t>();
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* rec = p + (g * nb + b) * L.record;
      for (int64_t i = 0; i < kGroup && g * kGroup + i < N; ++i) {
        const int64_t n = g * kGroup + i;
        const uint8_t* block = w.qs + n * w.row_bytes + b * bpb;
        for (int64_t c = 0; c < bpb / 4; ++c)
          std::memcpy(rec + (c * kGroup + i) * 4, block + 4 * c, 4);
        std::memcpy(rec + L.quant_bytes + 2 * i, w.d + n * nb + b, 2);
        if (kind == 1) std::memcpy(rec + L.quant_bytes + 2 * kGroup + 2 * i, w.m + n * nb + b, 2);
        if (kind == 0 && kPackedVnni) {
          int32_t sum = 0;
          for (int64_t j = 0; j < 32; ++j) sum += static_cast<int8_t>(block[j]);
          const int32_t excess = 128 * sum;
          std::memcpy(rec + L.quant_bytes + 2 * kGroup + 4 * i, &excess, 4);
        }
      }
    }
  return packed;
}

void packed_groups_vnni(const uint8_t* packed, int64_t kind, int64_t N, int64_t K,
                        int64_t rows, const int8_t* xq, const uint8_t* xu, const float* xd,
                        const float* xs, float* out, int64_t g_begin, int64_t g_end) {
#ifdef KVSERVE_PACKED_VNNI
  const PackedLayout L(kind);
  if (kind == 0) packed_kind<0>(packed, L, N, K, rows, xq, xu, xd, xs, out, g_begin, g_end);
  else if (kind == 1) packed_kind<1>(packed, L, N, K, rows, xq, xu, xd, xs, out, g_begin, g_end);
  else packed_kind<2>(packed, L, N, K, rows, xq, xu, xd, xs, out, g_begin, g_end);
#else
  (void)xu;  // AVX2 multiplies Q8_0's quants by signed x
  const PackedLayout L(kind);
  TORCH_CHECK(packed_groups_avx2(packed, kind, L.record, L.quant_bytes, N, K, rows, xq, xd, xs,
                                 out, g_begin, g_end),
              "packed weights need a build with AVX2 (F16C, FMA) or AVX-512 VNNI");
#endif
}

void check_packed_vnni(const at::Tensor& packed, int64_t kind, int64_t N, int64_t K) {
  TORCH_CHECK(kPacked, "packed weights need a build with AVX2 (F16C, FMA) or AVX-512 VNNI");
  TORCH_CHECK(packed.numel() == packed_groups(N) * (K / kBlock) * PackedLayout(kind).record,
              "packed weight does not match a [", N, ", ", K, "] weight of kind ", kind);
}

bool packed_linear_vnni(const at::Tensor& packed, int64_t kind, int64_t N, int64_t K,
                        int64_t rows, const int8_t* xq, const float* xd, const float* xs,
                        float* out) {
  if (!kPacked) return false;
  check_packed_vnni(packed, kind, N, K);
  const uint8_t* p = packed.data_ptr<uint8_t>();
  CacheAligned<uint8_t> xu(kPackedVnni && kind == 0 ? rows * K : 0);
  if (kPackedVnni && kind == 0)  // x as unsigned bytes for vpdpbusd: q + 128
    unsigned_activations(xq, xu.data(), rows * K);
  // Threads split the weight's groups.
  at::parallel_for(0, packed_groups(N), 1, [&](int64_t begin, int64_t end) {
    packed_groups_vnni(p, kind, N, K, rows, xq, xu.data(), xd, xs, out, begin, end);
  });
  return true;
}

void unsigned_activations(const int8_t* xq, uint8_t* xu, int64_t n) {
  for (int64_t i = 0; i < n; ++i) xu[i] = static_cast<uint8_t>(xq[i] + 128);
}

}  // namespace kvserve_cpu

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("pack_blocks_vnni", &kvserve_cpu::pack_blocks_vnni);
}
