// gguf_int8's matmul on AVX2 CPUs without AVX-512 VNNI, from the same row-interleaved
// copy block_gemm_vnni.cpp makes (its layout is described there): what llama.cpp's
// repacked q4_0_8x8 buffers do for AVX2. One 256-bit load holds 4 quants of each of 8
// output rows; one broadcast of x's 4 matching quants feeds all 8.
//
// In the plain layout (block_gemm_int8.cpp) every row unpacks its own block, multiplies,
// converts and scales it, and ends with a horizontal sum: about 8 instructions per row
// and block. Here a 16-row group's block costs one unpack per 32 bytes and, per row of
// x, vpmaddubsw (unsigned quant x signed x byte -> int16 pairs) per 8 rows and 4 quants,
// one vpmaddwd to int32 per block, and the scale as a vector: the lanes are the rows.
// Q4_1's minimum term is one multiply-add per block from x's precomputed sums.
//
// Q4 quants are 0..15 and x's int8 quants are within +-127 (quantize_block_q8), so a
// pair's sum is at most 2 * 15 * 127 and a block's 8 pairs sum to 30480 < 32767: a block
// adds up in int16 without saturating, and one vpmaddwd per block widens it. Q8_0's
// quants are signed: vpmaddubsw takes |w| and moves w's sign to x (a pair stays within
// 2 * 128 * 127), widened per chunk.
//
// Each float operation is the VNNI kernel's, in its order, and integer sums are exact:
// the two builds give the same results bit for bit.

#include <cstring>

#include "block_gemm.h"

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) && \
    !(defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__))
#define KVSERVE_PACKED_AVX2 1
#endif

namespace kvserve_cpu {
namespace {

#ifdef KVSERVE_PACKED_AVX2
inline __m256i broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The group's d (or m) float16s for rows 8h..8h+7.
inline __m256 halves_f16(const uint8_t* p, int h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + h));
}

// How far ahead of the block being multiplied Q8_0's records are requested (group_dot).
constexpr int64_t kQ8AheadBytes = 16384;

// acc[h][r] (rows 8h..8h+7 of the group as lanes) += the group's blocks times R rows of x.
template <int KIND, int R>
void group_dot(const uint8_t* group, int64_t nb, int64_t record, int64_t quant_bytes,
               const int8_t* xq, const float* xd, const float* xs, int64_t K,
               __m256 (&acc)[2][R]) {
  const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = group + b * record;
    // A group is one contiguous run of records, a single stream the hardware prefetcher
    // keeps up with for Q4 (the plain layout reads 16 rows' streams at once): asking for
    // the record kStreamAheadBytes ahead at every cache line, as the float GEMV does,
    // made single-row GEMVs 5-35% slower (Zen 4, haswell build, one thread: Q4_1
    // 49152x576 0.49 -> 0.56-0.61 ms, Q8_0 16384x2048 1.32 -> 1.67-1.84 ms). Q8_0's
    // LM heads at 1-3 rows of x did not keep up on Zen 5 (0.73-0.77x the plain layout's
    // speed at 1 row); each cache line asked for kQ8AheadBytes ahead, into L1 (into L2
    // was slower), took SmolLM2's 49152x576 head 1.35 -> 0.98 ms and Gemma 3's 262144x640
    // 7.50 -> 6.29 ms at 1 row, 1.03-1.2x at 2-3 rows (haswell build, one thread,
    // per-thread CPU time, interleaved with the plain layout's 0.99 and 5.36 ms).
    if constexpr (KIND == 0 && R < 4)
      for (int64_t off = 0; off < record; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec + kQ8AheadBytes + off), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      __m256i sum[R];
      for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
      if constexpr (KIND == 0) {
        for (int c = 0; c < 8; ++c) {
          const __m256i w =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + c * 64 + h * 32));
          const __m256i wu = _mm256_sign_epi8(w, w);
          for (int r = 0; r < R; ++r) {
            const __m256i xv = _mm256_sign_epi8(broadcast4(xq + r * K + b * kBlock + 4 * c), w);
            sum[r] = _mm256_add_epi32(sum[r],
                                      _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv), ones));
          }
        }
      } else {
        __m256i pairs[R];
        for (int r = 0; r < R; ++r) pairs[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          const __m256i v =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + c * 64 + h * 32));
          const __m256i lo = _mm256_and_si256(v, nibble);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
          for (int r = 0; r < R; ++r) {
            const int8_t* xb = xq + r * K + b * kBlock;
            pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(lo, broadcast4(xb + 4 * c)));
            pairs[r] =
                _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(hi, broadcast4(xb + 16 + 4 * c)));
          }
        }
        for (int r = 0; r < R; ++r) sum[r] = _mm256_madd_epi16(pairs[r], ones);
      }
      const __m256 dv = halves_f16(rec + quant_bytes, h);
      for (int r = 0; r < R; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(sum[r]);
        acc[h][r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dv, _mm256_set1_ps(xd[r * nb + b])),
                                    acc[h][r]);
        if constexpr (KIND == 1) {
          // sum (d q + m) x = d (q . x) + m sum(x), sum(x) = xs (already times x's scale).
          const __m256 mv = halves_f16(rec + quant_bytes + 2 * kPackedGroup, h);
          acc[h][r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * nb + b]), acc[h][r]);
        } else if constexpr (KIND == 2) {
          // Quants were taken unsigned: d (q - 8) . x = d (q . x) - 8 d sum(x).
          acc[h][r] = _mm256_fmadd_ps(dv, _mm256_set1_ps(-8.f * xs[r * nb + b]), acc[h][r]);
        }
      }
    }
  }
}

