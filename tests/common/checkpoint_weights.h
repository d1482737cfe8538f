// The weights a training run saved, for tests that compare runs: one checkpoint's
// model.safetensors as host tensors, the newest checkpoint of a run directory, and a gtest
// check that two such sets are equal bit for bit (resume, overlap and memory-option
// invariants: DESIGN.md invariant 2).
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>

#include "core/tensor.h"
#include "model/safetensors.h"
#include "train/checkpoint.h"  // list_checkpoints

namespace opd::test {

// CHECKPOINT_DIR/model.safetensors by tensor name, copied out of the mapping.
inline std::map<std::string, Tensor> checkpoint_weights(const std::string& checkpoint_dir) {
  SafetensorsFile f = SafetensorsFile::open(checkpoint_dir + "/model.safetensors");
  std::map<std::string, Tensor> m;
  for (const auto& n : f.names()) m[n] = f.get(n).clone();
  return m;
}

// The weights of the newest checkpoint under RUN_DIR/checkpoints; none (and a test failure)
// when the run saved no checkpoint.
inline std::map<std::string, Tensor> final_weights(const std::string& run_dir) {
  auto list = list_checkpoints(run_dir + "/checkpoints");
  EXPECT_FALSE(list.empty()) << run_dir;
  if (list.empty()) return {};
  return checkpoint_weights(list.back());
}

// Same tensor names, and every tensor the same bytes; a failure names the tensor and `what`.
inline void expect_bitwise_equal(const std::map<std::string, Tensor>& a,
                                 const std::map<std::string, Tensor>& b,
                                 const std::string& what = "") {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, t] : a) {
    const auto it = b.find(name);
    ASSERT_NE(it, b.end()) << name << " is missing " << what;
    const Tensor& u = it->second;
    ASSERT_EQ(t.nbytes(), u.nbytes()) << name << " " << what;
    EXPECT_EQ(0, std::memcmp(t.raw(), u.raw(), t.nbytes())) << name << " differs " << what;
  }
}

}  // namespace opd::test
