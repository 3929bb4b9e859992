// Paged decode attention on the CPU: the step's K/V written into the cache and each
// decode row's attention read straight from it through the block table (torch would
// gather every request's whole KV history per layer). Registered as
// torch.ops.kvserve.cache_and_decode_attention; its plans (decode_attention.h) serve the
// fused decode step too. The cache may hold float32, float16 or bfloat16 (--kv-cache-dtype): values are
// widened to float32 as they are loaded, so a narrower cache halves the bytes streamed.

// See cpu_ops.cpp: lets the exp-based softmax loops vectorize; changes no value.
#pragma GCC optimize("no-trapping-math")

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <vector>
#ifdef __SSE__
#include <xmmintrin.h>  // _mm_prefetch
#endif

#include "decode_attention.h"

namespace kvserve_cpu {
namespace {

// y += a * x, x widened from the cache's element type.
template <typename T>
inline void axpy_widened(float* y, float a, const T* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * static_cast<float>(x[i]);
}

inline void prefetch_row(const void* p, int64_t bytes) {
#ifdef __SSE__
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
#else
  (void)p, (void)bytes;
#endif
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

template <typename T>
void write_kv(const KVWritePlan& p) {
  const int64_t row = p.heads * p.head_size;
  T* k_cache = static_cast<T*>(p.k_cache);
  T* v_cache = k_cache + p.num_slots * row;
  const int64_t* slot_ptr = p.slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < p.slots.numel(); ++t) {
    const int64_t slot = slot_ptr[t];
    if (slot < 0) continue;
    // float16/bfloat16 caches: each value rounded to nearest even, as torch's .to() does.
    for (int64_t h = 0; h < p.heads; ++h) {
      std::copy_n(p.k_base + t * p.ks0 + h * p.ks1, p.head_size,
                  k_cache + slot * row + h * p.head_size);
      std::copy_n(p.v_base + t * p.vs0 + h * p.vs1, p.head_size,
                  v_cache + slot * row + h * p.head_size);
    }
  }
}

// Runs `fn(T{})` for the cache's element type.
template <typename Fn>
void with_cache_type(at::ScalarType type, Fn&& fn) {
  switch (type) {
    case at::kFloat: return fn(float{});
    case at::kHalf: return fn(at::Half{});
    case at::kBFloat16: return fn(at::BFloat16{});
    default: TORCH_CHECK(false, "kv_cache must be float32, float16 or bfloat16, not ", type);
  }
}

template <typename T>
void attention_tasks(const DecodeAttentionPlan& p, int64_t begin, int64_t end) {
  const int64_t head_size = p.head_size, num_heads = p.num_heads;
  const int64_t group = num_heads / p.num_kv_heads;
  const int64_t token_stride = p.num_kv_heads * head_size;
  const int64_t block_stride = p.block_size * token_stride;
  const T* k_base = static_cast<const T*>(p.kv_base);
  const int64_t v_offset = p.num_blocks * block_stride;
  // FMA kernels for the usual head sizes; the portable loops below cover the rest.
  [[maybe_unused]] const bool vectorized = head_size % 8 == 0;
  const int64_t head_bytes = head_size * static_cast<int64_t>(sizeof(T));
  // Scores rows start on cache lines: the vectorized softmax sums then run the same
  // way for a head whatever task and thread it falls to.
  CacheAligned<float> scores(0);
  int64_t scores_capacity = 0;
  std::vector<const T*> rows;  // each context token's key row (all heads)
  std::vector<float> qs(num_heads * head_size), acc(num_heads * head_size);
  std::vector<float> maxes(num_heads), sums(num_heads);
  const int64_t head_tasks = p.kv_tasks * p.q_tasks;
  for (int64_t task = begin; task < end; ++task) {
    // Consecutive tasks: one (request, partition) unit's head groups, then the next
    // partition's (a contiguous run of blocks).
    const int64_t unit = task / head_tasks, head_task = task % head_tasks;
    const int64_t r = p.unit_request(unit), part = unit - p.unit_ptr[r];
    const bool split = p.parts(r) > 1;
    const int64_t h0 = head_task / p.q_tasks * p.kv_per_task, h1 = h0 + p.kv_per_task;
    const int64_t g0 = head_task % p.q_tasks * p.q_per_task, g1 = g0 + p.q_per_task;
    const auto [first, last] = p.partition(r, part);
    const int64_t n = last - first;
    const int64_t tok = p.tok_ptr[r];
    const int32_t* table = p.tables + r * p.max_blocks;
    // Query head qh = h * group + g; its scores at qh * stride, its q and acc at
    // qh * head_size.
    if (n <= 0) {  // nothing to attend: zeros, or a zero sum that the merge skips
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t qh = h * group + g;
          if (split) p.partial(r, part, qh)[1] = 0.f;
          else std::fill_n(p.o_base + tok * p.os0 + qh * p.os1, head_size, 0.f);
        }
      if (split) p.partition_done(r);
      continue;
    }
    const int64_t stride = (n + 15) / 16 * 16;  // floats per head's scores
    if (num_heads * stride > scores_capacity) {
      scores_capacity = num_heads * stride;
      scores = CacheAligned<float>(scores_capacity);
    }
    rows.resize(n);
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t qh = h * group + g;
        std::copy_n(p.q_base + tok * p.qs0 + qh * p.qs1, head_size, qs.data() + qh * head_size);
      }
    // Every context position in [first, last), relative to the start of the key cache
    // (the value cache has the same layout): one table lookup per block, checked by the plan.
    for (int64_t t0 = first - first % p.block_size; t0 < last; t0 += p.block_size) {
      const T* base = k_base + table[t0 / p.block_size] * block_stride;
      const int64_t lo = std::max(t0, first), hi = std::min(t0 + p.block_size, last);
      for (int64_t t = lo; t < hi; ++t) rows[t - first] = base + (t - t0) * token_stride;
    }

