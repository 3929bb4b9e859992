// The lossless path's matmul on AVX-512 VNNI: the GGUF weights exactly, x in float32
// precision, through integer dot products on the blocks interleaved 16 rows at a time
// (kinds 7-15, block_quants.h; llama.cpp's repacked buffers and gguf_int8's copy,
// block_gemm_vnni.cpp, interleave the same way): Q8_0, Q4_1, Q4_0, the repacked Q4_K
// (float32 scale and minimum) and Q6_K (a float32 scale per 16 weights), Q5_0's repacked
// Q8_0 blocks in 5 bits, and Q4_K and Q6_K with the file's own scale fields (Q6_K's
// quants in 6 bits too).
//
// The float GEMV (block_gemm.h) turns every block's quants into floats before it can
// multiply them: per 32 weights 7 vector instructions on Zen 4, whose 512-bit shuffles and
// multiplies each hold a pipe for two cycles. Here x is split once per call into four
// int8 digits per value (ExactInput), the quants stay bytes, and each digit's dot product
// with 16 rows' quants is one vpdpbusd per 4 weights: 2 instructions per 32 weights and
// row, and no horizontal sums (the 16 int32 lanes are the 16 rows). The integer sums are
// exact; a block's four digit sums join in float32 with one rounding (none for the 4-bit
// kinds, whose halves stay below 2^24) and the block's scales apply as the float GEMV's
// do. So a result differs from the float GEMV's only where float32 rounds a sum in
// another order, and where x's digits dropped bits of a value more than 2^7 below its
// block's largest (at 2^-31 of the largest). One row of x, AMD EPYC Zen 4, one thread,
// CPU time a call against the float GEMV: 1.7-2.2x at SmolLM2's and a 1B model's shapes,
// 1.06-1.8x at 2-32 rows.
// Kinds 13-14 form the k-quants' scales from the file's fields as they go (a 1B Q4_K_M
// model reads 914 MB a token instead of 1130): one row of x, one thread, Intel Xeon with
// a 480 MiB L3, CPU time a call against kinds 10-11 (medians of 7-9 alternating rounds, two
// runs): its 32 Q4_K gate/up weights streamed from DRAM on huge pages 1.03-1.06 -> 0.88-
// 0.94 ms (1.12-1.17x), its Q6_K head 1.02-1.05x; one gate weight in cache 1.06x.
// AVX2 CPUs without VNNI run the 4-bit kinds (8-10, 13) on the same digits through
// vpmaddubsw (the second kernel below): the same integer sums and float32 operations, so
// the same results bit for bit. Against the AVX2 float GEMV on nibble planes, CPU time a
// call, one thread, weights in cache, medians of 7 alternating rounds (AMD EPYC Zen 5
// running the haswell build, whose 256-bit operations its wider pipes may run faster
// than an AVX2-only CPU would): one row of x 1.26-1.42x (Q4_1) and 1.59-1.85x (Q4_0) at
// SmolLM2's 1536x576 and 576x1536 and a 1B model's 8192x2048 and 2048x8192; 4 rows
// 0.65-0.90x, 16 rows 0.71-0.82x. Eight of the 1B's up/down pairs streamed from DRAM
// (151-168 MB) at one row, three runs: Q4_1 0.91-1.31x, Q4_0 1.48-1.58x. Each row's four
// digits cost twice the multiplies of the float GEMV's one multiply-add per weight, which
// only a single row's unpacking outweighs: several rows of x take a float32 path on the
// same interleaved blocks instead (group_dot_float, as fast as the float GEMV).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "block_gemm.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define KVSERVE_EXACT_VNNI 1
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define KVSERVE_EXACT_AVX2 1
#endif

