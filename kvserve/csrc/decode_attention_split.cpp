// Split-K for paged decode attention (vLLM's paged_attention_v2, flash-decoding): a long
// context is cut into partitions that different tasks attend to, each leaving its max
// score, sum of exponentials and unnormalized output; the last partition of a request to
// finish merges them by log-sum-exp, in partition order. One long request then uses
// every core instead of leaving them to its few heads.
//
// Batch and thread invariance (what vLLM's batch-invariant mode asks of its kernels): a
// request's partitions are a function of its own context length alone, never of the
// batch or of the thread count, and the merge adds them in a fixed order. So a request's
// attention output is the same bit for bit whether it decodes alone or in a full batch,
// on one thread or many (one thread runs the partitions in turn and merges them the same
// way). Only the grouping of heads into tasks follows the batch and the threads, and
// each query head's arithmetic is the same in every grouping.

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "decode_attention.h"

namespace kvserve_cpu {
namespace {

// Partitions start on multiples of this many tokens past the context's first position,
// so that their score and value loops run in whole tiles.
constexpr int64_t kPartitionAlign = 32;
// No partition shorter than this, whose fixed costs (the queries, the partials, the
// merge) would show; at most this many, enough for four tasks per thread on two cores
// and, with heads split as well (plan_decode_attention), work for more.
constexpr int64_t kMinPartition = 256, kMaxPartitions = 16;

// Decode attention streams the KV cache from memory: worth both threads at a smaller
// size than the compute-bound kernels' threshold.
constexpr int64_t kMinParallelAttention = 1 << 15;

}  // namespace

int64_t split_k_partitions(int64_t context) {
  const int64_t n = std::clamp<int64_t>(context / kMinPartition, 1, kMaxPartitions);
  // An even count: a single stream's partitions are its tasks, and two threads given an
  // odd count of equal ones wait on each other (3 partitions: one thread does two, and
  // the other idles for a third of the attention).
  return n > 1 ? n & ~int64_t{1} : n;
}

int64_t DecodeAttentionPlan::context_start(int64_t r) const {
  const int64_t seq_len = len_ptr[r];
  return sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
}

int64_t DecodeAttentionPlan::unit_request(int64_t unit) const {
  return std::upper_bound(unit_ptr, unit_ptr + num_reqs + 1, unit) - unit_ptr - 1;
}

std::pair<int64_t, int64_t> DecodeAttentionPlan::partition(int64_t r, int64_t part) const {
  const int64_t seq_len = len_ptr[r], first = context_start(r), n = parts(r);
  if (n == 1) return {first, seq_len};
  // Shares of the request's own context: the same bounds in any batch.
  const auto bound = [&](int64_t i) {
    if (i >= n) return seq_len;
    return first + (seq_len - first) * i / n / kPartitionAlign * kPartitionAlign;
  };
  return {bound(part), bound(part + 1)};
}

void DecodeAttentionPlan::lay_out_tasks(int64_t threads) {
  units = at::empty({num_reqs + 1}, at::kLong);
  int64_t* offsets = units.data_ptr<int64_t>();
  offsets[0] = 0;
  int64_t total_len = 0;
  bool any_split = false;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t context = len_ptr[r] - context_start(r);
    const int64_t n = split_k_partitions(context);
    offsets[r + 1] = offsets[r] + n;
    any_split |= n > 1;
    total_len += context;
  }
  unit_ptr = offsets;
  num_units = offsets[num_reqs];
  // Task size. With many (request, partition) units a task is one unit, all heads: a
  // token's keys for every head are one contiguous row, so the cache streams in order
  // and is read once. With fewer, one task per kv head, and with fewer still
  // (single-stream decode of a short context) one per query head, which re-reads its
  // group's keys and values from cache but gives every thread work. Each query head's
  // arithmetic is the same whatever the grouping.
  const int64_t group = num_heads / num_kv_heads;
  const bool by_unit =
      threads < 2 || num_units >= 4 * threads || (any_split && num_units >= threads);
  kv_per_task = by_unit ? num_kv_heads : 1;
  q_per_task = by_unit || num_units * num_kv_heads >= 4 * threads ? group : 1;
  kv_tasks = num_kv_heads / kv_per_task;
  q_tasks = group / q_per_task;
  num_tasks = num_units * kv_tasks * q_tasks;
  // Keys and values each take head_size multiply-adds per context position and query head.
  const int64_t work_per_task = 2 * kv_per_task * q_per_task * head_size *
                                std::max<int64_t>(1, total_len / std::max<int64_t>(1, num_units));
  grain = std::max<int64_t>(1, kMinParallelAttention / work_per_task);
  partials = at::Tensor(), arrivals = at::Tensor();
  partial_base = nullptr, arrival_ptr = nullptr;
  if (!any_split) return;
  partials = at::empty({num_units * num_heads * (head_size + 2)}, at::kFloat);
  partial_base = partials.data_ptr<float>();
  arrivals = at::zeros({num_reqs}, at::kLong);
  arrival_ptr = arrivals.data_ptr<int64_t>();
}

void DecodeAttentionPlan::partition_done(int64_t r) const {
  // acq_rel: the last arrival sees every other partition's partials.
  const int64_t done = __atomic_add_fetch(arrival_ptr + r, 1, __ATOMIC_ACQ_REL);
  if (done < parts(r) * kv_tasks * q_tasks) return;
  // Zero again for the next run of this plan (the fused step's next layer), which
  // begins after a barrier.
  __atomic_store_n(arrival_ptr + r, 0, __ATOMIC_RELAXED);
  merge(r);
}

void DecodeAttentionPlan::merge(int64_t r) const {
  // Each partition's sum and output rescaled by exp(its max - the overall max): the same
  // softmax as one pass over the whole context, up to float32 rounding. The partitions
  // are added in their order, whichever task arrived last.
  const int64_t num_parts = parts(r);
  std::vector<float> weights(num_parts);
  for (int64_t qh = 0; qh < num_heads; ++qh) {
    float* o = o_base + tok_ptr[r] * os0 + qh * os1;
    float mx = -INFINITY;
    for (int64_t part = 0; part < num_parts; ++part) {
      const float* p = partial(r, part, qh);
      if (p[1] > 0.f) mx = std::max(mx, p[0]);  // a zero sum: an empty partition
    }
    std::fill_n(o, head_size, 0.f);
    if (mx == -INFINITY) continue;  // no context at all: zeros, as without the split
    float total = 0.f;
    for (int64_t part = 0; part < num_parts; ++part) {
      const float* p = partial(r, part, qh);
      weights[part] = p[1] > 0.f ? std::exp(p[0] - mx) : 0.f;
      total += weights[part] * p[1];
    }
    for (int64_t part = 0; part < num_parts; ++part) {
      if (weights[part] == 0.f) continue;
      const float w = weights[part] / total;
      const float* a = partial(r, part, qh) + 2;
      for (int64_t i = 0; i < head_size; ++i) o[i] += w * a[i];
    }
  }
}

}  // namespace kvserve_cpu

namespace {
// What the split-K rule decides for a context of this many tokens (after the window),
// for tests and benchmarks to report.
int64_t decode_attention_partitions(int64_t context) {
  return kvserve_cpu::split_k_partitions(context);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("decode_attention_partitions(int context) -> int", &decode_attention_partitions);
}
