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
// The group's d (or m) float16s for rows 8h..8h+7.
inline __m256 halves_f16(const uint8_t* p, int h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + h));
}

// How far ahead of the block being multiplied the records are requested (group_dot).
constexpr int64_t kAheadBytes = 8192;

// acc[h][r] (rows 8h..8h+7 of the group as lanes) += the group's blocks times R rows of x.
template <int KIND, int R>
void group_dot(const uint8_t* group, int64_t nb, int64_t record, int64_t quant_bytes,
               const int8_t* xq, const float* xd, const float* xs, int64_t K,
               __m256 (&acc)[2][R]) {
  const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = group + b * record;
    // A group is one contiguous run of records, and so is the weight: one stream, whose
    // hardware prefetch stops at every 4 KiB page. At 1-3 rows of x, where DRAM rather
    // than the arithmetic sets the pace, each cache line is asked for kAheadBytes ahead,
    // into L1 (into L2 was slower). Q8_0 (Zen 5, haswell build, one thread, per-thread
    // CPU time, 16 KiB ahead): SmolLM2's 49152x576 head 1.35 -> 0.98 ms, Gemma 3's
    // 262144x640 7.50 -> 6.29 ms at 1 row. Zen 3 (2 vCPUs shared with other jobs, one
    // thread, medians of 2 interleaved rounds of 8-10 calls over 64 MiB of copies): Q8_0
    // 16 KiB 14.2-16.1 ms (none 20.4-20.7) on Gemma 3's head, 8 KiB 14.9-16.3 ms; Q4_1,
    // before asked for nothing, 8 KiB ahead: 1B's 16384x2048 2.84-3.06 -> 2.15-2.30 ms,
    // 2048x8192 1.09-1.25 -> 0.93-1.08 ms, SmolLM2's 3072x576 0.154-0.163 -> 0.121-0.123
    // ms. With the weight in cache the requests are overhead only (1B's 3072x2048 Q4_1 at
    // 1 row, fastest of 300 calls: 0.14 -> 0.20 ms in one A/B); decode streams weights
    // from DRAM. (On Zen 4's haswell build, which no AVX2-only CPU runs, asking for Q4
    // 4 KiB ahead had been 5-35% slower.)
    if constexpr (R < 4)
      for (int64_t off = 0; off < record; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec + kAheadBytes + off), _MM_HINT_T0);
    // acc[h] += the half's integer sums times the scales.
    const auto scale_half = [&](int h, const __m256i (&sums)[R]) {
      const __m256 dv = halves_f16(rec + quant_bytes, h);
      for (int r = 0; r < R; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(sums[r]);
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
    };
    __m256i sum[2][R];
    if constexpr (KIND == 0) {
      // One half at a time: both halves per chunk (as Q4 below) made 2-4 rows of x
      // 1.2-1.7x slower (Zen 3, weights in cache).
      for (int h = 0; h < 2; ++h) {
        for (int r = 0; r < R; ++r) sum[h][r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          const __m256i w =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + c * 64 + h * 32));
          const __m256i wu = _mm256_sign_epi8(w, w);
          for (int r = 0; r < R; ++r) {
            const __m256i xv = _mm256_sign_epi8(broadcast4x8(xq + r * K + b * kBlock + 4 * c), w);
            sum[h][r] = _mm256_add_epi32(sum[h][r],
                                         _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv), ones));
          }
        }
        scale_half(h, sum[h]);  // before the next half: 2R live sums spilled at 4 rows
      }
    } else {
      // Both 8-row halves of a chunk per broadcast of x, chunk by chunk: with the halves
      // in separate passes GCC hoisted the block's 8 broadcasts for the second pass to
      // reuse and spilled them and the sums to the stack in the hot loop.
      __m256i pairs[2][R];
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) pairs[h][r] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i v =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + c * 64 + h * 32));
          lo[h] = _mm256_and_si256(v, nibble);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xb = xq + r * K + b * kBlock;
          const __m256i xl = broadcast4x8(xb + 4 * c), xh = broadcast4x8(xb + 16 + 4 * c);
          for (int h = 0; h < 2; ++h) {
            pairs[h][r] = _mm256_add_epi16(
                pairs[h][r], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                              _mm256_maddubs_epi16(hi[h], xh)));
            in_register(pairs[h][r]);
          }
        }
      }
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) sum[h][r] = _mm256_madd_epi16(pairs[h][r], ones);
    }
    if constexpr (KIND != 0)
      for (int h = 0; h < 2; ++h) scale_half(h, sum[h]);
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
