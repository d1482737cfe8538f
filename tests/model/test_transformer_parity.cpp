// Whole-model parity with Hugging Face transformers (fixtures from tools/make_fixtures.py):
// logits (max relative error <= 1e-4), loss, and the gradient of every parameter
// (max relative error <= 1e-3) for Qwen3, Qwen2 and Llama (llama3 rope scaling) in fp32,
// on a batch of unequal lengths that transformers runs padded and opd runs packed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>

#include "common/test_util.h"
#include "core/philox.h"
#include "model/rope.h"
#include "model/safetensors.h"
#include "model/transformer.h"

namespace opd {
namespace {

class Parity : public ::testing::TestWithParam<const char*> {};

std::vector<std::vector<int32_t>> unpack(const Tensor& ids, const Tensor& cu) {
  std::vector<std::vector<int32_t>> seqs;
  for (int64_t b = 0; b + 1 < cu.numel(); ++b) {
    const int32_t* p = ids.data<int32_t>();
    seqs.emplace_back(p + cu.data<int32_t>()[b], p + cu.data<int32_t>()[b + 1]);
  }
  return seqs;
}

// max |a - b| / max |b|: the "max relative error" of the acceptance criteria.
double max_rel(const Tensor& a, const Tensor& b) { return test::compare(a, b).max_rel; }

TEST_P(Parity, LogitsLossAndEveryGradientMatchTransformers) {
  const std::string dir = test::fixture_path(std::string("models/") + GetParam());
  Transformer model = Transformer::load(dir);
  SafetensorsFile expected = SafetensorsFile::open(dir + "/expected.safetensors");

  EXPECT_LE(max_rel(rope_inv_freq(model.config()), expected.get("rope_inv_freq")), 1e-6);

  Batch batch = make_batch(unpack(expected.get("input_ids"), expected.get("cu_seqlens")),
                           model.config().vocab_size);
  ASSERT_EQ(batch.num_sequences(), 3);
  ForwardCache cache;
  Tensor logits = model.forward(batch, &cache);
  Tensor ref_logits = expected.get("logits");
  ASSERT_EQ(logits.shape(), ref_logits.shape());
  test::Diff d = test::compare(logits, ref_logits);
  EXPECT_FALSE(d.has_nan);
  EXPECT_LE(d.max_rel, 1e-4) << "logits rel_l2 " << d.rel_l2;

  Tensor dlogits;
  double loss = causal_lm_loss(batch, logits, &dlogits);
  double ref_loss = expected.get("loss").data<double>()[0];
  EXPECT_NEAR(loss, ref_loss, 1e-5 * std::fabs(ref_loss));

  ModelWeights grads = zeros_weights(model.config());
  model.backward(batch, cache, dlogits, grads);
  int checked = 0;
  double worst_grad = 0;
  std::string worst_name;
  grads.for_each([&](const std::string& name, const Tensor& g) {
    ASSERT_TRUE(expected.contains("grad." + name)) << name;
    Tensor ref = expected.get("grad." + name);
    ASSERT_EQ(g.shape(), ref.shape()) << name;
    test::Diff gd = test::compare(g, ref);
    EXPECT_FALSE(gd.has_nan) << name;
    EXPECT_LE(gd.max_rel, 1e-3) << name << " rel_l2 " << gd.rel_l2;
    if (gd.max_rel > worst_grad) {
      worst_grad = gd.max_rel;
      worst_name = name;
    }
    ++checked;
  });
  // Every gradient in the fixture was compared (none silently skipped).
  int in_fixture = 0;
  for (const auto& n : expected.names()) in_fixture += n.rfind("grad.", 0) == 0;
  EXPECT_EQ(checked, in_fixture);
  std::printf("%s: logits max rel err %.3g, loss %.8f vs %.8f, worst gradient max rel err %.3g (%s), %d gradients\n",
              GetParam(), d.max_rel, loss, ref_loss, worst_grad, worst_name.c_str(), checked);
}

INSTANTIATE_TEST_SUITE_P(Families, Parity, ::testing::Values("qwen3", "qwen2", "llama", "llama_bias", "qwen2_yarn"),
                         [](const auto& info) { return std::string(info.param); });

// Finite differences in float64 through the whole model: the composition of the ops
// (residuals, GQA, q/k norm, tied lm_head) must be differentiated exactly.
TEST_P(Parity, WholeModelFiniteDifferencesInDouble) {
  const std::string dir = test::fixture_path(std::string("models/") + GetParam());
  Transformer f32 = Transformer::load(dir);
  ModelWeights w64 = zeros_weights(f32.config(), DType::F64);
  std::map<std::string, Tensor> src;
  f32.weights().for_each([&](const std::string& n, const Tensor& t) { src[n] = t; });
  w64.for_each([&](const std::string& n, Tensor& t) { t.copy_from(src.at(n).to_dtype(DType::F64)); });
  Transformer model(f32.config(), w64);
  Batch batch = make_batch({{5, 17, 3, 90, 41}, {8}, {60, 2, 33}}, f32.config().vocab_size);

  ForwardCache cache;
  Tensor dlogits;
  causal_lm_loss(batch, model.forward(batch, &cache), &dlogits);
  ModelWeights grads = zeros_weights(f32.config(), DType::F64);
  model.backward(batch, cache, dlogits, grads);

  std::map<std::string, Tensor> g;
  grads.for_each([&](const std::string& n, const Tensor& t) { g[n] = t; });
  int probes = 0;
  uint64_t seed = 5;
  model.weights().for_each([&](const std::string& name, Tensor& p) {
    for (int k = 0; k < 2; ++k) {
      int64_t i = static_cast<int64_t>(philox_u32(seed++, 1, 0) % static_cast<uint32_t>(p.numel()));
      double* v = p.data<double>() + i;
      const double h = 1e-6, orig = *v;
      *v = orig + h;
      double lp = causal_lm_loss(batch, model.forward(batch), nullptr);
      *v = orig - h;
      double lm = causal_lm_loss(batch, model.forward(batch), nullptr);
      *v = orig;
      double numeric = (lp - lm) / (2 * h);
      double analytic = g.at(name).data<double>()[i];
      EXPECT_NEAR(analytic, numeric, 1e-7 + 1e-5 * std::fabs(numeric)) << name << "[" << i << "]";
      ++probes;
    }
  });
  EXPECT_GT(probes, 20);
}

}  // namespace
}  // namespace opd

