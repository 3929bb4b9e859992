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
// table. A task is one (request, context partition) unit's heads, one kv head with its
// GQA group, or one query head, by how many units share the threads.
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
  int64_t threads;  // the team the tasks were sized for
  int64_t kv_per_task, q_per_task, kv_tasks, q_tasks, num_tasks, grain;
  at::Tensor lens, toks;  // keep the contiguous copies alive
  // Split-K (decode_attention_split.cpp): request r's context is cut into parts(r)
  // partitions, units [unit_ptr[r], unit_ptr[r + 1]) of the plan, a count that depends on
  // its own context length only. The tasks of a split request leave each partition's
  // max, sum and unnormalized output in `partials`; the task that finishes its last
  // partition merges them (no second pass over the threads, no extra barrier).
  at::Tensor units;  // int64 [num_reqs + 1]
  const int64_t* unit_ptr = nullptr;
  int64_t num_units = 0;
  at::Tensor partials, arrivals;  // float32 partials; int64 partitions done per request
  float* partial_base = nullptr;
  int64_t* arrival_ptr = nullptr;

  // Tasks [begin, end): no checks left to fail, so any thread may run them.
  void run(int64_t begin, int64_t end) const;
  // Request r's partitions merged into its output rows, once all are done.
  void merge(int64_t r) const;
  // Counts one of request r's partitions done; the last one merges.
  void partition_done(int64_t r) const;
  int64_t parts(int64_t r) const { return unit_ptr[r + 1] - unit_ptr[r]; }
  // The request whose partitions include this unit.
  int64_t unit_request(int64_t unit) const;
  // Request r's first context position (after the window).
  int64_t context_start(int64_t r) const;
  // Request r's context positions [first, last) in partition `part` (after the window).
  std::pair<int64_t, int64_t> partition(int64_t r, int64_t part) const;
  // Partition `part`'s max score, sum of exponentials and unnormalized output for query
  // head qh of request r.
  float* partial(int64_t r, int64_t part, int64_t qh) const {
    return partial_base + ((unit_ptr[r] + part) * num_heads + qh) * (head_size + 2);
  }
  // The partitions, the tasks for `threads` and the partials they need (none when no
  // request is split), from the lengths and the window.
  void lay_out_tasks(int64_t threads);
  // The same attention over another layer's cache of the same shape and type.
  DecodeAttentionPlan for_layer(const at::Tensor& kv_cache, int64_t window) const;
};
// Context partitions of a request whose context (after the window) is this many tokens:
// more than one where it is long enough to be worth splitting, whatever the batch and the
// threads.
int64_t split_k_partitions(int64_t context);
DecodeAttentionPlan plan_decode_attention(at::Tensor& out, const at::Tensor& query,
                                          const at::Tensor& kv_cache,
                                          const at::Tensor& block_table,
                                          const at::Tensor& seq_lens,
                                          const at::Tensor& token_indices, double scale,
                                          int64_t sliding_window, int64_t threads);

}  // namespace kvserve_cpu