namespace kvserve_cpu {

namespace {

// The block's scale exponent: 2^(e-1) <= max|x| < 2^e, at least -96 (values below 2^-126,
// float32's subnormals, keep a normal scale). False for inf or NaN.
bool block_exponent(float amax, int& e) {
  if (!std::isfinite(amax)) return false;
  std::frexp(amax, &e);
  e = std::max(e, -96);
  return true;
}

#ifdef KVSERVE_EXACT_AVX2
inline int32_t add_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
#endif

}  // namespace

void ExactInput::prepare(const float* x, int64_t rows, int64_t cols, int64_t kind) {
  x_ = x;
  const int64_t blocks = rows * cols / kBlock;
  int8_t* digits = digits_.reserve(blocks * kDigits * kBlock);
  // The kinds without a minimum take their quants' offset back per digit (kinds 11, 14
  // and 15 per half block: their halves have their own scales).
  const bool need_sums = !has_min(kind);
  float* scale = scale_.reserve(blocks);
  float* sum = sum_.reserve(blocks);
  block_sums(x, blocks, sum);
  int32_t* digit_sums = digit_sums_.reserve(blocks * 2 * kDigits);
  // Rows the digits will not multiply (AVX2's several rows) take the float32 path, which
  // reads x itself and its block sums.
  if (rows > digit_matmul_rows()) return;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    int8_t* db = digits + b * kDigits * kBlock;
    int32_t* sums = digit_sums + b * 2 * kDigits;
#ifdef KVSERVE_EXACT_VNNI
    const __m512 v[2] = {_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)};
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
#elif defined(KVSERVE_EXACT_AVX2)
    // As the VNNI build's, 8 lanes at a time: the scalar loop below took ~40 us for a
    // 1B model's 8192 values, 5% of its down projection's digit matmul at one row.
    __m256 v[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
#endif
    int e = 0;
    // inf or NaN (which max drops, but not the sum): the block's outputs become NaN
    if (!block_exponent(amax, e) || std::isnan(sum[b])) {
      std::memset(db, 0, kDigits * kBlock);
      scale[b] = std::numeric_limits<float>::quiet_NaN();
      std::fill(sums, sums + 2 * kDigits, 0);
      continue;
    }
    scale[b] = std::ldexp(1.f, e - 30);
    const float up = std::ldexp(1.f, 30 - e);
#ifdef KVSERVE_EXACT_VNNI
    // Exact scaling by a power of two, rounded to nearest (ties to even, MXCSR's default).
    __m512i X[2] = {_mm512_cvtps_epi32(_mm512_mul_ps(v[0], _mm512_set1_ps(up))),
                    _mm512_cvtps_epi32(_mm512_mul_ps(v[1], _mm512_set1_ps(up)))};
    for (int k = 0; k < kDigits; ++k) {
      __m512i digit[2];
      for (int h = 0; h < 2; ++h) {
        digit[h] = _mm512_srai_epi32(_mm512_slli_epi32(X[h], 24), 24);  // low byte, signed
        X[h] = _mm512_srai_epi32(_mm512_sub_epi32(X[h], digit[h]), 8);  // exact
        _mm_storeu_si128(reinterpret_cast<__m128i*>(db + k * kBlock + 16 * h),
                         _mm512_cvtepi32_epi8(digit[h]));
      }
      sums[kDigits + k] = need_sums ? _mm512_reduce_add_epi32(digit[1]) : 0;
      sums[k] = need_sums ? _mm512_reduce_add_epi32(digit[0]) + sums[kDigits + k] : 0;
    }
#elif defined(KVSERVE_EXACT_AVX2)
    __m256i X[4];
    for (int j = 0; j < 4; ++j) X[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(up)));
    for (int k = 0; k < kDigits; ++k) {
      __m256i digit[4];
      for (int j = 0; j < 4; ++j) {
        digit[j] = _mm256_srai_epi32(_mm256_slli_epi32(X[j], 24), 24);
        X[j] = _mm256_srai_epi32(_mm256_sub_epi32(X[j], digit[j]), 8);
      }
      // The packs interleave the 128-bit lanes' 4-byte runs; the permutation restores order.
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(digit[0], digit[1]),
                             _mm256_packs_epi32(digit[2], digit[3])),
          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(db + k * kBlock), bytes);
      sums[kDigits + k] = need_sums ? add_lanes(_mm256_add_epi32(digit[2], digit[3])) : 0;
      sums[k] = need_sums ? add_lanes(_mm256_add_epi32(digit[0], digit[1])) + sums[kDigits + k] : 0;
    }
#else
    std::fill(sums, sums + 2 * kDigits, 0);
    for (int i = 0; i < kBlock; ++i) {
      auto X = static_cast<int32_t>(std::nearbyint(xb[i] * up));
      for (int k = 0; k < kDigits; ++k) {
        const auto digit = static_cast<int8_t>(static_cast<uint32_t>(X) & 0xFF);
        db[k * kBlock + i] = digit;
        sums[k] += digit;
        if (i >= kBlock / 2) sums[kDigits + k] += digit;
        X = (X - digit) >> 8;  // exact: X - digit is a multiple of 256
      }
    }
#endif
  }
}

