// Memory read-rate probe: how fast 1..N threads together stream a buffer far larger than
// the last-level cache. Decode at 1B parameters and up reads every weight once per token,
// so this rate, not the FLOP rate, bounds a single stream; `kvserve bench memory` and
// `kvserve bench peers` report it so a decode rate can be set against what the machine can
// read. Registered as torch.ops.kvserve.memory_read_rates (no tensor arguments, so one
// catch-all kernel, as gemv_prefers_nibble_planes in block_gemm.cpp).

#include <omp.h>
#include <sys/mman.h>
#include <torch/library.h>

#include <limits>
#include <vector>

#include "cpu_common.h"

namespace kvserve_cpu {
namespace {

// Words per unrolled step: 4 independent accumulators of one vector register each, so the
// adds never wait on one another and only the loads set the pace.
#if defined(__AVX512F__)
constexpr int64_t kStepWords = 32;  // 4 x 64 bytes
#elif defined(__AVX2__)
constexpr int64_t kStepWords = 16;  // 4 x 32 bytes
#else
constexpr int64_t kStepWords = 4;
#endif

// The 64-bit sum of p[0..n), n a multiple of kStepWords, p 64-byte aligned. The caller
// checks it against the known total: that keeps every load live (the compiler cannot drop
// a read whose value is compared) and proves the whole slice was read.
uint64_t stream_sum(const uint64_t* p, int64_t n) {
#if defined(__AVX512F__)
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += kStepWords) {
    a0 = _mm512_add_epi64(a0, _mm512_load_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_load_si512(p + i + 8));
    a2 = _mm512_add_epi64(a2, _mm512_load_si512(p + i + 16));
    a3 = _mm512_add_epi64(a3, _mm512_load_si512(p + i + 24));
  }
  const __m512i s = _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3));
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(s));
#elif defined(__AVX2__)
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += kStepWords) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 4)));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 8)));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 12)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  for (int64_t i = 0; i < n; i += kStepWords) {
    a0 += p[i];
    a1 += p[i + 1];
    a2 += p[i + 2];
    a3 += p[i + 3];
  }
  return a0 + a1 + a2 + a3;
#endif
}

}  // namespace

// Best-of-`repeats` read rate in GB/s (1e9 bytes per second) of t = 1..max_threads threads
// together, each streaming its own contiguous share of an `nbytes` buffer. The buffer is
// written first by max_threads threads in the same split, so on a NUMA machine each share
// sits where its reader's first touch put it, as a model's weights do after loading.
// huge_pages: ask for transparent huge pages (madvise) before that first touch; where the
// kernel's THP mode is "madvise" (the common default) a plain allocation, torch's included,
// gets 4 KiB pages, and streaming reads then stall on page walks.
std::vector<double> memory_read_rates(int64_t nbytes, int64_t max_threads, int64_t repeats,
                                      bool huge_pages) {
  TORCH_CHECK(nbytes >= (int64_t{1} << 20), "memory_read_rates: nbytes must be >= 1 MiB");
  TORCH_CHECK(max_threads >= 1, "memory_read_rates: max_threads must be >= 1");
  TORCH_CHECK(repeats >= 1, "memory_read_rates: repeats must be >= 1");
  // Whole steps, so every thread's share (the last one's remainder too) is whole steps.
  const int64_t words = (nbytes / 8) / kStepWords * kStepWords;
  constexpr size_t kHugePage = size_t{2} << 20;
  const size_t bytes = (static_cast<size_t>(words) * 8 + kHugePage - 1) / kHugePage * kHugePage;
  std::unique_ptr<uint64_t, decltype(&std::free)> buffer(
      static_cast<uint64_t*>(std::aligned_alloc(kHugePage, bytes)), &std::free);
  if (!buffer) throw std::bad_alloc();
  uint64_t* data = buffer.get();
  // Advice only: where THP is off the pages stay small and the rate says so.
  if (huge_pages) madvise(data, bytes, MADV_HUGEPAGE);
#pragma omp parallel for num_threads(max_threads) schedule(static)
  for (int64_t i = 0; i < words; ++i) data[i] = static_cast<uint64_t>(i);
  // sum of 0..words-1, modulo 2^64 like the loads' sums
  const uint64_t w = static_cast<uint64_t>(words);
  const uint64_t expected = (w % 2 == 0) ? (w / 2) * (w - 1) : w * ((w - 1) / 2);

  std::vector<double> rates;
  for (int64_t t = 1; t <= max_threads; ++t) {
    double best = std::numeric_limits<double>::infinity();
    for (int64_t r = 0; r <= repeats; ++r) {  // pass 0 warms the team and the TLB
      uint64_t total = 0;
      int team = 0;
      const double start = omp_get_wtime();
#pragma omp parallel num_threads(t) reduction(+ : total)
      {
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        if (tid == 0) team = static_cast<int>(nth);
        // Shares in whole steps; the last thread also takes the remainder.
        const int64_t share = words / nth / kStepWords * kStepWords;
        const int64_t begin = tid * share;
        const int64_t end = tid == nth - 1 ? words : begin + share;
        total += stream_sum(data + begin, end - begin);
      }
      const double elapsed = omp_get_wtime() - start;
      TORCH_CHECK(team == t, "memory_read_rates: OpenMP gave ", team, " threads, not ", t);
      TORCH_CHECK(total == expected, "memory_read_rates: read sum mismatch");
      if (r > 0) best = std::min(best, elapsed);
    }
    rates.push_back(static_cast<double>(words) * 8.0 / best / 1e9);
  }
  return rates;
}

}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "memory_read_rates(int nbytes, int max_threads, int repeats, bool huge_pages=False) -> "
      "float[]",
        &kvserve_cpu::memory_read_rates);
}
