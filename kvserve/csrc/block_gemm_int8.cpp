// gguf_int8's matmul in the plain block layout: x quantized to int8 per block and
// integer dot products (1-3 rows), or the exact float path (4+ rows), unless the
// row-interleaved copy of block_gemm_vnni.cpp serves the call (AVX2 and AVX-512 VNNI
// builds make one). Registered with the other
// torch.ops.kvserve kernels (schemas in cpu_ops.cpp).

#include <torch/library.h>

#include <vector>

#include "block_gemm.h"

namespace kvserve_cpu {

// ---- int8 activations (--quantization gguf_int8) ------------------------------------
// llama.cpp's CPU arithmetic: each row of x is quantized per 32-value block to int8 with
// a float32 scale (its Q8_1: dx = max|x| / 127, q = round(x / dx), s = dx * sum(q) for
// Q4_1's minimum), and a block's dot product runs in 8-bit integer SIMD, 32
// multiply-adds per instruction instead of float32's 8. The quantized activations cost
// accuracy, which is why this is a separate method from the lossless float path.
void quantize_block_q8(const float* x, int8_t* q, float& d, float& s) {
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  d = amax / 127.f;
  const float id = amax > 0.f ? 127.f / amax : 0.f;
#ifdef __AVX2__
  const __m256 idv = _mm256_set1_ps(id);
  __m256i v[4];
  for (int i = 0; i < 4; ++i)
    v[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), idv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
  // packs interleaves the two 128-bit lanes; the permutation restores element order.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sum);
  int32_t total = 0;
  for (int i = 0; i < 8; ++i) total += lanes[i];
#else
  int32_t total = 0;
  for (int i = 0; i < kBlock; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(x[i] * id));
    total += q[i];
  }
#endif
  s = d * static_cast<float>(total);
}

// A block's 32 int8 quants in nibble-plane order (block_quants.h): byte 4j + b holds
// weight 8b + j, as the unpacked nibbles of a pair's block do.
inline void to_plane_order(int8_t* q) {
  int8_t weight_order[kBlock];
  std::memcpy(weight_order, q, kBlock);
  for (int j = 0; j < 8; ++j)
    for (int b = 0; b < 4; ++b) q[4 * j + b] = weight_order[8 * b + j];
}

struct Int8Rows {
  int64_t rows, cols, nb;
  CacheAligned<int8_t> q;  // [rows, cols]
  std::vector<float> d;   // [rows, nb]
  std::vector<float> s;   // [rows, nb]: d * sum of the block's quants

  // plane_order: each block's quants in nibble-plane order (AVX2 builds, kinds 5-6).
  Int8Rows(const float* x, int64_t rows_, int64_t cols_, bool plane_order = false)
      : rows(rows_), cols(cols_), nb(cols_ / kBlock), q(rows_ * cols_), d(rows_ * nb),
        s(rows_ * nb) {
    at::parallel_for(0, rows * nb, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        quantize_block_q8(x + i * kBlock, q.data() + i * kBlock, d[i], s[i]);
        if (plane_order) to_plane_order(q.data() + i * kBlock);
      }
    });
  }
};

#ifdef __AVX2__
// A block's 32 quants as 32 bytes in weight order: unsigned 0..15 for Q4_1, signed for
// Q8_0 and Q4_0 (q - 8).
template <int KIND>
inline __m256i load_quants_i8(const uint8_t* qs) {
  if constexpr (KIND == 0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
    const __m256i q = _mm256_and_si256(both, _mm256_set1_epi8(15));
    return KIND == 2 ? _mm256_sub_epi8(q, _mm256_set1_epi8(8)) : q;
  }
}

// Nibble planes (kinds 5-6): a pair's two blocks' quants in plane order from one load,
// one AND for block A, a shift and an AND for B.
template <int KIND>
inline void load_pair_i8(const uint8_t* pair, __m256i& a, __m256i& b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
  const __m256i nibble = _mm256_set1_epi8(15);
  a = _mm256_and_si256(v, nibble);
  b = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
  if constexpr (KIND == 6) {
    a = _mm256_sub_epi8(a, _mm256_set1_epi8(8));
    b = _mm256_sub_epi8(b, _mm256_set1_epi8(8));
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define KVSERVE_VNNI512 1
// Two consecutive blocks' 64 quants as bytes in weight order (block b's 32, then b + 1's).
template <int KIND>
inline __m512i load_quants_i8x2(const uint8_t* qs) {
  if constexpr (KIND == 0) {
    return _mm512_loadu_si512(qs);
  } else {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    // 128-bit lanes (b's bytes, b+1's bytes, b's high nibbles, b+1's high nibbles),
    // reordered to b low, b high, b+1 low, b+1 high.
    const __m512i both =
        _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1);
    const __m512i q = _mm512_and_si512(_mm512_shuffle_i64x2(both, both, 0xD8), _mm512_set1_epi8(15));
    return KIND == 2 ? _mm512_sub_epi8(q, _mm512_set1_epi8(8)) : q;
  }
}
#endif

// Q4_1's sum over blocks of m * s. A short reduction paid once per output, so it must
// not be a chain of dependent scalar adds (hsum is a tree).
inline float min_term(const uint16_t* m, const float* s, int64_t nb) {
#if defined(__AVX2__) && defined(__F16C__)
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + b)));
    acc = _mm256_fmadd_ps(mv, _mm256_loadu_ps(s + b), acc);
  }
  float total = hsum(acc);