namespace {

#ifdef KVSERVE_EXACT_VNNI
// Four bytes of x, the same for every row of a group: dpbusd's signed operand.
inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Blocks this far ahead of the one being multiplied are requested from memory: the
// group's quants and scales are three runs the kernel walks in order.
constexpr int64_t kAheadBlocks = 4;

// acc[r] += the digit sums of block b (or its half) as one dot product, times the 16
// rows' scales dv and x's block scale. X . q = 2^16 (2^8 s3 + s2) + (2^8 s1 + s0); each
// half is exact in float32 for the 4-bit kinds (|s| <= 32 * 15 * 128), the byte kinds'
// and the 5-bit kind's (|s| up to 32 * 16 * 128) may round once.
template <int R>
inline void add_block_dots(const __m512i (&sum)[R][ExactInput::kDigits], __m512 dv,
                           const ExactInput& x, int64_t r0, int64_t nb, int64_t b, __m512 acc[R]) {
  for (int r = 0; r < R; ++r) {
    const __m512i hi = _mm512_add_epi32(_mm512_slli_epi32(sum[r][3], 8), sum[r][2]);
    const __m512i lo = _mm512_add_epi32(_mm512_slli_epi32(sum[r][1], 8), sum[r][0]);
    const __m512 dot =
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(65536.f), _mm512_cvtepi32_ps(lo));
    acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(x.scale((r0 + r) * nb + b))),
                             acc[r]);
  }
}