    // Heads inner: a batch of key rows serves every head of the task while in L1.
    const T* head_rows[kTile];
    for (int64_t i0 = 0; i0 < n; i0 += kTile) {
      const int64_t m = std::min(kTile, n - i0);
      // The cache is usually out of every CPU cache by the next step (the weights stream
      // through in between), and its rows are scattered by the block table: ask for the
      // next tile's keys and this tile's values while the scores are computed.
      const int64_t m_next = std::min(kTile, n - i0 - kTile);
      for (int64_t h = h0; h < h1; ++h) {
        for (int64_t j = 0; j < m_next; ++j) prefetch_row(rows[i0 + kTile + j] + h * head_size, head_bytes);
        for (int64_t j = 0; j < m; ++j) prefetch_row(rows[i0 + j] + v_offset + h * head_size, head_bytes);
      }
      for (int64_t h = h0; h < h1; ++h) {
        for (int64_t j = 0; j < m; ++j) head_rows[j] = rows[i0 + j] + h * head_size;
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t qh = h * group + g;
          float* out_scores = scores.data() + qh * stride + i0;
#if defined(__AVX2__) && defined(__F16C__)
          if (vectorized) {
            score_batch_avx2(qs.data() + qh * head_size, head_rows, m, head_size, p.scale,
                             out_scores);
            continue;
          }
#endif
          score_tile(qs.data() + qh * head_size, head_rows, m, head_size, p.scale, out_scores);
        }
      }
    }
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t qh = h * group + g;
        float* s = scores.data() + qh * stride;
        float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          s[i] = exp_nonpositive(s[i] - mx);
          sum += s[i];
        }
        maxes[qh] = mx, sums[qh] = sum;
        std::fill_n(acc.data() + qh * head_size, head_size, 0.f);
      }
    // Value rows in runs of kValueRows, each run serving every head of the task.
    for (int64_t j0 = 0; j0 < n; j0 += kValueRows) {
      const int64_t j1 = std::min(n, j0 + kValueRows);
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t g = g0; g < g1; ++g) {
          const int64_t qh = h * group + g;
          const float* prob = scores.data() + qh * stride;
          float* a = acc.data() + qh * head_size;
          const int64_t offset = v_offset + h * head_size;
#if defined(__AVX2__) && defined(__F16C__)
          if (vectorized) {
            accumulate_values_avx2(prob, rows.data(), offset, j0, j1, head_size, a);
            continue;
          }
#endif
          for (int64_t j = j0; j < j1; ++j) axpy_widened(a, prob[j], rows[j] + offset, head_size);
        }
    }
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t qh = h * group + g;
        const float* a = acc.data() + qh * head_size;
        if (split) {
          // Unnormalized: the merge rescales each partition by its max and sum.
          float* partial = p.partial(r, part, qh);
          partial[0] = maxes[qh], partial[1] = sums[qh];
          std::copy_n(a, head_size, partial + 2);
          continue;
        }
        float* o = p.o_base + tok * p.os0 + qh * p.os1;
        const float inv_sum = 1.f / sums[qh];
        for (int64_t i = 0; i < head_size; ++i) o[i] = a[i] * inv_sum;
      }
    if (split) p.partition_done(r);
  }
}

