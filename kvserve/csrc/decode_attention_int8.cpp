// Paged decode attention over an int8 KV cache (--kv-cache-dtype int8, llama.cpp's q8_0
// equivalent): the step's K/V quantized into the cache, then each decode row's attention
// read straight from it through the block table. Registered as
// torch.ops.kvserve.cache_and_decode_attention_int8.
//
// Layout (kvserve/attention/backends/kv_cache_codec.py owns it): int8 [2, num_blocks,
// block_size, num_kv_heads, head_size + 2]; each (token, head) row is head_size int8
// values followed by its bfloat16 scale. A row's scale is its own max |x| / 127, so a row
// never changes once written: a token's keys read the same whatever was written after it
// (chunked prefill and prefix caching stay exact), and the dequantized value q * scale
// (8 bits times 8 bits) is exact in float32, here and in the torch path alike.
//
// The kernel widens a tile of 16 rows to float32 once (vpmovsxbd + vcvtdq2ps) for every
// query head of the kv head's group, and applies each row's scale once: to the row's
// q.k sum for keys, to the softmax weight for values. Half the bytes of a float16 cache
// then means less time, not more: the old loop dequantized each row into a buffer and
// reduced every (row, head) dot product on its own.
//
// Split-K: a request's context is cut at multiples of kPartition positions, whatever the
// batch or the thread count, each partition a task leaving its max score, sum of
// exponentials and unnormalized output; the last of a request's tasks to finish merges
// them by log-sum-exp. A request's output is then the same in any batch and on any
// number of threads, and one long request still uses every thread.

#pragma GCC optimize("no-trapping-math")

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"
#include "decode_attention_int8_tiles.h"

namespace kvserve_cpu {
namespace {

using namespace int8_kv;  // the tile kernels (decode_attention_int8_tiles.h)

constexpr int64_t kMinParallelWork = 1 << 15;
// Context positions per split-K partition: long enough that a partition's fixed costs
// (its queries, partials and merge) stay ~1% of its rows' work, short enough that an
// 8k context gives two threads 16 tasks; a multiple of the usual block sizes.
constexpr int64_t kPartition = 512;

// One row quantized as the torch path does (kv_cache_codec.quantize): the scale is bfloat16(amax /
// 127) rounded to nearest even, each value round-half-even(x / scale) clamped to +-127, a
// zero scale (an all-zero or vanishing row) storing zeros.
inline void quantize_row(const float* x, int64_t n, int8_t* dst) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const c10::BFloat16 s(amax / 127.f);
  const float scale = static_cast<float>(s);
  for (int64_t i = 0; i < n; ++i) {
    const float q = scale > 0.f ? std::nearbyint(x[i] / scale) : 0.f;
    dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
  }
  std::memcpy(dst + n, &s, kScaleBytes);
}

void write_kv_int8(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                   const at::Tensor& slot_mapping) {
  const int64_t heads = kv_cache.size(3), head_size = kv_cache.size(4) - kScaleBytes;
  const int64_t row = heads * (head_size + kScaleBytes);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  int8_t* k_cache = kv_cache.data_ptr<int8_t>();
  int8_t* v_cache = k_cache + num_slots * row;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1);
  for (int64_t t = 0; t < slot_mapping.numel(); ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "slot ", slot, " outside the KV cache");
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t dst = slot * row + h * (head_size + kScaleBytes);
      quantize_row(kp + t * ks0 + h * ks1, head_size, k_cache + dst);
      quantize_row(vp + t * vs0 + h * vs1, head_size, v_cache + dst);
    }
  }
}

// One task: request r's query heads of kv heads [h0, h1) over context positions
// [first, last). slot >= 0: a partition of a split request, left in the partials for
// the request's merge number `merge`.
struct Int8Task {
  int64_t r, first, last, h0, h1, slot, merge;
};

// A thread's buffers, reused across its tasks.
struct Int8Scratch {
  explicit Int8Scratch(int64_t head_size) : f(kTile * head_size) {}
  CacheAligned<float> f;  // a tile's rows as float32
  std::vector<const int8_t*> rows;
  std::vector<float> scores, acc, maxes, sums;
  float scales[kTile], tile_out[kTile], w[kTile];
};

