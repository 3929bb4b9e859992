// Paged decode attention as a plan: checked and laid out once from the tensors, then run
// as tasks on whichever threads the caller has. The registered op runs a plan's tasks
// through at::parallel_for; the fused decode step (decode_step.cpp) splits them between
// the threads of its own parallel region. Both run the same task code, so a head's
// output does not depend on who ran it.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

#include "cpu_common.h"

namespace kvserve_cpu {

// The step's keys and values into the paged cache, by slot (negative slots skipped).
//   key, value: [T, Hkv, hd], hd contiguous; kv_cache: [2, num_blocks, block_size, Hkv, hd]
struct KVWritePlan {
  at::ScalarType cache_type;
  const float *k_base, *v_base;
  int64_t ks0, ks1, vs0, vs1;
  void* k_cache;
  int64_t num_slots, heads, head_size;
  at::Tensor slots;  // int64, contiguous
  void run() const;
};
KVWritePlan plan_kv_write(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                          const at::Tensor& slot_mapping);

// Decode attention for D rows, read straight from the paged cache through the block
// table. A task is one request's heads, one kv head with its GQA group, or one query head,
// by how many requests share the threads.
//   out, query: [T, Hq, hd] (only token_indices rows are touched)
//   kv_cache: [2, num_blocks, block_size, Hkv, hd], contiguous
//   block_table: int32 [D, max_blocks]; seq_lens: int32 [D]; token_indices: int64 [D]
//   sliding_window <= 0: no window (else keys at positions >= seq_len - window).
struct DecodeAttentionPlan {
  at::ScalarType cache_type;
  const float* q_base;
  float* o_base;
  const void* kv_base;
  const int32_t *tables, *len_ptr;
  const int64_t* tok_ptr;
  int64_t num_reqs, max_blocks, num_heads, head_size, num_blocks, block_size, num_kv_heads;
  int64_t qs0, qs1, os0, os1;
  float scale;
  int64_t sliding_window;
  int64_t kv_per_task, q_per_task, kv_tasks, q_tasks, num_tasks, grain;
  at::Tensor lens, toks;  // keep the contiguous copies alive
  // Split-K (num_parts > 1): the tasks leave each context partition's max, sum and
  // unnormalized output in `partials`; the task that finishes a request's last partition
  // merges them (no second pass over the threads, no extra barrier).
  int64_t num_parts = 1;
  at::Tensor partials, arrivals;  // float32 partials; int64 partitions done per request
  float* partial_base = nullptr;
  int64_t* arrival_ptr = nullptr;

  // Tasks [begin, end): no checks left to fail, so any thread may run them.
  void run(int64_t begin, int64_t end) const;
  // Request r's partitions merged into its output rows, once all are done.
  void merge(int64_t r) const;
  // Counts one of request r's partitions done; the last one merges.
  void partition_done(int64_t r) const;
  // Request r's context positions [first, last) in partition `part` (after the window).
  std::pair<int64_t, int64_t> partition(int64_t r, int64_t part) const;
  // Partition `part`'s max score, sum of exponentials and unnormalized output for query
  // head qh of request r.
  float* partial(int64_t r, int64_t part, int64_t qh) const {
    return partial_base + ((r * num_parts + part) * num_heads + qh) * (head_size + 2);
  }
  // The partials and counters that num_parts asks for (none when 1).
  void allocate_partials();
  // The same attention over another layer's cache of the same shape and type.
  DecodeAttentionPlan for_layer(const at::Tensor& kv_cache, int64_t window) const;
};
// Context partitions per request: more than one where few requests share the threads
// and the longest context is long enough to be worth splitting.
int64_t split_k_partitions(int64_t num_reqs, int64_t max_context, int64_t threads);
DecodeAttentionPlan plan_decode_attention(at::Tensor& out, const at::Tensor& query,
                                          const at::Tensor& kv_cache,
                                          const at::Tensor& block_table,
                                          const at::Tensor& seq_lens,
                                          const at::Tensor& token_indices, double scale,
                                          int64_t sliding_window, int64_t threads);

}  // namespace kvserve_cpu