// acc[r] (the 16 rows of group g as lanes) += the group's blocks times rows r0..r0+R-1 of
// x. Every integer sum is exact, so a row's result is the same whatever R is.
template <int KIND, int R>
void group_dot_exact(const BlockWeight& w, int64_t g, const ExactInput& x, int64_t r0,
                     __m512 acc[R]) {
  constexpr int D = ExactInput::kDigits;
  constexpr int64_t G = kInterleavedRows, bb = block_bytes_of(KIND);
  const int64_t nb = w.cols / kBlock;
  constexpr int S = static_cast<int>(scales_per_block(KIND));
  constexpr int64_t scale_bytes = float32_scales(KIND) ? 4 : 2;
  const uint8_t* quants = w.qs + g * nb * G * bb;
  // The group's scales and minimums: 16 rows' side by side per block (S runs for kind 11)
  const auto plane = [&](const void* half_plane, const void* float_plane) {
    return static_cast<const uint8_t*>(float32_scales(KIND) ? float_plane : half_plane) +
           g * nb * G * S * scale_bytes;
  };
  const uint8_t* scales = compact_scales(KIND) ? nullptr : plane(w.d, w.d32);
  const uint8_t* minimums = has_min(KIND) && !compact_scales(KIND) ? plane(w.m, w.m32) : nullptr;
  const auto load16 = [](const uint8_t* p) {
    if constexpr (float32_scales(KIND)) return _mm512_loadu_ps(p);
    else return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  // Kinds 13-15: the group's float16 super-block fields (P per super-block: kind 13's d and
  // dmin, the latter negated as it is read) and its blocks' two 8-bit sub-block fields, 16
  // rows side by side.
  constexpr int64_t P = KIND == 13 ? 2 : 1, kSubBlocks = kSuperBlock / kBlock;
  const uint8_t* supers =
      compact_scales(KIND)
          ? reinterpret_cast<const uint8_t*>(w.d + g * (nb / kSubBlocks) * P * G)
          : nullptr;
  const uint8_t* subs = compact_scales(KIND) ? w.sub + g * nb * 2 * G : nullptr;
  __m512 super_fields[P];
  // Block b's 16 rows' scales (half: kinds 11, 14 and 15's second) and minimums, as floats.
  // Kinds 13-15 multiply the fields as gguf does: float32 products, exact, the very
  // scales kinds 10-11 keep ((-dmin) min is -(dmin min) bit for bit, one sign flip per
  // super-block instead of one per block).
  const auto sub_product = [&](int64_t b, int p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(subs + (b * 2 + p) * G));
    const __m512i wide = KIND == 13 ? _mm512_cvtepu8_epi32(bytes) : _mm512_cvtepi8_epi32(bytes);
    return _mm512_mul_ps(super_fields[KIND == 13 ? p : 0], _mm512_cvtepi32_ps(wide));
  };
  const auto block_scales = [&](int64_t b, int half) {
    if constexpr (compact_scales(KIND)) return sub_product(b, half);
    else return load16(scales + (b * S + half) * G * scale_bytes);
  };
  const auto block_minimums = [&](int64_t b) {
    if constexpr (compact_scales(KIND)) return sub_product(b, 1);
    else return load16(minimums + b * G * scale_bytes);
  };
  const __m512i nibble = _mm512_set1_epi8(15);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = quants + b * G * bb;
    for (int64_t line = 0; line < G * bb; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(q + kAheadBlocks * G * bb + line), _MM_HINT_T0);
    if constexpr (compact_scales(KIND)) {
      _mm_prefetch(reinterpret_cast<const char*>(subs + (b + kAheadBlocks) * 2 * G), _MM_HINT_T0);
      if (b % kSubBlocks == 0) {
        const uint8_t* fields = supers + (b / kSubBlocks) * P * G * 2;
        _mm_prefetch(reinterpret_cast<const char*>(fields + P * G * 2), _MM_HINT_T0);
        for (int p = 0; p < P; ++p) {
          const __m512 field = _mm512_cvtph_ps(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(fields + p * G * 2)));
          super_fields[p] = p == 0 ? field
                                   : _mm512_castsi512_ps(_mm512_xor_si512(
                                         _mm512_castps_si512(field),
                                         _mm512_set1_epi32(std::numeric_limits<int32_t>::min())));
        }
      }
    } else {
      for (int64_t line = 0; line < G * S * scale_bytes; line += 64)
        _mm_prefetch(
            reinterpret_cast<const char*>(scales + (b + kAheadBlocks) * G * S * scale_bytes + line),
            _MM_HINT_T0);
      if constexpr (has_min(KIND))
        _mm_prefetch(reinterpret_cast<const char*>(minimums + (b + kAheadBlocks) * G * scale_bytes),
                     _MM_HINT_T0);
    }
    __m512i sum[R][D];
    if constexpr (KIND == 15) {
      // u in 0..63: a half block's nibbles (low or high) with their masked bits 4 and 5
      // added. Each half has its own scale, so its four chunks run alone: 16 digit sums for
      // 4 rows of x, beside the quants, fit the 32 registers where both halves' would not.
      for (int half = 0; half < 2; ++half) {
        for (int r = 0; r < R; ++r)
          for (int k = 0; k < D; ++k) sum[r][k] = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
          const __m512i v = _mm512_loadu_si512(q + c * 64);
          __m512i u = _mm512_and_si512(half == 0 ? v : _mm512_srli_epi16(v, 4), nibble);
          __mmask64 bits[2];
          std::memcpy(bits, q + 256 + c * 32 + half * 16, sizeof(bits));
          u = _mm512_mask_add_epi8(u, bits[0], u, _mm512_set1_epi8(16));
          u = _mm512_mask_add_epi8(u, bits[1], u, _mm512_set1_epi8(32));
          for (int r = 0; r < R; ++r)
            for (int k = 0; k < D; ++k)
              sum[r][k] = _mm512_dpbusd_epi32(
                  sum[r][k], u, broadcast4(x.digits((r0 + r) * nb + b, k) + 16 * half + 4 * c));
        }
        // u . a - 32 sum(a) over the half: (u - 32) . a, kind 14's exact sums.
        for (int r = 0; r < R; ++r) {
          const int32_t* s = x.digit_sums((r0 + r) * nb + b);
          for (int k = 0; k < D; ++k) {
            const int32_t digit_sum = half == 0 ? s[k] - s[D + k] : s[D + k];
            sum[r][k] = _mm512_sub_epi32(sum[r][k], _mm512_set1_epi32(32 * digit_sum));
          }
        }
        add_block_dots<R>(sum, block_scales(b, half), x, r0, nb, b, acc);
      }
    } else if constexpr (byte_quants(KIND)) {  // unsigned q + 128; kind 11 a half block at a time
      for (int half = 0; half < S; ++half) {
        for (int r = 0; r < R; ++r)
          for (int k = 0; k < D; ++k) sum[r][k] = _mm512_setzero_si512();
        for (int c = half * 8 / S; c < (half + 1) * 8 / S; ++c) {
          const __m512i v = _mm512_loadu_si512(q + c * 64);
          for (int r = 0; r < R; ++r)
            for (int k = 0; k < D; ++k)
              sum[r][k] = _mm512_dpbusd_epi32(sum[r][k], v,
                                              broadcast4(x.digits((r0 + r) * nb + b, k) + 4 * c));
        }
        // (q + 128) . a - 128 sum(a) over the block or its half: exact.
        for (int r = 0; r < R; ++r) {
          const int32_t* s = x.digit_sums((r0 + r) * nb + b);
          for (int k = 0; k < D; ++k) {
            const int32_t digit_sum = S == 1 ? s[k] : half == 0 ? s[k] - s[D + k] : s[D + k];
            sum[r][k] = _mm512_sub_epi32(sum[r][k], _mm512_set1_epi32(128 * digit_sum));
          }
        }
        add_block_dots<R>(sum, block_scales(b, half), x, r0, nb, b, acc);
      }
    } else {
      for (int r = 0; r < R; ++r)
        for (int k = 0; k < D; ++k) sum[r][k] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(q + c * 64);
        __m512i lo = _mm512_and_si512(v, nibble);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        if constexpr (KIND == 12) {  // the fifth bits: q + 16 in 0..31
          __mmask64 fifth[2];
          std::memcpy(fifth, q + 256 + c * 16, sizeof(fifth));
          lo = _mm512_mask_add_epi8(lo, fifth[0], lo, _mm512_set1_epi8(16));
          hi = _mm512_mask_add_epi8(hi, fifth[1], hi, _mm512_set1_epi8(16));
        }
        for (int r = 0; r < R; ++r)
          for (int k = 0; k < D; ++k) {
            const int8_t* a = x.digits((r0 + r) * nb + b, k);
            sum[r][k] = _mm512_dpbusd_epi32(sum[r][k], lo, broadcast4(a + 4 * c));
            sum[r][k] = _mm512_dpbusd_epi32(sum[r][k], hi, broadcast4(a + 16 + 4 * c));
          }
      }
      if constexpr (!has_min(KIND)) {  // q . a - 8 sum(a) for Q4_0 (q - 8), 16 for kind 12
        constexpr int32_t offset = KIND == 12 ? 16 : 8;
        for (int r = 0; r < R; ++r) {
          const int32_t* s = x.digit_sums((r0 + r) * nb + b);
          for (int k = 0; k < D; ++k)
            sum[r][k] = _mm512_sub_epi32(sum[r][k], _mm512_set1_epi32(offset * s[k]));
        }
      }
      add_block_dots<R>(sum, block_scales(b, 0), x, r0, nb, b, acc);
      if constexpr (has_min(KIND)) {  // sum (d q + m) x = d (q . x) + m sum(x)
        const __m512 mv = block_minimums(b);
        for (int r = 0; r < R; ++r)
          acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x.sum((r0 + r) * nb + b)), acc[r]);
      }
    }
  }
}

