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

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "block_gemm.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define KVSERVE_EXACT_VNNI 1
constexpr bool kExactVnni = true;
#else
constexpr bool kExactVnni = false;
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

}  // namespace

void ExactInput::prepare(const float* x, int64_t rows, int64_t cols, int64_t kind) {
  const int64_t blocks = rows * cols / kBlock;
  int8_t* digits = digits_.reserve(blocks * kDigits * kBlock);
  // The kinds without a minimum take their quants' offset back per digit (kinds 11, 14
  // and 15 per half block: their halves have their own scales).
  const bool need_sums = !has_min(kind);
  float* scale = scale_.reserve(blocks);
  float* sum = sum_.reserve(blocks);
  block_sums(x, blocks, sum);
  int32_t* digit_sums = digit_sums_.reserve(blocks * 2 * kDigits);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    int8_t* db = digits + b * kDigits * kBlock;
    int32_t* sums = digit_sums + b * 2 * kDigits;
#ifdef KVSERVE_EXACT_VNNI
    const __m512 v[2] = {_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)};
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
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
#else
  (void)w, (void)rows, (void)x, (void)out, (void)ldo, (void)g_begin, (void)g_end;
#endif
}

bool exact_packed_matmul() { return kExactVnni; }

void linear_exact(const BlockWeight& w, const float* x, int64_t rows, float* out) {
  ExactInput input;
  input.prepare(x, rows, w.cols, w.kind);
  at::parallel_for(0, w.rows / kInterleavedRows, 1, [&](int64_t begin, int64_t end) {
    groups_exact(w, rows, input, out, w.rows, begin, end);
  });
}

}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("exact_packed_matmul() -> bool", &kvserve_cpu::exact_packed_matmul);
}
