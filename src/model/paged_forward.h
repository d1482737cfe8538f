// Incremental transformer forward for generation: one step runs the new tokens of a batch of
// sequences (a prefill chunk of any length, or one decode token each), appends their keys and
// values to the paged KV cache (model/kv_cache.h) and returns the logits of each sequence's
// last new token. Same layer math as Transformer::forward (transformer.h) with attention
// replaced by kv_cache_store + paged_attention, so the logits of a token equal the
// corresponding row of a full forward over the whole sequence (tests/model/test_paged_forward).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "model/kv_cache.h"
#include "model/transformer.h"

namespace opd {

// The new tokens of one step, packed. Sequence b contributes ids at positions
// [context_lens[b], context_lens[b] + len_b): context_lens[b] tokens of it are already in the
// cache; its block table must hold ceil((context + len) / block_size) blocks.
struct PagedStep {
  std::vector<int32_t> ids;                      // all new tokens, sequence after sequence
  std::vector<int32_t> cu_seqlens = {0};         // [B+1] rows of each sequence in ids
  std::vector<int32_t> context_lens;             // [B]
  std::vector<std::span<const int32_t>> block_tables;  // [B], views of the callers' tables

  void add(std::span<const int32_t> new_ids, int64_t context_len,
           std::span<const int32_t> block_table);
  int64_t num_sequences() const { return static_cast<int64_t>(context_lens.size()); }
  int64_t num_tokens() const { return static_cast<int64_t>(ids.size()); }
};

class PagedForward {
 public:
  explicit PagedForward(const Transformer& model);

  // Runs one step: ids validated against the vocabulary (error names sequence, position, value
  // and limit), K/V stored into `cache` at their slots, returns logits f32 [B, V] of the last
  // new token of every sequence (sequences with no new token are not allowed).
  // Memory besides the cache: activations of the step, O(num_tokens x max(H, I, Hq*D)), and
  // B x V logits (never num_tokens x V).
  Tensor step(const PagedStep& step, KvCache& cache) const;

  const Transformer& model() const { return *model_; }

 private:
  const Transformer* model_;
  Tensor inv_freq_;
};

}  // namespace opd