// Rows of x per pass over a group: 4 rows' 16 digit sums fill half the registers.
constexpr int64_t kExactRowTile = 4;

template <int KIND, int R>
void group_tile_exact(const BlockWeight& w, int64_t g, int64_t r0, const ExactInput& x,
                      float* out, int64_t ldo) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  group_dot_exact<KIND, R>(w, g, x, r0, acc);
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(out + (r0 + r) * ldo + g * kInterleavedRows, acc[r]);
}

template <int KIND>
void groups_exact_kind(const BlockWeight& w, int64_t rows, const ExactInput& x, float* out,
                       int64_t ldo, int64_t g_begin, int64_t g_end) {
  for (int64_t g = g_begin; g < g_end; ++g)
    for (int64_t r0 = 0; r0 < rows; r0 += kExactRowTile) {
      switch (std::min(kExactRowTile, rows - r0)) {
        case 1: group_tile_exact<KIND, 1>(w, g, r0, x, out, ldo); break;
        case 2: group_tile_exact<KIND, 2>(w, g, r0, x, out, ldo); break;
        case 3: group_tile_exact<KIND, 3>(w, g, r0, x, out, ldo); break;
        default: group_tile_exact<KIND, 4>(w, g, r0, x, out, ldo); break;
      }
    }
}
#endif

#ifdef KVSERVE_EXACT_AVX2
// AVX2 without VNNI: the same digits and integer sums through vpmaddubsw (unsigned quant
// times signed digit, adjacent products added into int16) and one vpmaddwd per block and
// digit to int32, for the kinds whose quants are 4 bits (0..15): a pair lies within
// 2 * 15 * 128 = 3840 in magnitude and a row's 8 pairs per block and lane (4 chunks, low
// and high nibbles) within 8 * 3840 = 30720 < 32767, so a block adds up in int16 without
// saturating. The byte kinds' signed quants reach 2 * 128 * 128 in one pair: they stay on
// the float GEMV. The 8 lanes are 8 rows, a group's two halves two vectors, each float
// operation the VNNI kernel's in its order, so the two builds agree bit for bit.
constexpr bool exact_kind(int64_t kind) { return kind == 8 || kind == 9 || kind == 10 || kind == 13; }

constexpr int64_t kAheadBlocks = 4;

// A group's block scales and minimums, rows 8h..8h+7 as the lanes of half h, whichever
// planes hold them; next(b) requests what lies kAheadBlocks on and, for kind 13, reads a
// new super-block's d and -dmin (VNNI's group_dot_exact explains the fields and the sign).
template <int KIND>
class GroupFields {
 public:
  GroupFields(const BlockWeight& w, int64_t g) : nb_(w.cols / kBlock) {
    constexpr int64_t G = kInterleavedRows;
    const auto plane = [&](const void* half_plane, const void* float_plane) {
      return static_cast<const uint8_t*>(float32_scales(KIND) ? float_plane : half_plane) +
             g * nb_ * G * kScaleBytes;
    };
    if constexpr (compact_scales(KIND)) {
      supers_ = reinterpret_cast<const uint8_t*>(w.d + g * (nb_ / kSubBlocks) * 2 * G);
      subs_ = w.sub + g * nb_ * 2 * G;
    } else {
      scales_ = plane(w.d, w.d32);
      if constexpr (has_min(KIND)) minimums_ = plane(w.m, w.m32);
    }
  }

