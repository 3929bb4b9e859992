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

#pragma GCC optimize("no-trapping-math")

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_common.h"

namespace kvserve_cpu {
namespace {

constexpr int64_t kScaleBytes = 2;
constexpr int64_t kMinParallelWork = 1 << 15;

inline float row_scale(const int8_t* row, int64_t head_size) {
  c10::BFloat16 s;
  std::memcpy(&s, row + head_size, kScaleBytes);
  return static_cast<float>(s);
}

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

struct Int8DecodePlan {
  const float* q;
  float* out;
  const int8_t* k_cache;
  const int8_t* v_cache;
  const int32_t* table;
  const int32_t* lens;
  const int64_t* toks;
  int64_t max_blocks, block_size, num_heads, num_kv_heads, head_size;
  int64_t qs0, qs1, os0, os1;
  float scale;
  int64_t window;

  // fn(pos, row) for positions [start, end) of request r's kv head, block by block (one
  // table lookup and division per block, not per token).
  template <typename Fn>
  void for_rows(const int8_t* cache, int64_t r, int64_t kv_head, int64_t start, int64_t end,
                Fn&& fn) const {
    const int64_t stride = num_kv_heads * (head_size + kScaleBytes);
    for (int64_t pos = start; pos < end;) {
      const int64_t block = table[r * max_blocks + pos / block_size];
      const int64_t off = pos % block_size;
      const int64_t stop = std::min(end, pos - off + block_size);
      const int8_t* row =
          cache + ((block * block_size + off) * num_kv_heads + kv_head) * (head_size + kScaleBytes);
      for (; pos < stop; ++pos, row += stride) fn(pos, row);
    }
  }

  // One (decode row, kv head) for all the query heads of its group: each key and value
  // row is dequantized once (q * scale, exact) into `row_buf`, then used by every query
  // head; scores in float32, softmax, then the values weighted by it.
  void run(int64_t r, int64_t kv_head, std::vector<float>& scores, std::vector<float>& acc,
           std::vector<float>& row_buf) const {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t seq_len = lens[r];
    const int64_t start = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
    const int64_t n = seq_len - start;
    const float* qh = q + toks[r] * qs0 + kv_head * group * qs1;
    float* oh = out + toks[r] * os0 + kv_head * group * os1;
    if (n <= 0) {
      for (int64_t g = 0; g < group; ++g) std::fill(oh + g * os1, oh + g * os1 + head_size, 0.f);
      return;
    }
    scores.resize(group * n);
    row_buf.resize(head_size);
    float* kf = row_buf.data();
    for_rows(k_cache, r, kv_head, start, seq_len, [&](int64_t pos, const int8_t* k) {
      const float ks = row_scale(k, head_size);
#pragma omp simd
      for (int64_t i = 0; i < head_size; ++i) kf[i] = static_cast<float>(k[i]) * ks;
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qh + g * qs1;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < head_size; ++i) dot += qg[i] * kf[i];
        scores[g * n + pos - start] = dot * scale;
      }
    });
    std::vector<float> sums(group);
    for (int64_t g = 0; g < group; ++g) {
      float* sg = scores.data() + g * n;
      float max_score = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) max_score = std::max(max_score, sg[j]);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        sg[j] = exp_nonpositive(sg[j] - max_score);  // the float kernel's exp
        sum += sg[j];
      }
      sums[g] = sum;
    }
    acc.assign(group * head_size, 0.f);
    for_rows(v_cache, r, kv_head, start, seq_len, [&](int64_t pos, const int8_t* v) {
      const float vs = row_scale(v, head_size);
#pragma omp simd
      for (int64_t i = 0; i < head_size; ++i) kf[i] = static_cast<float>(v[i]) * vs;
      for (int64_t g = 0; g < group; ++g) {
        const float w = scores[g * n + pos - start];
        float* a = acc.data() + g * head_size;
#pragma omp simd
        for (int64_t i = 0; i < head_size; ++i) a[i] += w * kf[i];
      }
    });
    for (int64_t g = 0; g < group; ++g) {
      const float inv = 1.f / sums[g];
      for (int64_t i = 0; i < head_size; ++i) oh[g * os1 + i] = acc[g * head_size + i] * inv;
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
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads");
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  Int8DecodePlan p{query.data_ptr<float>(),
                   out.data_ptr<float>(),
                   kv_cache.data_ptr<int8_t>(),
                   kv_cache.data_ptr<int8_t>() + kv_cache.stride(0),
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
                   sliding_window};
  int64_t total_len = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t len = p.lens[r], tok = p.toks[r];
    TORCH_CHECK(len >= 0 && len <= p.max_blocks * block_size, "seq_len ", len,
                " does not fit the block table");
    TORCH_CHECK(tok >= 0 && tok < query.size(0) && tok < out.size(0), "token index ", tok,
                " outside the query rows");
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b) {
      const int64_t block = p.table[r * p.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " outside the cache");
    }
    total_len += len;
  }
  // A task is one (decode row, kv head): its rows are dequantized once for the group.
  const int64_t num_tasks = num_reqs * num_kv_heads;
  const int64_t work = 2 * head_size * (num_heads / num_kv_heads) *
                       std::max<int64_t>(1, total_len / num_reqs);
  at::parallel_for(0, num_tasks, std::max<int64_t>(1, kMinParallelWork / work),
                   [&](int64_t begin, int64_t end) {
                     std::vector<float> scores, acc, row_buf;
                     for (int64_t t = begin; t < end; ++t)
                       p.run(t / num_kv_heads, t % num_kv_heads, scores, acc, row_buf);
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
