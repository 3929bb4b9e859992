// Paged decode attention on the CPU: the step's K/V written into the cache and each
// decode row's attention read straight from it through the block table (torch would
// gather every request's whole KV history per layer). Registered as
// torch.ops.kvserve.cache_and_decode_attention; declared in cpu_common.h for the decode
// stack. The cache may hold float32, float16 or bfloat16 (--kv-cache-dtype): values are
// widened to float32 as they are loaded, so a narrower cache halves the bytes streamed.

// See cpu_ops.cpp: lets the exp-based softmax loops vectorize; changes no value.
#pragma GCC optimize("no-trapping-math")

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <vector>

#include "cpu_common.h"

namespace kvserve_cpu {
namespace {

// Decode attention streams the KV cache from memory: worth both threads at a smaller
// size than the compute-bound kernels' threshold.
constexpr int64_t kMinParallelAttention = 1 << 15;

// y += a * x, x widened from the cache's element type.
template <typename T>
inline void axpy_widened(float* y, float a, const T* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * static_cast<float>(x[i]);
}

// Tokens whose query.key products are reduced together (see score_tile).
constexpr int64_t kTile = 8;
// Value rows accumulated per query head before moving to the next head of the group.
constexpr int64_t kValueRows = 32;

// scores[j] = dot(q, k[j]) * scale for up to kTile keys, each rounded exactly as dot()
// rounds it (16 lane sums, then the tail, then the lanes added in order), but with the
// final lane-by-lane additions running across the tile's tokens at once instead of as
// one 16-add dependency chain per token.
template <typename T>
void score_tile(const float* q, const T* const* k, int64_t m, int64_t n_dim, float scale,
                float* scores) {
  float lanes[16][kTile];
  float acc[kTile];
  for (int64_t j = 0; j < m; ++j) {
    float l16[16] = {};
    int64_t i = 0;
    for (; i + 16 <= n_dim; i += 16)
      for (int l = 0; l < 16; ++l) l16[l] += q[i + l] * static_cast<float>(k[j][i + l]);
    float tail = 0.f;
    for (; i < n_dim; ++i) tail += q[i] * static_cast<float>(k[j][i]);
    acc[j] = tail;
    for (int l = 0; l < 16; ++l) lanes[l][j] = l16[l];
  }
  for (int64_t j = m; j < kTile; ++j) {
    acc[j] = 0.f;
    for (int l = 0; l < 16; ++l) lanes[l][j] = 0.f;
  }
  for (int l = 0; l < 16; ++l)
#pragma omp simd
    for (int64_t j = 0; j < kTile; ++j) acc[j] += lanes[l][j];
  for (int64_t j = 0; j < m; ++j) scores[j] = acc[j] * scale;
}

#if defined(__AVX2__) && defined(__F16C__)
// Eight cache values as float32: float16 through F16C, bfloat16 as the high half of a
// float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// scores[j] = scale * (q . k_j) for m <= 8 keys, head_size a multiple of 8. A full batch
// of eight keys keeps eight accumulators and reduces them with one hadd tree.
template <typename T>
void score_batch_avx2(const float* q, const T* const* k, int64_t m, int64_t head_size,
                      float scale, float* scores) {
  if (m < 8) {
    for (int64_t j = 0; j < m; ++j) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t c = 0; c < head_size; c += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), load8(k[j] + c), acc);
      scores[j] = hsum(acc) * scale;
    }
    return;
  }
  __m256 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t c = 0; c < head_size; c += 8) {
    const __m256 qv = _mm256_loadu_ps(q + c);
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, load8(k[t] + c), acc[t]);
  }
  // hadd(hadd(a0, a1), hadd(a2, a3)) holds keys 0-3's low-lane sums in its low half and
  // their high-lane sums in its high half; same for keys 4-7.
  const __m256 s03 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 s47 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20),
                                   _mm256_permute2f128_ps(s03, s47, 0x31));
  _mm256_storeu_ps(scores, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
}

