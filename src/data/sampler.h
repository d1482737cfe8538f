// Deterministic, resumable sample order: epoch e visits the samples in a permutation drawn by
// Fisher-Yates from Philox4x32 keyed by (seed, stream = e), so every machine and every resumed run
// computes the same order. A DataCursor (epoch, position in that epoch's permutation, samples
// consumed) is all the state: saved with a checkpoint and restored, the run continues with exactly
// the samples it would have seen (DESIGN.md invariant 2).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace opd {

struct DataCursor {
  uint64_t epoch = 0;     // current epoch (0-based)
  uint64_t index = 0;     // position in epoch `epoch`'s permutation of the next sample
  uint64_t consumed = 0;  // samples handed out since the start of training, over all epochs
};

enum class SampleOrder { Shuffled, Sequential };

class Sampler {
 public:
  // num_samples > 0. dataset_fingerprint identifies the data (Dataset::fingerprint()) so that a
  // cursor is never restored onto different data.
  Sampler(uint64_t num_samples, uint64_t seed, SampleOrder order, std::string dataset_fingerprint);

  uint64_t next();  // the next sample index; moves to the next epoch after the last one
  const DataCursor& cursor() const { return cursor_; }

  // The order of epoch `epoch` (a permutation of 0..num_samples-1).
  std::vector<uint64_t> permutation(uint64_t epoch) const;

  // {"epoch", "index", "consumed", "seed", "num_samples", "order", "dataset_sha256"}.
  nlohmann::json save() const;
  // Restores the cursor; seed, num_samples, order and dataset_sha256 must match this sampler
  // (an InvalidArgument error names the field and both values otherwise).
  void restore(const nlohmann::json& saved);

 private:
  uint64_t num_samples_, seed_;
  SampleOrder order_;
  std::string fingerprint_;
  DataCursor cursor_;
  std::vector<uint64_t> perm_;  // permutation of cursor_.epoch (empty for Sequential)
};

}  // namespace opd
