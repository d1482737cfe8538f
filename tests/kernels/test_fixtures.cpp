// Every CPU op in float64 against PyTorch (tests/fixtures/ops/*.safetensors, written by
// tools/make_op_fixtures.py): outputs and gradients agree to ~1e-10 relative.
#include <gtest/gtest.h>

#include "fixture_reader.h"
#include "kernel_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

Fixture load(const std::string& op) { return Fixture(fixture_path("ops/" + op + ".safetensors")); }

::testing::AssertionResult matches(const Tensor& ours, const Tensor& torch) {
  return close(ours, torch, 1e-10, 1e-12, 1e-11);
}

Tensor poisoned_like(const Tensor& t) { return Tensor::poisoned(t.shape(), t.dtype()); }

// Parameter gradients accumulate: start from a random buffer and compare the increment.
Tensor accumulated(const Tensor& like, const std::function<void(Tensor&)>& backward) {
  Tensor start = rand64(like.shape(), 99), acc = start.clone();
  backward(acc);
  return minus(acc, start);
}

TEST(TorchFixtures, Embedding) {
  Fixture f = load("embedding");
  Tensor out = poisoned_like(f["out"]);
  ops::embedding_forward(f["ids"], f["table"], out);
  EXPECT_TRUE(matches(out, f["out"]));
  EXPECT_TRUE(matches(accumulated(f["dtable"], [&](Tensor& d) { ops::embedding_backward(f["ids"], f["dout"], d); }),
                      f["dtable"]));
}

TEST(TorchFixtures, Rmsnorm) {
  Fixture f = load("rmsnorm");
  double eps = f["eps"].data<double>()[0];
  Tensor y = poisoned_like(f["y"]), rstd = poisoned_like(f["rstd"]), dx = poisoned_like(f["dx"]);
  ops::rmsnorm_forward(f["x"], f["w"], eps, y, rstd);
  EXPECT_TRUE(matches(y, f["y"]));
  EXPECT_TRUE(matches(rstd, f["rstd"]));
  Tensor dw = accumulated(f["dw"], [&](Tensor& d) { ops::rmsnorm_backward(f["dy"], f["x"], f["w"], rstd, dx, d); });
  EXPECT_TRUE(matches(dx, f["dx"]));
  EXPECT_TRUE(matches(dw, f["dw"]));
}

TEST(TorchFixtures, Rope) {
  Fixture f = load("rope");
  ASSERT_EQ(f["inv_freq"].dtype(), DType::F32);  // as Hugging Face computes it
  Tensor y = f["x"].clone();
  ops::rope_forward(y, f["positions"], f["inv_freq"]);
  EXPECT_TRUE(matches(y, f["y"]));
  Tensor dx = f["dy"].clone();
  ops::rope_backward(dx, f["positions"], f["inv_freq"]);
  EXPECT_TRUE(matches(dx, f["dx"]));
}

TEST(TorchFixtures, Attention) {
  Fixture f = load("attention");
  double scale = f["scale"].data<double>()[0];
  Tensor out = poisoned_like(f["out"]), lse = poisoned_like(f["lse"]);
  ops::attention_forward(f["q"], f["k"], f["v"], f["cu_seqlens"], scale, out, lse);
  EXPECT_TRUE(matches(out, f["out"]));
  EXPECT_TRUE(matches(lse, f["lse"]));
  Tensor dq = poisoned_like(f["dq"]), dk = poisoned_like(f["dk"]), dv = poisoned_like(f["dv"]);
  ops::attention_backward(f["dout"], f["q"], f["k"], f["v"], out, lse, f["cu_seqlens"], scale, dq, dk, dv);
  EXPECT_TRUE(matches(dq, f["dq"]));
  EXPECT_TRUE(matches(dk, f["dk"]));
  EXPECT_TRUE(matches(dv, f["dv"]));
}

TEST(TorchFixtures, Swiglu) {
  Fixture f = load("swiglu");
  Tensor out = poisoned_like(f["out"]), dgate = poisoned_like(f["dgate"]), dup = poisoned_like(f["dup"]);
  ops::swiglu_forward(f["gate"], f["up"], out);
  ops::swiglu_backward(f["dout"], f["gate"], f["up"], dgate, dup);
  EXPECT_TRUE(matches(out, f["out"]));
  EXPECT_TRUE(matches(dgate, f["dgate"]));
  EXPECT_TRUE(matches(dup, f["dup"]));
}

TEST(TorchFixtures, Linear) {
  Fixture f = load("linear");
  Tensor y = poisoned_like(f["y"]), dx = poisoned_like(f["dx"]);
  ops::linear_forward(f["x"], f["w"], f["bias"], y);
  EXPECT_TRUE(matches(y, f["y"]));
  Tensor db0 = rand64(f["dbias"].shape(), 98), db = db0.clone();
  Tensor dw = accumulated(f["dw"], [&](Tensor& d) { ops::linear_backward(f["dy"], f["x"], f["w"], dx, d, db); });
  EXPECT_TRUE(matches(dx, f["dx"]));
  EXPECT_TRUE(matches(dw, f["dw"]));
  EXPECT_TRUE(matches(minus(db, db0), f["dbias"]));
}

TEST(TorchFixtures, CrossEntropy) {
  Fixture f = load("cross_entropy");
  Tensor losses = poisoned_like(f["losses"]), lse = poisoned_like(f["lse"]);
  int64_t valid = ops::cross_entropy_forward(f["logits"], f["targets"], losses, lse);
  EXPECT_EQ(valid, f["num_valid"].data<int64_t>()[0]);
  EXPECT_TRUE(matches(losses, f["losses"]));
  EXPECT_TRUE(matches(lse, f["lse"]));
  Tensor dlogits = poisoned_like(f["dlogits"]);
  ops::cross_entropy_backward(f["logits"], f["targets"], lse, f["scale"].data<double>()[0], dlogits);
  EXPECT_TRUE(matches(dlogits, f["dlogits"]));
}

}  // namespace
}  // namespace opd::test