// acc[0, 8 * CHUNKS) += sum_j p[j] v_j over value rows j in [j0, j1) (v[j] + offset). The
// chunk count is a compile-time constant so the accumulators stay in registers: with a
// runtime count they went through the stack, one store-to-load round trip per FMA.
template <int CHUNKS, typename T>
inline void accumulate_chunks(const float* p, const T* const* v, int64_t offset, int64_t j0,
                              int64_t j1, float* acc) {
  __m256 a[CHUNKS];
  for (int c = 0; c < CHUNKS; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const T* row = v[j] + offset;
    for (int c = 0; c < CHUNKS; ++c) a[c] = _mm256_fmadd_ps(pj, load8(row + 8 * c), a[c]);
  }
  for (int c = 0; c < CHUNKS; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}

// acc += sum_j p[j] v_j over value rows j in [j0, j1) (v[j] + v_offset), head_size a
// multiple of 8, 64 accumulator values at a time.
template <typename T>
void accumulate_values_avx2(const float* p, const T* const* v, int64_t v_offset, int64_t j0,
                            int64_t j1, int64_t head_size, float* acc) {
  int64_t c0 = 0;
  for (; c0 + 64 <= head_size; c0 += 64)
    accumulate_chunks<8>(p, v, v_offset + c0, j0, j1, acc + c0);
  const int64_t off = v_offset + c0;
  float* a = acc + c0;
  switch ((head_size - c0) / 8) {
    case 1: return accumulate_chunks<1>(p, v, off, j0, j1, a);
    case 2: return accumulate_chunks<2>(p, v, off, j0, j1, a);
    case 3: return accumulate_chunks<3>(p, v, off, j0, j1, a);
    case 4: return accumulate_chunks<4>(p, v, off, j0, j1, a);
    case 5: return accumulate_chunks<5>(p, v, off, j0, j1, a);
    case 6: return accumulate_chunks<6>(p, v, off, j0, j1, a);
    case 7: return accumulate_chunks<7>(p, v, off, j0, j1, a);
    default: return;
  }
}
#endif

// This step's keys and values into the paged cache: row t goes to slot slot_mapping[t]
// (block * block_size + offset); negative slots (padding) are skipped.
//   key, value: [T, Hkv, hd] with hd contiguous (views into the qkv projection's output)
//   kv_cache: [2, num_blocks, block_size, Hkv, hd], contiguous; slot_mapping: int64 [n <= T]
template <typename T>
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
              const at::Tensor& slot_mapping) {
  check_float(key, "key");
  check_float(value, "value");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, kv_heads, head_size]");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.stride(2) == 1 && value.stride(2) == 1,
              "key and value must be [T, kv_heads, head_size], head_size contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  const int64_t heads = kv_cache.size(3), head_size = kv_cache.size(4);
  TORCH_CHECK(key.size(1) == heads && key.size(2) == head_size && value.size(1) == heads &&
                  value.size(2) == head_size,
              "key/value heads or head size differ from the cache's");
  const int64_t n = slot_mapping.numel();
  TORCH_CHECK(n <= key.size(0) && n <= value.size(0), "more slots than key/value rows");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t row = heads * head_size;
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  T* k_cache = kv_cache.data_ptr<T>();
  T* v_cache = k_cache + num_slots * row;
  const float* k_base = key.data_ptr<float>();
  const float* v_base = value.data_ptr<float>();
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t slot = slot_ptr[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "slot ", slot, " outside the KV cache of ", num_slots);
    // float16/bfloat16 caches: each value rounded to nearest even, as torch's .to() does.
    for (int64_t h = 0; h < heads; ++h) {
      std::copy_n(k_base + t * ks0 + h * ks1, head_size, k_cache + slot * row + h * head_size);
      std::copy_n(v_base + t * vs0 + h * vs1, head_size, v_cache + slot * row + h * head_size);
    }
  }
}