  void next(int64_t b) {
    constexpr int64_t G = kInterleavedRows;
    if constexpr (compact_scales(KIND)) {
      _mm_prefetch(reinterpret_cast<const char*>(subs_ + (b + kAheadBlocks) * 2 * G), _MM_HINT_T0);
      if (b % kSubBlocks) return;
      const uint8_t* fields = supers_ + (b / kSubBlocks) * 2 * G * 2;
      _mm_prefetch(reinterpret_cast<const char*>(fields + 2 * G * 2), _MM_HINT_T0);
      for (int h = 0; h < 2; ++h)
        for (int p = 0; p < 2; ++p) {
          const __m256 field = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(fields + p * G * 2) + h));
          super_[h][p] = p == 0 ? field
                                : _mm256_castsi256_ps(_mm256_xor_si256(
                                      _mm256_castps_si256(field),
                                      _mm256_set1_epi32(std::numeric_limits<int32_t>::min())));
        }
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(scales_ + (b + kAheadBlocks) * G * kScaleBytes),
                   _MM_HINT_T0);
      if constexpr (has_min(KIND))
        _mm_prefetch(reinterpret_cast<const char*>(minimums_ + (b + kAheadBlocks) * G * kScaleBytes),
                     _MM_HINT_T0);
    }
  }
  __m256 scales(int64_t b, int h) const {
    if constexpr (compact_scales(KIND)) return sub_product(b, 0, h);
    else return load8(scales_ + b * kInterleavedRows * kScaleBytes, h);
  }
  __m256 minimums(int64_t b, int h) const {
    if constexpr (compact_scales(KIND)) return sub_product(b, 1, h);
    else return load8(minimums_ + b * kInterleavedRows * kScaleBytes, h);
  }

 private:
  static constexpr int64_t kScaleBytes = float32_scales(KIND) ? 4 : 2;
  static constexpr int64_t kSubBlocks = kSuperBlock / kBlock;
  static __m256 load8(const uint8_t* p, int h) {
    if constexpr (float32_scales(KIND))
      return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8 * h);
    else return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + h));
  }
  __m256 sub_product(int64_t b, int p, int h) const {
    const __m128i bytes = _mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(subs_ + (b * 2 + p) * kInterleavedRows + 8 * h));
    return _mm256_mul_ps(super_[h][p], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
  }
  int64_t nb_;
  const uint8_t* scales_ = nullptr;
  const uint8_t* minimums_ = nullptr;
  const uint8_t* supers_ = nullptr;
  const uint8_t* subs_ = nullptr;
  __m256 super_[2][2];
};

// The group's quants of block b, requesting those kAheadBlocks on.
template <int KIND>
inline const uint8_t* group_block(const BlockWeight& w, int64_t g, int64_t b) {
  constexpr int64_t G = kInterleavedRows, bb = block_bytes_of(KIND);
  const uint8_t* q = w.qs + (g * (w.cols / kBlock) + b) * G * bb;
  for (int64_t line = 0; line < G * bb; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(q + kAheadBlocks * G * bb + line), _MM_HINT_T0);
  return q;
}

// acc[h] (rows 8h..8h+7 of group g as lanes) += the group's blocks times row r of x,
// one row at a time: a row's int16 sums for both halves fill half the 16 registers (two
// rows' went to the stack, every add waiting on a store). The quants' unpacking is a small
// part of a row's work: per row and 64 weights the 4 digits take 8 vpmaddubsw and 8 adds
// where the float GEMV, its quants converted once for all rows, takes 8 multiply-adds;
// the digit matmul pays off at one row of x only (tools/bench_digit_matmul.py), and
// several rows take group_dot_float.
template <int KIND>
void group_dot_exact(const BlockWeight& w, int64_t g, const ExactInput& x, int64_t r,
                     __m256 (&acc)[2]) {
  constexpr int D = ExactInput::kDigits;
  const int64_t nb = w.cols / kBlock;
  GroupFields<KIND> fields(w, g);
  const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = group_block<KIND>(w, g, b);
    fields.next(b);
    const int64_t i = r * nb + b;
    const int8_t* a = x.digits(i, 0);
    __m256i pairs[2][D];
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < D; ++k) pairs[h][k] = _mm256_setzero_si256();
    // Both halves' quants per broadcast of x: half the broadcasts of a pass per half (in
    // a noisy A/B on Zen 5's haswell build, one row's CPU time a call the same or lower).
    for (int c = 0; c < 4; ++c) {
      __m256i lo[2], hi[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 64 + h * 32));
        lo[h] = _mm256_and_si256(v, nibble);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      }
      for (int k = 0; k < D; ++k) {
        const __m256i xl = broadcast4x8(a + k * kBlock + 4 * c);
        const __m256i xh = broadcast4x8(a + k * kBlock + 16 + 4 * c);
        for (int h = 0; h < 2; ++h) {
          pairs[h][k] = _mm256_add_epi16(
              pairs[h][k],
              _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl), _mm256_maddubs_epi16(hi[h], xh)));
          in_register(pairs[h][k]);
        }
      }
    }
    const int32_t* s = x.digit_sums(i);
    for (int h = 0; h < 2; ++h) {
      __m256i sum[D];
      for (int k = 0; k < D; ++k) {
        sum[k] = _mm256_madd_epi16(pairs[h][k], ones);
        // q . a - 8 sum(a) for Q4_0 (q - 8)
        if constexpr (!has_min(KIND)) sum[k] = _mm256_sub_epi32(sum[k], _mm256_set1_epi32(8 * s[k]));
      }
      // VNNI's add_block_dots on 8 lanes: exact halves, one rounding in the join.
      const __m256i hi = _mm256_add_epi32(_mm256_slli_epi32(sum[3], 8), sum[2]);
      const __m256i lo = _mm256_add_epi32(_mm256_slli_epi32(sum[1], 8), sum[0]);
      const __m256 dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(65536.f),
                                         _mm256_cvtepi32_ps(lo));
      acc[h] = _mm256_fmadd_ps(dot, _mm256_mul_ps(fields.scales(b, h), _mm256_set1_ps(x.scale(i))),
                               acc[h]);
      if constexpr (has_min(KIND))  // sum (d q + m) x = d (q . x) + m sum(x)
        acc[h] = _mm256_fmadd_ps(fields.minimums(b, h), _mm256_set1_ps(x.sum(i)), acc[h]);
    }
  }
}

