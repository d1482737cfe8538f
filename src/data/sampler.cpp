// Philox-keyed Fisher-Yates permutations and the data cursor's JSON form (see sampler.h).
#include "data/sampler.h"

#include "core/error.h"
#include "core/philox.h"

namespace opd {

Sampler::Sampler(uint64_t num_samples, uint64_t seed, SampleOrder order, std::string dataset_fingerprint)
    : num_samples_(num_samples), seed_(seed), order_(order), fingerprint_(std::move(dataset_fingerprint)) {
  OPD_CHECK(num_samples > 0, InvalidArgument, "sampler over an empty dataset");
  perm_ = permutation(0);
}

std::vector<uint64_t> Sampler::permutation(uint64_t epoch) const {
  std::vector<uint64_t> p(num_samples_);
  for (uint64_t k = 0; k < num_samples_; ++k) p[k] = k;
  if (order_ == SampleOrder::Sequential) return p;
  // Fisher-Yates, j uniform in [0, k] by rejection on 64-bit draws (no modulo bias). Draw d of
  // epoch e is element d of the Philox stream (seed, e), so the order depends on nothing else.
  uint64_t draw = 0;
  auto u64 = [&]() {
    uint64_t hi = philox_u32(seed_, epoch, draw++);
    uint64_t lo = philox_u32(seed_, epoch, draw++);
    return (hi << 32) | lo;
  };
  for (uint64_t k = num_samples_ - 1; k > 0; --k) {
    const uint64_t range = k + 1;
    const uint64_t limit = UINT64_MAX - (UINT64_MAX % range + 1) % range;  // largest multiple of range, minus 1
    uint64_t r;
    do { r = u64(); } while (r > limit);
    std::swap(p[k], p[r % range]);
  }
  return p;
}

uint64_t Sampler::next() {
  if (cursor_.index >= num_samples_) {
    ++cursor_.epoch;
    cursor_.index = 0;
    perm_ = permutation(cursor_.epoch);
  }
  uint64_t i = perm_[cursor_.index];
  ++cursor_.index;
  ++cursor_.consumed;
  return i;
}

nlohmann::json Sampler::save() const {
  return {{"epoch", cursor_.epoch},
          {"index", cursor_.index},
          {"consumed", cursor_.consumed},
          {"seed", seed_},
          {"num_samples", num_samples_},
          {"order", order_ == SampleOrder::Shuffled ? "shuffled" : "sequential"},
          {"dataset_sha256", fingerprint_}};
}

void Sampler::restore(const nlohmann::json& j) {
  OPD_CHECK(j.is_object(), InvalidArgument, "data cursor: expected a JSON object, got ", j.type_name());
  auto u = [&](const char* key) -> uint64_t {
    OPD_CHECK(j.contains(key), InvalidArgument, "data cursor: missing field \"", key, "\"");
    OPD_CHECK(j[key].is_number_unsigned() || (j[key].is_number_integer() && j[key].get<int64_t>() >= 0), InvalidArgument,
              "data cursor: field \"", key, "\" must be a non-negative integer, got ", j[key].dump());
    return j[key].get<uint64_t>();
  };
  auto s = [&](const char* key) -> std::string {
    OPD_CHECK(j.contains(key) && j[key].is_string(), InvalidArgument, "data cursor: field \"", key, "\" must be a string");
    return j[key].get<std::string>();
  };
  const uint64_t seed = u("seed"), n = u("num_samples");
  OPD_CHECK(seed == seed_, InvalidArgument, "data cursor: saved with seed ", seed, ", this run has seed ", seed_);
  OPD_CHECK(n == num_samples_, InvalidArgument, "data cursor: saved for ", n, " samples, this dataset has ", num_samples_);
  const std::string order = s("order");
  const std::string mine = order_ == SampleOrder::Shuffled ? "shuffled" : "sequential";
  OPD_CHECK(order == mine, InvalidArgument, "data cursor: saved with order ", order, ", this run uses ", mine);
  const std::string fp = s("dataset_sha256");
  OPD_CHECK(fp == fingerprint_, InvalidArgument, "data cursor: saved for dataset ", fp, ", this dataset is ", fingerprint_,
            " (the data or its tokenization changed)");
  DataCursor c{u("epoch"), u("index"), u("consumed")};
  OPD_CHECK(c.index <= num_samples_, InvalidArgument, "data cursor: index ", c.index, " is past the ", num_samples_, " samples");
  OPD_CHECK(c.consumed == c.epoch * num_samples_ + c.index, InvalidArgument, "data cursor: consumed ", c.consumed,
            " does not equal epoch ", c.epoch, " x ", num_samples_, " + index ", c.index);
  cursor_ = c;
  perm_ = permutation(cursor_.epoch);
}

}  // namespace opd