struct Int8DecodePlan {
  const float* q;
  float* out;
  const int8_t* k_cache;
  int64_t v_offset;  // bytes from a key row to its value row
  const int32_t* table;
  const int32_t* lens;
  const int64_t* toks;
  int64_t max_blocks, block_size, num_heads, num_kv_heads, head_size;
  int64_t qs0, qs1, os0, os1;
  float scale;
  float* partials;  // per slot: each query head's max, sum and unnormalized output

  float* partial(int64_t slot, int64_t qh) const {
    return partials + (slot * num_heads + qh) * (head_size + 2);
  }

  void run(const Int8Task& t, Int8Scratch& s) const {
    const int64_t hs = head_size, group = num_heads / num_kv_heads;
    const int64_t row_bytes = hs + kScaleBytes, token_stride = num_kv_heads * row_bytes;
    const int64_t n = t.last - t.first, heads = (t.h1 - t.h0) * group, qh0 = t.h0 * group;
    const Simd simd = simd_for(hs);
    // Each position's key row for kv head 0: one table lookup per block (checked by the
    // caller), not per row.
    s.rows.resize(n);
    const int32_t* blocks = table + t.r * max_blocks;
    for (int64_t pos = t.first; pos < t.last;) {
      const int64_t off = pos % block_size, stop = std::min(t.last, pos - off + block_size);
      const int8_t* row = k_cache + (blocks[pos / block_size] * block_size + off) * token_stride;
      for (; pos < stop; ++pos, row += token_stride) s.rows[pos - t.first] = row;
    }
    const float* qrow = q + toks[t.r] * qs0;
    const int8_t* const* rows = s.rows.data();
    // Local head l = (h - h0) * group + g: its scores at l * n, its output at l * hs.
    s.scores.resize(heads * n);
    for (int64_t i0 = 0; i0 < n; i0 += kTile) {
      const int64_t m = std::min(kTile, n - i0);
      prefetch_rows(rows + i0 + m, std::min(kTile, n - i0 - m), t.h0 * row_bytes,
                    (t.h1 - t.h0) * row_bytes);
      prefetch_rows(rows + i0, m, v_offset + t.h0 * row_bytes, (t.h1 - t.h0) * row_bytes);
      for (int64_t h = t.h0; h < t.h1; ++h) {
        widen_tile(rows + i0, h * row_bytes, m, hs, scale, simd, s.f.data(), s.scales);
        for (int64_t g = 0; g < group; ++g) {
          score_tile(qrow + (h * group + g) * qs1, s.f.data(), s.scales, hs, simd, s.tile_out);
          std::copy_n(s.tile_out, m, s.scores.data() + (h * group + g - qh0) * n + i0);
        }
      }
    }
    s.maxes.resize(heads);
    s.sums.resize(heads);
    for (int64_t l = 0; l < heads; ++l) {
      float* sl = s.scores.data() + l * n;
      float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
      for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sl[i]);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) {
        sl[i] = exp_nonpositive(sl[i] - mx);  // the float kernel's exp
        sum += sl[i];
      }
      s.maxes[l] = mx, s.sums[l] = sum;
    }
    s.acc.assign(heads * hs, 0.f);
    for (int64_t i0 = 0; i0 < n; i0 += kTile) {
      const int64_t m = std::min(kTile, n - i0);
      prefetch_rows(rows + i0 + m, std::min(kTile, n - i0 - m), v_offset + t.h0 * row_bytes,
                    (t.h1 - t.h0) * row_bytes);
      for (int64_t h = t.h0; h < t.h1; ++h) {
        widen_tile(rows + i0, v_offset + h * row_bytes, m, hs, 1.f, simd, s.f.data(), s.scales);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t l = h * group + g - qh0;
          // A row's scale rides on its weight: one multiply per row, not per value.
          for (int64_t j = 0; j < m; ++j) s.w[j] = s.scores[l * n + i0 + j] * s.scales[j];
          accumulate_tile(s.w, s.f.data(), m, hs, simd, s.acc.data() + l * hs);
        }
      }
    }
    for (int64_t l = 0; l < heads; ++l) {
      const float* a = s.acc.data() + l * hs;
      if (t.slot >= 0) {
        float* pl = partial(t.slot, qh0 + l);
        pl[0] = s.maxes[l], pl[1] = s.sums[l];
        std::copy_n(a, hs, pl + 2);
        continue;
      }
      float* o = out + toks[t.r] * os0 + (qh0 + l) * os1;
      const float inv = 1.f / s.sums[l];
      for (int64_t i = 0; i < hs; ++i) o[i] = a[i] * inv;
    }
  }

  // Request r's `count` partitions from slot0 on, each rescaled by exp(its max - the
  // overall max): the softmax of one pass over the whole context, up to float32
  // rounding. Every partition holds at least one position, so every sum is >= 1.
  void merge(int64_t r, int64_t slot0, int64_t count, std::vector<float>& weights) const {
    weights.resize(count);
    for (int64_t qh = 0; qh < num_heads; ++qh) {
      float mx = -INFINITY;
      for (int64_t i = 0; i < count; ++i) mx = std::max(mx, partial(slot0 + i, qh)[0]);
      float total = 0.f;
      for (int64_t i = 0; i < count; ++i) {
        const float* pi = partial(slot0 + i, qh);
        weights[i] = std::exp(pi[0] - mx);
        total += weights[i] * pi[1];
      }
      float* o = out + toks[r] * os0 + qh * os1;
      std::fill_n(o, head_size, 0.f);
      for (int64_t i = 0; i < count; ++i) {
        const float w = weights[i] / total;
        const float* a = partial(slot0 + i, qh) + 2;
        for (int64_t k = 0; k < head_size; ++k) o[k] += w * a[k];
      }
    }
  }
};

}  // namespace

