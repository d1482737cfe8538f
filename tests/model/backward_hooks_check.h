// Shared check of the backward's GradsReady hook (model/transformer.h), for the CPU test
// (test_backward_hooks.cpp) and the CUDA one (tests/cuda/test_cuda_backward_hooks.cpp): the
// groups arrive in the documented order, each group's gradients are final when its hook runs
// (a snapshot taken then equals the gradient after the whole backward, bit for bit), groups not
// reported yet are untouched, and a backward with the hook gives the same bits as one without.
// Gradients start from non-zero values (the backward accumulates into them).
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "model/transformer.h"

namespace opd::test {

// The hook's group of a parameter name ("final_norm", "layer <i>", "embedding", "lm_head").
inline std::string hook_group(const std::string& name) {
  if (name == "model.norm.weight") return "final_norm";
  if (name == "model.embed_tokens.weight") return "embedding";
  if (name.rfind("model.layers.", 0) == 0) return "layer " + std::to_string(std::stoi(name.substr(13)));
  return "lm_head";
}

inline bool same_bits_host(const Tensor& a, const Tensor& b) {
  Tensor ha = a.to(Device::CPU), hb = b.to(Device::CPU);
  return ha.shape() == hb.shape() && ha.dtype() == hb.dtype() &&
         std::memcmp(ha.raw(), hb.raw(), ha.nbytes()) == 0;
}

// model on any device; batch and dhidden on the model's device; make_grads() returns fresh
// gradients (same initial non-zero values each call).
template <typename MakeGrads>
void check_backward_hooks(const Transformer& model, const Batch& batch, const Tensor& dhidden,
                          const MakeGrads& make_grads) {
  const int L = static_cast<int>(model.config().num_hidden_layers);
  ForwardCache cache;
  model.forward_hidden(batch, &cache);

  ModelWeights initial = make_grads();
  std::map<std::string, Tensor> start;  // host copies of the initial values
  initial.for_each([&](const std::string& n, const Tensor& t) { start[n] = t.to(Device::CPU).clone(); });

  ModelWeights grads = make_grads();
  std::vector<std::string> order;
  std::map<std::string, Tensor> at_hook;  // name -> host copy when its group was reported
  std::vector<std::string> problems;
  model.backward_hidden(batch, cache, dhidden, grads, [&](const GradsReady& r) {
    const std::string g = r.part == GradsReady::Part::FinalNorm ? "final_norm"
                          : r.part == GradsReady::Part::Embedding ? "embedding"
                                                                   : "layer " + std::to_string(r.layer);
    order.push_back(g);
    grads.for_each([&](const std::string& n, const Tensor& t) {
      if (hook_group(n) == g) at_hook[n] = t.to(Device::CPU).clone();  // synchronous copy
      // A group reported later (other than the tied lm_head/embedding) is untouched so far.
      const std::string later = hook_group(n);
      const bool reported = std::find(order.begin(), order.end(), later) != order.end();
      if (!reported && later != "lm_head" && !same_bits_host(t, start[n]))
        problems.push_back(n + " changed before its group '" + later + "' was reported (at " + g + ")");
    });
  });
  for (const auto& p : problems) ADD_FAILURE() << p;

  std::vector<std::string> want = {"final_norm"};
  for (int li = L - 1; li >= 0; --li) want.push_back("layer " + std::to_string(li));
  want.push_back("embedding");
  EXPECT_EQ(order, want);

  ModelWeights plain = make_grads();
  model.backward_hidden(batch, cache, dhidden, plain);
  std::map<std::string, Tensor> plain_by;
  plain.for_each([&](const std::string& n, const Tensor& t) { plain_by[n] = t; });
  grads.for_each([&](const std::string& n, const Tensor& t) {
    EXPECT_TRUE(same_bits_host(t, plain_by.at(n))) << n << ": the hook changed the result";
    if (hook_group(n) == "lm_head") return;
    ASSERT_TRUE(at_hook.count(n)) << n << " was never reported";
    EXPECT_TRUE(same_bits_host(at_hook.at(n), t)) << n << " changed after its group was reported";
    EXPECT_FALSE(same_bits_host(t, start.at(n))) << n << ": no gradient arrived";
  });
}

}  // namespace opd::test