namespace opd {
namespace {

bool identical(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// Recompute::PerLayer keeps only each layer's input and recomputes the layer in the backward:
// the same ops on the same inputs, so every gradient is bit-identical to the full cache's, and
// the cache holds one [T, H] tensor per layer. Both settings of the flag run here.
TEST_P(Parity, RecomputeGivesBitIdenticalGradients) {
  const std::string dir = test::fixture_path(std::string("models/") + GetParam());
  Transformer model = Transformer::load(dir);
  EXPECT_EQ(model.recompute(), Recompute::Off);
  Batch batch = make_batch({{5, 17, 3, 90, 41, 7}, {8}, {60, 2, 33, 1}}, model.config().vocab_size);
  std::map<std::string, Tensor> grads_by_mode[2];
  Tensor logits_by_mode[2];
  for (int r = 0; r < 2; ++r) {
    model.set_recompute(r ? Recompute::PerLayer : Recompute::Off);
    ForwardCache cache;
    Tensor logits = model.forward(batch, &cache);
    for (const LayerCache& lc : cache.layers) {
      EXPECT_TRUE(lc.x.defined());
      EXPECT_EQ(lc.h1.defined(), r == 0);  // PerLayer: only x is kept
      EXPECT_EQ(lc.act.defined(), r == 0);
    }
    Tensor dlogits;
    causal_lm_loss(batch, logits, &dlogits);
    ModelWeights grads = zeros_weights(model.config());
    model.backward(batch, cache, dlogits, grads);
    logits_by_mode[r] = logits;
    grads.for_each([&](const std::string& n, const Tensor& t) { grads_by_mode[r][n] = t; });
  }
  EXPECT_TRUE(identical(logits_by_mode[0], logits_by_mode[1]));
  ASSERT_EQ(grads_by_mode[0].size(), grads_by_mode[1].size());
  for (const auto& [name, g] : grads_by_mode[0]) {
    EXPECT_TRUE(identical(g, grads_by_mode[1].at(name))) << name;
    EXPECT_GT(test::compare(g, Tensor::zeros(g.shape(), g.dtype())).max_abs, 0) << name;
  }
  // The flag survives Transformer::to (the copy used on another device).
  EXPECT_EQ(model.to(Device::CPU, DType::F32).recompute(), Recompute::PerLayer);
  // Elementwise is a CUDA memory mode; on the CPU it keeps the whole cache (same as Off).
  model.set_recompute(Recompute::Elementwise);
  ForwardCache cache;
  Tensor logits = model.forward(batch, &cache);
  for (const LayerCache& lc : cache.layers) EXPECT_TRUE(lc.act.defined() && lc.h1.defined());
  EXPECT_TRUE(identical(logits, logits_by_mode[0]));
}

TEST(Transformer, RecomputeGranularityNamesRoundTrip) {
  for (Recompute r : {Recompute::Off, Recompute::Elementwise, Recompute::PerLayer})
    EXPECT_EQ(parse_recompute(recompute_name(r)), r);
  EXPECT_EQ(parse_recompute("off"), Recompute::Off);
  try {
    parse_recompute("selective");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'selective' is not one of none, elementwise, layer"),
              std::string::npos) << e.what();
  }
}

TEST(Transformer, ToConvertsEveryWeightAndKeepsTiedEmbeddingsOneTensor) {
  Transformer model = Transformer::load(test::fixture_path("models/qwen3"));
  ASSERT_TRUE(model.weights().tied);
  Transformer f64 = model.to(Device::CPU, DType::F64);
  EXPECT_EQ(f64.dtype(), DType::F64);
  EXPECT_EQ(f64.weights().lm_head.raw(), f64.weights().embed_tokens.raw());
  EXPECT_NE(f64.weights().embed_tokens.raw(), model.weights().embed_tokens.raw());
  std::map<std::string, Tensor> src;
  model.weights().for_each([&](const std::string& n, const Tensor& t) { src[n] = t; });
  int n = 0;
  f64.weights().for_each([&](const std::string& name, const Tensor& t) {
    EXPECT_EQ(t.dtype(), DType::F64) << name;
    EXPECT_TRUE(identical(t.to_dtype(DType::F32), src.at(name))) << name;
    ++n;
  });
  EXPECT_EQ(n, static_cast<int>(src.size()));
  // Mixed dtypes are refused with the parameter's name.
  ModelWeights mixed = model.weights();
  mixed.final_norm = mixed.final_norm.to_dtype(DType::F64);
  try {
    Transformer bad(model.config(), mixed);
    ADD_FAILURE() << "mixed dtypes accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("model.norm.weight"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace opd
