// Split-K for paged decode attention (vLLM's paged_attention_v2, flash-decoding): where
// few requests share the threads, each long context is cut into partitions that
// different threads attend to, each leaving its max score, sum of exponentials and
// unnormalized output; the last partition of a request to finish merges them by
// log-sum-exp. One long request then
// uses every core instead of leaving them to its few heads.

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "decode_attention.h"

namespace kvserve_cpu {
namespace {

// Partitions start on multiples of this many tokens, so that their score and value loops
// run in whole tiles.
constexpr int64_t kPartitionAlign = 32;

int64_t decode_attention_partitions(int64_t num_reqs, int64_t max_context, int64_t threads) {
  return split_k_partitions(num_reqs, max_context, threads);
}

}  // namespace

int64_t split_k_partitions(int64_t num_reqs, int64_t max_context, int64_t threads) {
  // Enough tasks for every thread to take several (evening out the tails), none shorter
  // than kMinPartition tokens, whose fixed costs (the queries, the merge) would show.
  constexpr int64_t kTasksPerThread = 4, kMinPartition = 256;
  if (threads < 2 || num_reqs < 1 || num_reqs >= kTasksPerThread * threads) return 1;
  const int64_t wanted = (kTasksPerThread * threads + num_reqs - 1) / num_reqs;
  return std::max<int64_t>(1, std::min(wanted, max_context / kMinPartition));
}

std::pair<int64_t, int64_t> DecodeAttentionPlan::partition(int64_t r, int64_t part) const {
  const int64_t seq_len = len_ptr[r];
  const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
  if (num_parts == 1) return {first, seq_len};
  // Every request is cut into the same number of partitions, each a share of its own
  // context, so a ragged batch's partitions stay balanced within a request.
  const auto bound = [&](int64_t i) {
    if (i >= num_parts) return seq_len;
    return first + (seq_len - first) * i / num_parts / kPartitionAlign * kPartitionAlign;
  };
  return {bound(part), bound(part + 1)};
}

void DecodeAttentionPlan::allocate_partials() {
  if (num_parts == 1) return;
  partials = at::empty({num_reqs * num_parts * num_heads * (head_size + 2)}, at::kFloat);
  partial_base = partials.data_ptr<float>();
  arrivals = at::zeros({num_reqs}, at::kLong);
  arrival_ptr = arrivals.data_ptr<int64_t>();
}

void DecodeAttentionPlan::partition_done(int64_t r) const {
  // acq_rel: the last arrival sees every other partition's partials.
  const int64_t done = __atomic_add_fetch(arrival_ptr + r, 1, __ATOMIC_ACQ_REL);
  if (done < num_parts * kv_tasks * q_tasks) return;
  // Zero again for the next run of this plan (the fused step's next layer), which
  // begins after a barrier.
  __atomic_store_n(arrival_ptr + r, 0, __ATOMIC_RELAXED);
  merge(r);
}

void DecodeAttentionPlan::merge(int64_t r) const {
  // Each partition's sum and output rescaled by exp(its max - the overall max): the same
  // softmax as one pass over the whole context, up to float32 rounding.
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

// What the split-K rule decides, for tests and benchmarks to report.
TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("decode_attention_partitions(int num_reqs, int max_context, int threads) -> int",
        &kvserve_cpu::decode_attention_partitions);
}