// Rows of x per pass over a group: 16 registers hold 4 rows' two accumulators and sums
// beside the unpacked quants.
constexpr int64_t kRowTile = 4;

template <int KIND, int R>
void group_tile(const uint8_t* packed, int64_t record, int64_t quant_bytes, int64_t N,
                int64_t K, int64_t g, int64_t r0, const int8_t* xq, const float* xd,
                const float* xs, float* out) {
  const int64_t nb = K / kBlock;
  __m256 acc[2][R];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_ps();
  group_dot<KIND, R>(packed + g * nb * record, nb, record, quant_bytes, xq + r0 * K,
                     xd + r0 * nb, xs + r0 * nb, K, acc);
  const int64_t valid = std::min(kPackedGroup, N - g * kPackedGroup);
  for (int r = 0; r < R; ++r) {
    float* o = out + (r0 + r) * N + g * kPackedGroup;
    if (valid == kPackedGroup) {
      _mm256_storeu_ps(o, acc[0][r]);
      _mm256_storeu_ps(o + 8, acc[1][r]);
    } else {
      alignas(32) float lanes[kPackedGroup];
      _mm256_store_ps(lanes, acc[0][r]);
      _mm256_store_ps(lanes + 8, acc[1][r]);
      std::memcpy(o, lanes, valid * sizeof(float));
    }
  }
}

template <int KIND>
void packed_kind(const uint8_t* packed, int64_t record, int64_t quant_bytes, int64_t N,
                 int64_t K, int64_t rows, const int8_t* xq, const float* xd, const float* xs,
                 float* out, int64_t g_begin, int64_t g_end) {
  for (int64_t g = g_begin; g < g_end; ++g)
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      const auto run = [&](auto fn) {
        fn(packed, record, quant_bytes, N, K, g, r0, xq, xd, xs, out);
      };
      switch (std::min(kRowTile, rows - r0)) {
        case 1: run(group_tile<KIND, 1>); break;
        case 2: run(group_tile<KIND, 2>); break;
        case 3: run(group_tile<KIND, 3>); break;
        default: run(group_tile<KIND, 4>); break;
      }
    }
}
#endif

}  // namespace

bool packed_groups_avx2(const uint8_t* packed, int64_t kind, int64_t record,
                        int64_t quant_bytes, int64_t N, int64_t K, int64_t rows,
                        const int8_t* xq, const float* xd, const float* xs, float* out,
                        int64_t g_begin, int64_t g_end) {
#ifdef KVSERVE_PACKED_AVX2
  const auto args = [&](auto fn) {
    fn(packed, record, quant_bytes, N, K, rows, xq, xd, xs, out, g_begin, g_end);
  };
  if (kind == 0) args(packed_kind<0>);
  else if (kind == 1) args(packed_kind<1>);
  else args(packed_kind<2>);
  return true;
#else
  (void)packed, (void)kind, (void)record, (void)quant_bytes, (void)N, (void)K, (void)rows,
      (void)xq, (void)xd, (void)xs, (void)out, (void)g_begin, (void)g_end;
  return false;
#endif
}

}  // namespace kvserve_cpu