// One call per attention layer and step: quantize the step's K/V into the int8 cache
// (slot -1 = skip), then attend for the decode rows (prefill rows are left to the
// caller's torch path, which dequantizes the gathered blocks).
void cache_and_decode_attention_int8(at::Tensor& out, const at::Tensor& query,
                                     const at::Tensor& key, const at::Tensor& value,
                                     at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                                     const at::Tensor& block_table, const at::Tensor& seq_lens,
                                     const at::Tensor& token_indices, double scale,
                                     int64_t sliding_window) {
  TORCH_CHECK(kv_cache.scalar_type() == at::kChar && kv_cache.dim() == 5 &&
                  kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous int8 [2, blocks, block_size, heads, head_size + 2]");
  const int64_t head_size = kv_cache.size(4) - kScaleBytes;
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&query, &key, &value, &out})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->stride(2) == 1 &&
                    t->size(2) == head_size,
                "query, key, value and out must be float32 [tokens, heads, head_size] with "
                "unit stride on the last dim");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && value.size(1) == kv_cache.size(3),
              "key/value heads must match the cache's");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() <= key.size(0),
              "slot_mapping must be contiguous int64 with at most one slot per key row");
  write_kv_int8(key, value, kv_cache, slot_mapping);
  const int64_t num_reqs = block_table.size(0);
  if (num_reqs == 0) return;
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  token_indices.scalar_type() == at::kLong && token_indices.is_contiguous() &&
                  seq_lens.numel() == num_reqs && token_indices.numel() == num_reqs,
              "block_table int32 [D, blocks], seq_lens int32 [D], token_indices int64 [D]");
  const int64_t num_heads = query.size(1), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(query.size(1) == out.size(1) && num_heads % num_kv_heads == 0,
              "query heads must equal out's and be a multiple of kv heads");
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  Int8DecodePlan p{query.data_ptr<float>(),
                   out.data_ptr<float>(),
                   kv_cache.data_ptr<int8_t>(),
                   kv_cache.stride(0),
                   block_table.data_ptr<int32_t>(),
                   seq_lens.data_ptr<int32_t>(),
                   token_indices.data_ptr<int64_t>(),
                   block_table.size(1),
                   block_size,
                   num_heads,
                   num_kv_heads,
                   head_size,
                   query.stride(0),
                   query.stride(1),
                   out.stride(0),
                   out.stride(1),
                   static_cast<float>(scale),
                   nullptr};
  // Each request's context cut at multiples of kPartition (its own positions only, so
  // the cut does not depend on the batch or the threads); a request of several
  // partitions gets that many partial slots and a merge.
  std::vector<Int8Task> items;
  struct Merge {
    int64_t r, slot0, count;
  };
  std::vector<Merge> merges;
  int64_t num_slots = 0, total_len = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t len = p.lens[r], tok = p.toks[r];
    TORCH_CHECK(len >= 0 && len <= p.max_blocks * block_size, "seq_len ", len,
                " does not fit the block table");
    TORCH_CHECK(tok >= 0 && tok < query.size(0) && tok < out.size(0), "token index ", tok,
                " outside the query rows");
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
    for (int64_t b = first / block_size; b * block_size < len; ++b) {
      const int64_t block = p.table[r * p.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " outside the cache");
    }
    if (len <= first) {  // nothing to attend: zeros
      for (int64_t qh = 0; qh < num_heads; ++qh)
        std::fill_n(p.out + tok * p.os0 + qh * p.os1, head_size, 0.f);
      continue;
    }
    const int64_t p0 = first / kPartition, count = (len - 1) / kPartition - p0 + 1;
    for (int64_t i = 0; i < count; ++i)
      items.push_back({r, std::max(first, (p0 + i) * kPartition),
                       std::min(len, (p0 + i + 1) * kPartition), 0, num_kv_heads,
                       count > 1 ? num_slots + i : -1,
                       count > 1 ? static_cast<int64_t>(merges.size()) : -1});
    if (count > 1) merges.push_back({r, num_slots, count}), num_slots += count;
    total_len += len - first;
  }
  if (items.empty()) return;
  // Few partitions: one task per kv head too, so that every thread has work. Which
  // thread attends a head changes no value.
  const int64_t threads = at::get_num_threads();
  const int64_t kv_per_task =
      static_cast<int64_t>(items.size()) >= 4 * threads ? num_kv_heads : 1;
  std::vector<Int8Task> tasks;
  tasks.reserve(items.size() * (num_kv_heads / kv_per_task));
  for (const Int8Task& item : items)
    for (int64_t h = 0; h < num_kv_heads; h += kv_per_task)
      tasks.push_back({item.r, item.first, item.last, h, h + kv_per_task, item.slot, item.merge});
  const int64_t kv_tasks = num_kv_heads / kv_per_task;
  std::vector<int64_t> arrivals(merges.size(), 0);
  CacheAligned<float> partials(num_slots * num_heads * (head_size + 2));
  p.partials = partials.data();
  const int64_t work = 2 * head_size * (num_heads / num_kv_heads) * kv_per_task *
                       std::max<int64_t>(1, total_len / static_cast<int64_t>(items.size()));
  at::parallel_for(0, static_cast<int64_t>(tasks.size()),
                   std::max<int64_t>(1, kMinParallelWork / work), [&](int64_t begin, int64_t end) {
                     Int8Scratch scratch(head_size);
                     std::vector<float> weights;
                     for (int64_t t = begin; t < end; ++t) {
                       p.run(tasks[t], scratch);
                       const int64_t m = tasks[t].merge;
                       // The request's last task to finish merges (no second parallel
                       // region, whose start costs a scheduling round on a busy machine);
                       // acq_rel: it sees every other task's partials.
                       if (m >= 0 && __atomic_add_fetch(&arrivals[m], 1, __ATOMIC_ACQ_REL) ==
                                         merges[m].count * kv_tasks)
                         p.merge(merges[m].r, merges[m].slot0, merges[m].count, weights);
                     }
                   });
}

}  // namespace kvserve_cpu

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "cache_and_decode_attention_int8(Tensor(a!) out, Tensor query, Tensor key, "
      "Tensor value, Tensor(b!) kv_cache, Tensor slot_mapping, Tensor block_table, "
      "Tensor seq_lens, Tensor token_indices, float scale, int sliding_window) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("cache_and_decode_attention_int8", &kvserve_cpu::cache_and_decode_attention_int8);
}