// Decode attention straight from the paged cache. A task is one request's heads, one kv
// head with its GQA group, or one query head, by how many requests share the threads
// (see the task size below).
//   out, query: [T, Hq, hd] (rows of the flattened batch; only token_indices are touched)
//   kv_cache: [2, num_blocks, block_size, Hkv, hd], contiguous
//   block_table: int32 [D, max_blocks]; seq_lens: int32 [D]; token_indices: int64 [D]
//   sliding_window <= 0: no window (else keys at positions >= seq_len - window).
template <typename T>
void decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                      const at::Tensor& block_table, const at::Tensor& seq_lens,
                      const at::Tensor& token_indices, double scale, int64_t sliding_window) {
  check_float(out, "out");
  check_float(query, "query");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [T, Hq, hd], hd contiguous");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1, "out must be [T, Hq, hd], hd contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
              "block_table must be contiguous int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt, "seq_lens must be int32");
  TORCH_CHECK(token_indices.scalar_type() == at::kLong, "token_indices must be int64");

  const int64_t num_reqs = block_table.size(0);
  if (num_reqs == 0) return;
  const int64_t max_blocks = block_table.size(1);
  const int64_t num_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t num_blocks = kv_cache.size(1);
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_size, "head size mismatch between query and cache");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_size;
  const int64_t block_stride = block_size * token_stride;

  const float* q_base = query.data_ptr<float>();
  float* o_base = out.data_ptr<float>();
  const T* k_base = kv_cache.data_ptr<T>();
  const T* v_base = k_base + num_blocks * block_stride;
  const int32_t* tables = block_table.data_ptr<int32_t>();
  const auto lens = seq_lens.contiguous();
  const auto toks = token_indices.contiguous();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  const int64_t* tok_ptr = toks.data_ptr<int64_t>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const float fscale = static_cast<float>(scale);
  // FMA kernels for the usual head sizes; the portable loops below cover the rest.
  [[maybe_unused]] const bool vectorized = head_size % 8 == 0;

  int64_t total_len = 0;
  for (int64_t r = 0; r < num_reqs; ++r) total_len += len_ptr[r];
  // Task size. With many requests a task is one request, all heads: a token's keys for
  // every head are one contiguous row, so the cache streams in order. With fewer, one
  // task per kv head, and with fewer still (single-stream decode) one per query head,
  // which re-reads its group's keys and values from cache but gives every thread work.
  // Each query head's arithmetic is the same whatever the split.
  const int64_t threads = at::get_num_threads();
  const int64_t kv_per_task = num_reqs >= 4 * threads ? num_kv_heads : 1;
  const int64_t q_per_task = num_reqs * num_kv_heads >= 4 * threads ? group : 1;
  const int64_t kv_tasks = num_kv_heads / kv_per_task, q_tasks = group / q_per_task;
  // Keys and values each take head_size multiply-adds per context position and query head.
  const int64_t work_per_task = 2 * kv_per_task * q_per_task * head_size *
                                std::max<int64_t>(1, total_len / num_reqs);
  const int64_t grain = std::max<int64_t>(1, kMinParallelAttention / work_per_task);
  const int64_t v_offset = v_base - k_base;

  at::parallel_for(0, num_reqs * kv_tasks * q_tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const T*> rows;  // each context token's key row (all heads)
    std::vector<float> qs(num_heads * head_size), acc(num_heads * head_size), inv_sum(num_heads);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / (kv_tasks * q_tasks);
      const int64_t h0 = (task / q_tasks) % kv_tasks * kv_per_task, h1 = h0 + kv_per_task;
      const int64_t g0 = task % q_tasks * q_per_task, g1 = g0 + q_per_task;
      const int64_t seq_len = len_ptr[r];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
      const int64_t n = seq_len - first;
      const int64_t tok = tok_ptr[r];
      const int32_t* table = tables + r * max_blocks;
      // Query head qh = h * group + g; its scores at qh * n, its q and acc at qh * head_size.
      if (n <= 0) {
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t g = g0; g < g1; ++g)
            std::fill_n(o_base + tok * os0 + (h * group + g) * os1, head_size, 0.f);
        continue;
      }
      scores.resize(num_heads * n);
      rows.resize(n);
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t qh = h * group + g;
          std::copy_n(q_base + tok * qs0 + qh * qs1, head_size, qs.data() + qh * head_size);
        }
      // Every context position in [first, seq_len), relative to the start of the key
      // cache (the value cache has the same layout): one table lookup per block.
      for (int64_t t0 = first - first % block_size; t0 < seq_len; t0 += block_size) {
        const int64_t block = table[t0 / block_size];
        TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " outside the cache");
        const T* base = k_base + block * block_stride;
        const int64_t lo = std::max(t0, first), hi = std::min(t0 + block_size, seq_len);
        for (int64_t t = lo; t < hi; ++t) rows[t - first] = base + (t - t0) * token_stride;
      }

      // Heads inner: a batch of key rows serves every head of the task while in L1.
      const T* head_rows[kTile];
      for (int64_t i0 = 0; i0 < n; i0 += kTile) {
        const int64_t m = std::min(kTile, n - i0);
        for (int64_t h = h0; h < h1; ++h) {
          for (int64_t j = 0; j < m; ++j) head_rows[j] = rows[i0 + j] + h * head_size;
          for (int64_t g = g0; g < g1; ++g) {
            const int64_t qh = h * group + g;
            float* out_scores = scores.data() + qh * n + i0;
#if defined(__AVX2__) && defined(__F16C__)
            if (vectorized) {
              score_batch_avx2(qs.data() + qh * head_size, head_rows, m, head_size, fscale,
                               out_scores);
              continue;
            }
#endif
            score_tile(qs.data() + qh * head_size, head_rows, m, head_size, fscale, out_scores);
          }
        }
      }
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t qh = h * group + g;
          float* s = scores.data() + qh * n;
          float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
          for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t i = 0; i < n; ++i) {
            s[i] = exp_nonpositive(s[i] - mx);
            sum += s[i];
          }
          inv_sum[qh] = 1.f / sum;
          std::fill_n(acc.data() + qh * head_size, head_size, 0.f);
        }
      // Value rows in runs of kValueRows, each run serving every head of the task.
      for (int64_t j0 = 0; j0 < n; j0 += kValueRows) {
        const int64_t j1 = std::min(n, j0 + kValueRows);
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t g = g0; g < g1; ++g) {
            const int64_t qh = h * group + g;
            const float* p = scores.data() + qh * n;
            float* a = acc.data() + qh * head_size;
            const int64_t offset = v_offset + h * head_size;
#if defined(__AVX2__) && defined(__F16C__)
            if (vectorized) {
              accumulate_values_avx2(p, rows.data(), offset, j0, j1, head_size, a);
              continue;
            }
#endif
            for (int64_t j = j0; j < j1; ++j) axpy_widened(a, p[j], rows[j] + offset, head_size);
          }
      }
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t qh = h * group + g;
          float* o = o_base + tok * os0 + qh * os1;
          const float* a = acc.data() + qh * head_size;
          for (int64_t i = 0; i < head_size; ++i) o[i] = a[i] * inv_sum[qh];
        }
    }
  });
}

}  // namespace

// One call per attention layer and step: write the step's K/V into the paged cache, then
// attend for the decode rows (prefill rows are left to the caller's SDPA). The cache is
// float32 or, with --kv-cache-dtype, float16 or bfloat16; the arithmetic is float32.
void cache_and_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, at::Tensor& kv_cache,
                                const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                const at::Tensor& seq_lens, const at::Tensor& token_indices,
                                double scale, int64_t sliding_window) {
  TORCH_CHECK(kv_cache.device().is_cpu(), "kv_cache must be on the CPU");
  const auto run = [&](auto element) {
    using T = decltype(element);
    write_kv<T>(key, value, kv_cache, slot_mapping);
    decode_attention<T>(out, query, kv_cache, block_table, seq_lens, token_indices, scale,
                        sliding_window);
  };
  switch (kv_cache.scalar_type()) {
    case at::kFloat: return run(float{});
    case at::kHalf: return run(at::Half{});
    case at::kBFloat16: return run(at::BFloat16{});
    default: TORCH_CHECK(false, "kv_cache must be float32, float16 or bfloat16, not ",
                         kv_cache.scalar_type());
  }
}

}  // namespace kvserve_cpu

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("cache_and_decode_attention", &kvserve_cpu::cache_and_decode_attention);
}