// Several rows of x on the same interleaved blocks in float32, as the float GEMV computes
// them (the AVX-512 one's order: each weight d q, exact for these scales, multiplied into
// x, then the minimum times x's block sum; only the order of the float32 additions
// differs from the digits'): each of the group's quants is converted and scaled once for
// all R rows, and a row costs one multiply-add per weight and 8 rows where the digits
// take two integer multiplies. acc[r]: row r0 + r of x, rows 8h..8h+7 of group g as
// lanes. A row's arithmetic is the same in every tile of rows, so its result does not
// depend on the rows beside it (as long as there are some: one row alone takes the digit
// matmul).
template <int KIND, int R>
void group_dot_float(const BlockWeight& w, int64_t g, int h, const ExactInput& x, int64_t r0,
                     __m256 (&acc)[R]) {
  // Two chains of multiply-adds per row: one row alone would wait on one chain's latency.
  constexpr int P = 2;
  const int64_t nb = w.cols / kBlock;
  GroupFields<KIND> fields(w, g);
  const __m256i nibble = _mm256_set1_epi32(15);
  __m256 sums[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) sums[r][p] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = group_block<KIND>(w, g, b);
    fields.next(b);
    const float* xb[R];
    for (int r = 0; r < R; ++r) xb[r] = x.values((r0 + r) * nb + b);
    const __m256 scale = fields.scales(b, h);
    for (int c = 0; c < 4; ++c) {
      // Lane i: row 8h + i's weights 4c..4c+3 (low nibbles) and 16+4c..16+4c+3 (high).
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 64 + h * 32));
      for (int j = 0; j < 8; ++j) {
        __m256i qi = _mm256_and_si256(_mm256_srli_epi32(v, 4 * (j % 2) + 8 * (j / 2)), nibble);
        if constexpr (KIND == 9) qi = _mm256_sub_epi32(qi, _mm256_set1_epi32(8));
        const __m256 wv = _mm256_mul_ps(_mm256_cvtepi32_ps(qi), scale);
        const int64_t col = (j % 2) * 16 + 4 * c + j / 2;
        for (int r = 0; r < R; ++r)
          sums[r][j % P] = _mm256_fmadd_ps(wv, _mm256_broadcast_ss(xb[r] + col), sums[r][j % P]);
      }
    }
    if constexpr (has_min(KIND)) {
      const __m256 minimum = fields.minimums(b, h);
      for (int r = 0; r < R; ++r)
        sums[r][0] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(x.sum((r0 + r) * nb + b)), sums[r][0]);
    }
  }
  for (int r = 0; r < R; ++r) acc[r] = _mm256_add_ps(sums[r][0], sums[r][1]);
}

// From this many rows of x on, group_dot_float: the digit matmul wins at one row only
// (one thread, AMD EPYC Zen 5 running the haswell build, CPU time a call against the float
// GEMV on nibble planes, SmolLM2's and a 1B's shapes, Q4_1 and Q4_0: 1 row digit
// 1.46-2.2x; 2-8 rows this path 0.87-1.18x, the digits 0.57-0.92x).
constexpr int64_t kFloatRowsFrom = 2;
constexpr int64_t kFloatRowTile = 4;