#else
  float total = 0.f;
  int64_t b = 0;
#endif
  for (; b < nb; ++b) total += f16(m[b]) * s[b];
  return total;
}

// scales: room for R * (cols / 32) floats, per-call scratch.
template <int KIND, int R>
void gemv_int8_t(const BlockWeight& w, const Int8Rows& xq, int64_t r0, float* __restrict out,
                 int64_t begin, int64_t end, float* __restrict scales) {
  constexpr bool kUnsigned = base_kind(KIND) == 1;  // Q4_1's quants: 0..15, no sign
  const int64_t nb = w.cols / kBlock, bb = block_bytes_of(KIND), K = w.cols, N = w.rows;
  const int8_t* xqs = xq.q.data() + r0 * K;
  const float* xd = xq.d.data() + r0 * nb;
  for (int64_t n = begin; n < end; ++n) {
    const uint16_t* dn = w.d + n * nb;
    w.prefetch_row(n + kPrefetchRows);
    float result[R];
#ifdef __AVX2__
    // The combined scales d_w * d_x, 8 blocks per vector operation: a scalar float16
    // conversion and multiply per block and row were a third of the AVX2 loop's work.
    for (int r = 0; r < R; ++r) {
      int64_t i = 0;
      for (; i + 8 <= nb; i += 8)
        _mm256_storeu_ps(scales + r * nb + i,
                         _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(
                                           reinterpret_cast<const __m128i*>(dn + i))),
                                       _mm256_loadu_ps(xd + r * nb + i)));
      for (; i < nb; ++i) scales[r * nb + i] = f16(dn[i]) * xd[r * nb + i];
    }
    const __m256i ones = _mm256_set1_epi16(1);
    // Block b's products with R rows into acc. The quants stream as the float GEMV's
    // do: kStreamAheadBytes ahead, every 64 bytes of the row (streamed_block).
    const auto quants_dot = [&](int64_t b, __m256i wq, __m256 (&acc)[R]) {
      // maddubs multiplies unsigned by signed bytes: signed weights move their sign to x.
      const __m256i wu = kUnsigned ? wq : _mm256_sign_epi8(wq, wq);
      for (int r = 0; r < R; ++r) {
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xqs + r * K + b * kBlock));
        if constexpr (!kUnsigned) xv = _mm256_sign_epi8(xv, wq);
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(scales + r * nb + b),
                                 acc[r]);
      }
    };
    const auto block_dot = [&](int64_t b, __m256 (&acc)[R]) {
      quants_dot(b, load_quants_i8<base_kind(KIND)>(w.streamed_block(n, b, bb)), acc);
    };
    __m256 even[R];
    for (int r = 0; r < R; ++r) even[r] = _mm256_setzero_ps();
    int64_t b = 0;
#ifdef KVSERVE_VNNI512
    if constexpr (!nibble_planes(KIND)) {
      const uint8_t* row = w.qs + n * w.row_bytes;
      // Two blocks per 512-bit VNNI multiply-add (64 byte products, 4 per int32 lane).
      // Lanes 0-7 take block b's scale, 8-15 block b + 1's.
      const __m512i pair_index =
          _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
      __m512 pair[R];
      for (int r = 0; r < R; ++r) pair[r] = _mm512_setzero_ps();
      for (; b + 2 <= nb; b += 2) {
        const __m512i wq = load_quants_i8x2<KIND>(row + b * bb);
        // dpbusd multiplies unsigned by signed bytes, as maddubs does below.
        const __m512i wu = KIND == 1 ? wq : _mm512_abs_epi8(wq);
        const __mmask64 negative = KIND == 1 ? 0 : _mm512_movepi8_mask(wq);
        for (int r = 0; r < R; ++r) {
          __m512i xv = _mm512_loadu_si512(xqs + r * K + b * kBlock);
          if constexpr (KIND != 1)
            xv = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, xv);
          double two_scales;
          std::memcpy(&two_scales, scales + r * nb + b, sizeof two_scales);
          const __m512 scale =
              _mm512_permutexvar_ps(pair_index, _mm512_castpd_ps(_mm512_set1_pd(two_scales)));
          pair[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, pair[r]);
        }
      }
      if (b < nb) block_dot(b, even);
      for (int r = 0; r < R; ++r) result[r] = _mm512_reduce_add_ps(pair[r]) + hsum(even[r]);
    } else
#endif
    {
      // Even and odd blocks accumulate separately: a single chain of dependent FMAs per
      // row would wait out the FMA latency at every block.
      __m256 odd[R];
      for (int r = 0; r < R; ++r) odd[r] = _mm256_setzero_ps();
      for (; b + 2 <= nb; b += 2) {
        if constexpr (nibble_planes(KIND)) {  // rows are whole pairs
          __m256i qa, qb;
          load_pair_i8<KIND>(w.streamed_block(n, b, bb), qa, qb);
          quants_dot(b, qa, even);
          quants_dot(b + 1, qb, odd);
        } else {
          block_dot(b, even);
          block_dot(b + 1, odd);
        }
      }
      if (b < nb) block_dot(b, even);
      for (int r = 0; r < R; ++r) result[r] = hsum(_mm256_add_ps(even[r], odd[r]));
    }
