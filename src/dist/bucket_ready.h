// ZeRO-2 overlap bookkeeping (zero.h): which buckets of a ShardLayout are complete once groups
// of parameters have their final gradients for the current micro-batch. The backward reports
// groups as it finishes them (model/transformer.h GradsReady: final norm, each layer, the
// embedding; the trainer adds the untied lm_head, which the loss finishes before the backward),
// and the trainer reduce-scatters each bucket as soon as every parameter in it is done.
// Every rank sees the same groups in the same order, so every rank reduces the same buckets in
// the same order (what the collectives require); a rank with no micro-batch left replays
// order_for() with zero gradients.
#pragma once

#include <vector>

#include "dist/zero.h"

namespace opd::dist {

class BucketReadiness {
 public:
  // group_of[i] in [0, num_groups): the group of parameter i. Throws InvalidArgument on a size
  // mismatch or a group out of range.
  BucketReadiness(const ShardLayout& layout, std::vector<int> group_of, int num_groups);

  // Group g's gradients are final (once per micro-batch: a repeat throws InvalidArgument).
  // Returns the buckets that became complete, ascending.
  std::vector<int> finish(int group);
  // Buckets not complete yet, ascending (none once every group with parameters was finished).
  std::vector<int> remaining() const;
  // A new micro-batch: nothing is finished.
  void reset();
  // The bucket order of one micro-batch whose groups finish in `groups` order followed by
  // remaining(): what a rank replays for a micro-batch it does not have.
  std::vector<int> order_for(const std::vector<int>& groups) const;

 private:
  std::vector<int> bucket_of_;                // per parameter
  std::vector<std::vector<size_t>> members_;  // per group: its parameters
  std::vector<int> params_in_bucket_;         // per bucket
  std::vector<int> pending_;                  // per bucket: parameters not finished yet
  std::vector<bool> finished_;                // per group
};

}  // namespace opd::dist