template <int KIND, int R>
void group_tile_float(const BlockWeight& w, int64_t g, int64_t r0, const ExactInput& x,
                      float* out, int64_t ldo) {
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    group_dot_float<KIND, R>(w, g, h, x, r0, acc);
    for (int r = 0; r < R; ++r)
      _mm256_storeu_ps(out + (r0 + r) * ldo + g * kInterleavedRows + 8 * h, acc[r]);
  }
}

template <int KIND>
void groups_exact_kind(const BlockWeight& w, int64_t rows, const ExactInput& x, float* out,
                       int64_t ldo, int64_t g_begin, int64_t g_end) {
  for (int64_t g = g_begin; g < g_end; ++g) {
    if (rows < kFloatRowsFrom) {
      for (int64_t r = 0; r < rows; ++r) {
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        group_dot_exact<KIND>(w, g, x, r, acc);
        for (int h = 0; h < 2; ++h)
          _mm256_storeu_ps(out + r * ldo + g * kInterleavedRows + 8 * h, acc[h]);
      }
      continue;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kFloatRowTile) {
      switch (std::min(kFloatRowTile, rows - r0)) {
        case 1: group_tile_float<KIND, 1>(w, g, r0, x, out, ldo); break;
        case 2: group_tile_float<KIND, 2>(w, g, r0, x, out, ldo); break;
        case 3: group_tile_float<KIND, 3>(w, g, r0, x, out, ldo); break;
        default: group_tile_float<KIND, 4>(w, g, r0, x, out, ldo); break;
      }
    }
  }
}
#endif

}  // namespace

void groups_exact(const BlockWeight& w, int64_t rows, const ExactInput& x, float* out,
                  int64_t ldo, int64_t g_begin, int64_t g_end) {
#ifdef KVSERVE_EXACT_VNNI
  if (w.kind == 7) groups_exact_kind<7>(w, rows, x, out, ldo, g_begin, g_end);
  else if (w.kind == 8) groups_exact_kind<8>(w, rows, x, out, ldo, g_begin, g_end);
  else if (w.kind == 9) groups_exact_kind<9>(w, rows, x, out, ldo, g_begin, g_end);
  else if (w.kind == 10) groups_exact_kind<10>(w, rows, x, out, ldo, g_begin, g_end);
  else if (w.kind == 11) groups_exact_kind<11>(w, rows, x, out, ldo, g_begin, g_end);
  else if (w.kind == 12) groups_exact_kind<12>(w, rows, x, out, ldo, g_begin, g_end);
  else if (w.kind == 13) groups_exact_kind<13>(w, rows, x, out, ldo, g_begin, g_end);
  else if (w.kind == 14) groups_exact_kind<14>(w, rows, x, out, ldo, g_begin, g_end);
  else groups_exact_kind<15>(w, rows, x, out, ldo, g_begin, g_end);
#elif defined(KVSERVE_EXACT_AVX2)
  if (w.kind == 8) groups_exact_kind<8>(w, rows, x, out, ldo, g_begin, g_end);
  else if (w.kind == 9) groups_exact_kind<9>(w, rows, x, out, ldo, g_begin, g_end);
  else if (w.kind == 10) groups_exact_kind<10>(w, rows, x, out, ldo, g_begin, g_end);
  else groups_exact_kind<13>(w, rows, x, out, ldo, g_begin, g_end);
#else
  (void)w, (void)rows, (void)x, (void)out, (void)ldo, (void)g_begin, (void)g_end;
#endif
}

bool exact_packed_kind(int64_t kind) {
#if defined(KVSERVE_EXACT_VNNI)
  return interleaved(kind);
#elif defined(KVSERVE_EXACT_AVX2)
  return exact_kind(kind);
#else
  (void)kind;
  return false;
#endif
}

int64_t digit_matmul_rows() {
#if defined(KVSERVE_EXACT_AVX2)
  return kFloatRowsFrom - 1;
#else
  return std::numeric_limits<int64_t>::max();
#endif
}

std::vector<int64_t> exact_packed_kinds() {
  std::vector<int64_t> kinds;
  for (int64_t kind = 0; kind < kNumKinds; ++kind)
    if (exact_packed_kind(kind)) kinds.push_back(kind);
  return kinds;
}

void linear_exact(const BlockWeight& w, const float* x, int64_t rows, float* out) {
  ExactInput input;
  input.prepare(x, rows, w.cols, w.kind);
  at::parallel_for(0, w.rows / kInterleavedRows, 1, [&](int64_t begin, int64_t end) {
    groups_exact(w, rows, input, out, w.rows, begin, end);
  });
}

}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("exact_packed_kinds() -> int[]", &kvserve_cpu::exact_packed_kinds);
  m.def("digit_matmul_rows() -> int", &kvserve_cpu::digit_matmul_rows);
}
