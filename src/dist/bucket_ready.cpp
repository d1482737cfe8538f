// Bucket completion from finished parameter groups (bucket_ready.h).
#include "dist/bucket_ready.h"

#include <algorithm>

namespace opd::dist {

BucketReadiness::BucketReadiness(const ShardLayout& layout, std::vector<int> group_of,
                                 int num_groups) {
  OPD_CHECK(group_of.size() == layout.params.size(), InvalidArgument, "bucket readiness: ",
            group_of.size(), " groups for ", layout.params.size(), " parameters");
  OPD_CHECK(num_groups >= 1, InvalidArgument, "bucket readiness: ", num_groups, " groups");
  members_.resize(num_groups);
  params_in_bucket_.assign(layout.buckets.size(), 0);
  for (size_t i = 0; i < group_of.size(); ++i) {
    OPD_CHECK(group_of[i] >= 0 && group_of[i] < num_groups, InvalidArgument,
              "bucket readiness: parameter ", i, " is in group ", group_of[i], " of ", num_groups);
    members_[group_of[i]].push_back(i);
    bucket_of_.push_back(layout.params[i].bucket);
    ++params_in_bucket_[layout.params[i].bucket];
  }
  reset();
}

void BucketReadiness::reset() {
  pending_ = params_in_bucket_;
  finished_.assign(members_.size(), false);
}

std::vector<int> BucketReadiness::finish(int group) {
  OPD_CHECK(group >= 0 && group < static_cast<int>(members_.size()), InvalidArgument,
            "bucket readiness: group ", group, " of ", members_.size());
  OPD_CHECK(!finished_[group], InvalidArgument, "bucket readiness: group ", group,
            " finished twice in one micro-batch");
  finished_[group] = true;
  std::vector<int> complete;
  for (size_t i : members_[group])
    if (--pending_[bucket_of_[i]] == 0) complete.push_back(bucket_of_[i]);
  std::sort(complete.begin(), complete.end());
  return complete;
}

std::vector<int> BucketReadiness::remaining() const {
  std::vector<int> out;
  for (size_t b = 0; b < pending_.size(); ++b)
    if (pending_[b] > 0) out.push_back(static_cast<int>(b));
  return out;
}

std::vector<int> BucketReadiness::order_for(const std::vector<int>& groups) const {
  BucketReadiness sim = *this;
  sim.reset();
  std::vector<int> order;
  for (int g : groups)
    for (int b : sim.finish(g)) order.push_back(b);
  for (int b : sim.remaining()) order.push_back(b);
  return order;
}

}  // namespace opd::dist