// The table entries a plan's tasks will read, so that the tasks have nothing left to check.
void check_blocks(const DecodeAttentionPlan& p) {
  for (int64_t r = 0; r < p.num_reqs; ++r) {
    const int64_t seq_len = p.len_ptr[r];
    const int64_t first =
        p.sliding_window > 0 ? std::max<int64_t>(0, seq_len - p.sliding_window) : 0;
    for (int64_t b = first / p.block_size; b * p.block_size < seq_len; ++b) {
      const int64_t block = p.tables[r * p.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < p.num_blocks, "block id ", block, " outside the cache");
    }
  }
}

void check_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.device().is_cpu(), "kv_cache must be on the CPU");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, kv_heads, head_size]");
}

}  // namespace

KVWritePlan plan_kv_write(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                          const at::Tensor& slot_mapping) {
  check_float(key, "key");
  check_float(value, "value");
  check_cache(kv_cache);
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.stride(2) == 1 && value.stride(2) == 1,
              "key and value must be [T, kv_heads, head_size], head_size contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  const int64_t heads = kv_cache.size(3), head_size = kv_cache.size(4);
  TORCH_CHECK(key.size(1) == heads && key.size(2) == head_size && value.size(1) == heads &&
                  value.size(2) == head_size,
              "key/value heads or head size differ from the cache's");
  const int64_t n = slot_mapping.numel();
  TORCH_CHECK(n <= key.size(0) && n <= value.size(0), "more slots than key/value rows");
  KVWritePlan p;
  p.cache_type = kv_cache.scalar_type();
  with_cache_type(p.cache_type, [](auto) {});  // rejects other types here
  p.k_base = key.data_ptr<float>();
  p.v_base = value.data_ptr<float>();
  p.ks0 = key.stride(0), p.ks1 = key.stride(1), p.vs0 = value.stride(0), p.vs1 = value.stride(1);
  p.k_cache = kv_cache.data_ptr();
  p.num_slots = kv_cache.size(1) * kv_cache.size(2);
  p.heads = heads, p.head_size = head_size;
  p.slots = slot_mapping.contiguous();
  const int64_t* slot_ptr = p.slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slot_ptr[t] < p.num_slots, "slot ", slot_ptr[t], " outside the KV cache of ",
                p.num_slots);
  return p;
}

void KVWritePlan::run() const {
  with_cache_type(cache_type, [&](auto element) { write_kv<decltype(element)>(*this); });
}