#else
    (void)scales;
    alignas(32) uint8_t plain[kBlock];
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = w.plain_block<KIND>(n, b, plain);
        const int8_t* xb = xqs + r * K + b * kBlock;
        int32_t dot = 0;
        for (int i = 0; i < kBlock; ++i) {
          int32_t wi;
          if constexpr (KIND == 0) wi = reinterpret_cast<const int8_t*>(block)[i];
          else wi = plain_quant(block, i) - (base_kind(KIND) == 2 ? 8 : 0);
          dot += wi * xb[i];
        }
        acc += f16(dn[b]) * xd[r * nb + b] * static_cast<float>(dot);
      }
      result[r] = acc;
    }
#endif
    for (int r = 0; r < R; ++r) {
      if constexpr (kUnsigned) result[r] += min_term(w.m + n * nb, xq.s.data() + (r0 + r) * nb, nb);
      out[(r0 + r) * N + n] = result[r];
    }
  }
}

template <int KIND>
void gemv_int8_kind(const BlockWeight& w, const Int8Rows& xq, int64_t r0, int64_t rows,
                    float* out, int64_t begin, int64_t end, float* scales) {
  switch (rows) {
    case 1: return gemv_int8_t<KIND, 1>(w, xq, r0, out, begin, end, scales);
    case 2: return gemv_int8_t<KIND, 2>(w, xq, r0, out, begin, end, scales);
    default: return gemv_int8_t<KIND, 3>(w, xq, r0, out, begin, end, scales);
  }
}

constexpr int64_t kInt8GroupRows = 3;
// Without the interleaved copy, past a few rows the float path's weight conversion is
// shared by enough rows that it is as fast as the integer one (per row and block both
// cost about the same instructions), and it is exact, so batches take it. With the copy
// (AVX2, AVX-512 VNNI) every row count takes the integer path: block_gemm_vnni.cpp.
constexpr int64_t kInt8MaxRows = 4;
// Decode matmuls are a few hundred rows: tiles this small split them evenly between
// threads (64-row tiles left one thread 25% more rows on 576-row weights).
constexpr int64_t kInt8TileRows = 16;

at::Tensor block_linear_int8(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                             const at::Tensor& m, int64_t kind,
                             const std::optional<at::Tensor>& packed) {
  // Kind 3 (repacked Q4_K) has no integer path: gguf_int8 keeps it on block_linear.
  TORCH_CHECK((kind >= 0 && kind <= 2) || nibble_planes(kind),
              "int8 activations take block kinds 0-2 and 5-6, not ", kind);
  const BlockWeight w = block_weight(qs, d, m, kind);
  const auto [x, out] = linear_operands(x_in, w);
  const int64_t rows_x = x.size(0), N = w.rows;
  const bool has_packed = packed && packed->numel() > 0;
  if (rows_x >= kInt8MaxRows && !has_packed) return block_linear(x_in, qs, d, m, kind);
  if (rows_x == 0) return out;
#ifdef __AVX2__
  const bool plane_order = nibble_planes(kind);  // as load_quants_i8 unpacks them
#else
  const bool plane_order = false;  // the scalar path reads plain blocks
#endif
  const Int8Rows xq(x.data_ptr<float>(), rows_x, w.cols, plane_order);
  float* op = out.data_ptr<float>();
  if (has_packed && packed_linear_vnni(*packed, kind, N, w.cols, rows_x, xq.q.data(),
                                       xq.d.data(), xq.s.data(), op))
    return out;
  TORCH_CHECK(rows_x < kInt8MaxRows, "a packed weight needs a build with AVX2 or AVX-512 VNNI");
  const int64_t num_tiles = (N + kInt8TileRows - 1) / kInt8TileRows;
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scales(kInt8GroupRows * xq.nb);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kInt8TileRows, n1 = std::min(N, n0 + kInt8TileRows);
      for (int64_t r0 = 0; r0 < rows_x; r0 += kInt8GroupRows) {
        const int64_t rows = std::min(kInt8GroupRows, rows_x - r0);
        if (kind == 0) gemv_int8_kind<0>(w, xq, r0, rows, op, n0, n1, scales.data());
        else if (kind == 1) gemv_int8_kind<1>(w, xq, r0, rows, op, n0, n1, scales.data());
        else if (kind == 2) gemv_int8_kind<2>(w, xq, r0, rows, op, n0, n1, scales.data());
        else if (kind == 5) gemv_int8_kind<5>(w, xq, r0, rows, op, n0, n1, scales.data());
        else gemv_int8_kind<6>(w, xq, r0, rows, op, n0, n1, scales.data());
      }
    }
  });
  return out;
}

}  // namespace kvserve_cpu

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("block_linear_int8", &kvserve_cpu::block_linear_int8);
}