DecodeAttentionPlan plan_decode_attention(at::Tensor& out, const at::Tensor& query,
                                          const at::Tensor& kv_cache,
                                          const at::Tensor& block_table,
                                          const at::Tensor& seq_lens,
                                          const at::Tensor& token_indices, double scale,
                                          int64_t sliding_window, int64_t threads) {
  check_float(out, "out");
  check_float(query, "query");
  check_cache(kv_cache);
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [T, Hq, hd], hd contiguous");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1, "out must be [T, Hq, hd], hd contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
              "block_table must be contiguous int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt, "seq_lens must be int32");
  TORCH_CHECK(token_indices.scalar_type() == at::kLong, "token_indices must be int64");
  DecodeAttentionPlan p;
  p.cache_type = kv_cache.scalar_type();
  with_cache_type(p.cache_type, [](auto) {});
  p.num_reqs = block_table.size(0);
  p.max_blocks = block_table.size(1);
  p.num_heads = query.size(1);
  p.head_size = query.size(2);
  p.num_blocks = kv_cache.size(1);
  p.block_size = kv_cache.size(2);
  p.num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == p.head_size, "head size mismatch between query and cache");
  TORCH_CHECK(p.num_heads % p.num_kv_heads == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(seq_lens.numel() == p.num_reqs && token_indices.numel() == p.num_reqs,
              "one seq_len and token index per block table row expected");
  p.q_base = query.data_ptr<float>();
  p.o_base = out.data_ptr<float>();
  p.kv_base = kv_cache.data_ptr();
  p.tables = block_table.data_ptr<int32_t>();
  p.lens = seq_lens.contiguous();
  p.toks = token_indices.contiguous();
  p.len_ptr = p.lens.data_ptr<int32_t>();
  p.tok_ptr = p.toks.data_ptr<int64_t>();
  p.qs0 = query.stride(0), p.qs1 = query.stride(1), p.os0 = out.stride(0), p.os1 = out.stride(1);
  p.scale = static_cast<float>(scale);
  p.sliding_window = sliding_window;

  p.threads = threads;
  for (int64_t r = 0; r < p.num_reqs; ++r) {
    const int64_t seq_len = p.len_ptr[r], tok = p.tok_ptr[r];
    TORCH_CHECK(seq_len >= 0 && seq_len <= p.max_blocks * p.block_size, "seq_len ", seq_len,
                " does not fit the block table");
    TORCH_CHECK(tok >= 0 && tok < query.size(0) && tok < out.size(0), "token index ", tok,
                " outside the query rows");
  }
  check_blocks(p);
  p.lay_out_tasks(threads);
  return p;
}

void DecodeAttentionPlan::run(int64_t begin, int64_t end) const {
  with_cache_type(cache_type, [&](auto element) {
    attention_tasks<decltype(element)>(*this, begin, end);
  });
}

DecodeAttentionPlan DecodeAttentionPlan::for_layer(const at::Tensor& kv_cache,
                                                   int64_t window) const {
  check_cache(kv_cache);
  TORCH_CHECK(kv_cache.scalar_type() == cache_type && kv_cache.size(1) == num_blocks &&
                  kv_cache.size(2) == block_size && kv_cache.size(3) == num_kv_heads &&
                  kv_cache.size(4) == head_size,
              "every layer's KV cache must have the first layer's shape and type");
  DecodeAttentionPlan p = *this;
  p.kv_base = kv_cache.data_ptr();
  p.sliding_window = window;
  if (window != sliding_window) {  // the window decides the blocks read and the partitions
    check_blocks(p);
    p.lay_out_tasks(threads);
  }
  return p;
}

// One call per attention layer and step: write the step's K/V into the paged cache, then
// attend for the decode rows (prefill rows are left to the caller's SDPA). The cache is
// float32 or, with --kv-cache-dtype, float16 or bfloat16; the arithmetic is float32.
void cache_and_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, at::Tensor& kv_cache,
                                const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                const at::Tensor& seq_lens, const at::Tensor& token_indices,
                                double scale, int64_t sliding_window) {
  plan_kv_write(key, value, kv_cache, slot_mapping).run();
  if (block_table.size(0) == 0) return;
  const DecodeAttentionPlan plan =
      plan_decode_attention(out, query, kv_cache, block_table, seq_lens, token_indices, scale,
                            sliding_window, at::get_num_threads());
  at::parallel_for(0, plan.num_tasks, plan.grain,
                   [&](int64_t begin, int64_t end) { plan.run(begin, end); });
}

}  // namespace kvserve_cpu

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("cache_and_decode_attention", &kvserve_cpu::cache_and_decode_attention);
}
