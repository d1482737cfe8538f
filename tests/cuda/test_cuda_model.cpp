// Whole model on CUDA (model/transformer_cuda.cpp) against the CPU f32 reference model on the
// Qwen3, Qwen2, Llama fixtures: logits, final hidden states and the gradient of every parameter,
// for f32 and bf16 CUDA models; activation recompute (bit-identical gradients); batch index
// checks once per forward. Skips without a GPU.
//
// Reference for bf16: the CPU f32 model with the same bf16-rounded weights (so weight rounding
// is not counted as compute error) and the same bf16-representable dlogits. Tolerances:
// - f32: the CPU and GPU differ only in summation order: max_rel 1e-4 on logits/hidden and
//   1e-3 on gradients (the fixture tolerances).
// - bf16: every stored activation and activation gradient is rounded to bf16 (unit roundoff
//   2^-9 = 0.2%); ~15 roundings per layer forward and ~20 backward along any path of these
//   2-layer models, compounding like a random walk: sqrt(30..40) x 0.2% ~ 1.1-1.3% relative
//   L2 on outputs. Measured the same way with HF transformers in bf16 on these fixtures
//   (tools/bf16_error_estimate.py): logits rel_l2 0.55-1.04%, max_rel <= 1.5%; gradients
//   rel_l2 <= 2.4%, max_rel <= 3.8%. Bounds, ~2x above that: logits/hidden rel_l2 <= 2e-2,
//   max_rel <= 4e-2; gradients rel_l2 <= 5e-2, max_rel <= 1e-1. A wrong index, a missing term
//   or a dropped accumulation gives O(1) errors, far outside these.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <tuple>

#include "cuda/cuda_test_util.h"
#include "kernels/ops.h"
#include "loss/fused_loss.h"
#include "loss/loss_config.h"
#include "loss/teacher_payload.h"
#include "model/safetensors.h"
#include "model/kv_cache.h"
#include "model/offload.h"
#include "model/paged_forward.h"
#include "model/transformer.h"

namespace opd::test {
namespace {

Batch batch_to_device(const Batch& b) {
  return Batch{b.ids.to(Device::CUDA), b.cu_seqlens.to(Device::CUDA), b.positions.to(Device::CUDA)};
}

// Lengths 6, 1, 9, 0, 37: a single-token sequence, an empty one, one longer than a 16-row tile.
Batch fixture_batch(int64_t vocab) {
  std::vector<std::vector<int32_t>> seqs = {{1, 5, 9, 3, 7, 2}, {4}, {8, 6, 1, 2, 3, 4, 5, 6, 7}, {}};
  std::vector<int32_t> long_seq;
  for (int i = 0; i < 37; ++i) long_seq.push_back(static_cast<int32_t>((i * 29 + 11) % vocab));
  seqs.push_back(long_seq);
  return make_batch(seqs, vocab);
}

std::map<std::string, Tensor> by_name(const ModelWeights& w) {
  std::map<std::string, Tensor> m;
  w.for_each([&](const std::string& n, const Tensor& t) { m[n] = t; });
  return m;
}

bool same_host_bits(const Tensor& a, const Tensor& b) {
  Tensor ha = a.to(Device::CPU), hb = b.to(Device::CPU);
  return ha.shape() == hb.shape() && ha.dtype() == hb.dtype() &&
         std::memcmp(ha.raw(), hb.raw(), ha.nbytes()) == 0;
}


struct Bounds {
  double out_rel_l2, out_max_rel, grad_rel_l2, grad_max_rel;
};
Bounds bounds_for(DType dt) {
  return dt == DType::F32 ? Bounds{2e-5, 1e-4, 2e-4, 1e-3} : Bounds{2e-2, 4e-2, 5e-2, 1e-1};
}

class CudaModel : public ::testing::TestWithParam<std::tuple<const char*, DType>> {};

TEST_P(CudaModel, LogitsHiddenAndEveryGradientMatchTheCpu) {
  REQUIRE_GPU();
  const auto [fixture, dt] = GetParam();
  const Bounds bd = bounds_for(dt);
  Transformer loaded = Transformer::load(fixture_path(std::string("models/") + fixture));
  const ModelConfig& c = loaded.config();
  // The CPU reference has exactly the weights the GPU model sees.
  Transformer cpu_model = dt == DType::BF16
                              ? loaded.to(Device::CPU, DType::BF16).to(Device::CPU, DType::F32)
                              : loaded;
  Transformer gpu_model = loaded.to(Device::CUDA, dt);
  ASSERT_EQ(gpu_model.device(), Device::CUDA);
  ASSERT_EQ(gpu_model.dtype(), dt);
  Batch batch = fixture_batch(c.vocab_size);
  const int64_t T = batch.num_tokens();

  ForwardCache cpu_cache, gpu_cache;
  Tensor cpu_logits = cpu_model.forward(batch, &cpu_cache);
  Tensor gpu_logits = gpu_model.forward(batch, &gpu_cache);  // host batch: uploaded once
  ASSERT_EQ(gpu_logits.dtype(), DType::F32);
  ASSERT_EQ(gpu_logits.shape(), cpu_logits.shape());
  Diff dl = compare(host(gpu_logits), cpu_logits);
  EXPECT_FALSE(dl.has_nan);
  EXPECT_LE(dl.rel_l2, bd.out_rel_l2);
  EXPECT_LE(dl.max_rel, bd.out_max_rel);

  // forward_hidden from a device batch gives the hidden states of the cached forward.
  Tensor gpu_hidden = gpu_model.forward_hidden(batch_to_device(batch));
  EXPECT_EQ(gpu_hidden.dtype(), dt);
  EXPECT_TRUE(same_host_bits(gpu_hidden, gpu_cache.h_final));
  Diff dh = compare(host(gpu_hidden), cpu_cache.h_final);
  EXPECT_FALSE(dh.has_nan);
  EXPECT_LE(dh.rel_l2, bd.out_rel_l2);
  EXPECT_LE(dh.max_rel, bd.out_max_rel);

  // Gradients accumulate (+=) onto non-zero buffers: the same start on both sides.
  Tensor dlogits = rand_in({T, c.vocab_size}, dt, 3, -1, 1);
  ModelWeights cpu_grads = zeros_weights(c);
  uint64_t seed = 100;
  cpu_grads.for_each([&](const std::string&, Tensor& g) {
    g.copy_from(random_uniform(g.shape(), DType::F32, seed++, -0.01, 0.01));
  });
  ModelWeights start = weights_to(cpu_grads, Device::CPU, DType::F32);
  ModelWeights gpu_grads = weights_to(cpu_grads, Device::CUDA, DType::F32);
  cpu_model.backward(batch, cpu_cache, dlogits, cpu_grads);
  gpu_model.backward(batch, gpu_cache, dlogits.to(Device::CUDA), gpu_grads);
  auto cpu_by = by_name(cpu_grads), start_by = by_name(start);
  int checked = 0;
  double worst = 0;
  std::string worst_name;
  gpu_grads.for_each([&](const std::string& name, const Tensor& g) {
    // Compare the accumulated part (gradient of this backward) so the tolerance is relative
    // to it, not to the random start.
    Tensor got = host(g), want = cpu_by.at(name), s = start_by.at(name);
    float* gp = got.data<float>();
    float* wp = want.data<float>();
    const float* sp = s.data<float>();
    for (int64_t i = 0; i < got.numel(); ++i) {
      gp[i] -= sp[i];
      wp[i] -= sp[i];
    }
    Diff d = compare(got, want);
    EXPECT_FALSE(d.has_nan) << name;
    EXPECT_GT(compare(want, Tensor::zeros(want.shape(), DType::F32)).max_abs, 0) << name;
    EXPECT_LE(d.rel_l2, bd.grad_rel_l2) << name;
    EXPECT_LE(d.max_rel, bd.grad_max_rel) << name;
    if (d.rel_l2 > worst) worst = d.rel_l2, worst_name = name;
    ++checked;
  });
  EXPECT_EQ(checked, static_cast<int>(cpu_by.size()));
  std::printf("%s %s: logits rel_l2 %.3g max_rel %.3g; hidden rel_l2 %.3g; worst gradient rel_l2 "
              "%.3g (%s), %d gradients\n",
              fixture, std::string(dtype_name(dt)).c_str(), dl.rel_l2, dl.max_rel, dh.rel_l2, worst,
              worst_name.c_str(), checked);
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, CudaModel,
    ::testing::Combine(::testing::Values("qwen3", "qwen2", "llama", "llama_bias", "qwen2_yarn"),
                       ::testing::Values(DType::F32, DType::BF16)),
    [](const auto& info) {
      return std::string(std::get<0>(info.param)) + "_" +
             std::string(dtype_name(std::get<1>(info.param)));
    });

// Recompute::PerLayer recomputes each layer from its saved input, Recompute::Elementwise only the
// norm outputs, normed q/k and the SwiGLU product, with the same kernels on the same values, so
// the gradients equal those of the full cache bit for bit. Determinism of two
// full-cache runs is checked first, so a failure names the right cause.
class CudaModelRecompute : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaModelRecompute, GradientsBitIdenticalWithAndWithoutRecompute) {
  REQUIRE_GPU();
  Transformer model =
      Transformer::load(fixture_path(std::string("models/") + GetParam())).to(Device::CUDA, DType::BF16);
  const ModelConfig& c = model.config();
  Batch batch = fixture_batch(c.vocab_size);
  Tensor dhidden = rand_in({batch.num_tokens(), c.hidden_size}, DType::F32, 9, -1, 1);
  // Runs: 0, 1 Off (determinism), 2 PerLayer, 3 Elementwise.
  std::map<std::string, Tensor> runs[4];
  Tensor hidden[4];
  for (int r = 0; r < 4; ++r) {
    model.set_recompute(r == 2 ? Recompute::PerLayer
                               : r == 3 ? Recompute::Elementwise : Recompute::Off);
    ForwardCache cache;
    hidden[r] = model.forward_hidden(batch, &cache);
    for (const LayerCache& lc : cache.layers) {
      EXPECT_EQ(lc.gate.defined(), r != 2);
      EXPECT_EQ(lc.act.defined(), r < 2);  // Elementwise drops act, h1, h2 (and q/k after q/k norm)
      EXPECT_EQ(lc.h2.defined(), r < 2);
      EXPECT_EQ(lc.attn.defined(), r != 2);
      if (r == 3) EXPECT_EQ(lc.q.defined(), !c.qk_norm);
    }
    ModelWeights grads = zeros_weights(c, DType::F32, Device::CUDA);
    model.backward_hidden(batch, cache, dhidden.to(Device::CUDA), grads);  // f32 dhidden
    runs[r] = by_name(grads);
  }
  for (const auto& [name, g] : runs[0]) {
    ASSERT_TRUE(same_host_bits(g, runs[1].at(name))) << "not deterministic: " << name;
  }
  for (int r : {2, 3}) {
    EXPECT_TRUE(same_host_bits(hidden[0], hidden[r])) << recompute_name(model.recompute());
    for (const auto& [name, g] : runs[0])
      EXPECT_TRUE(same_host_bits(g, runs[r].at(name))) << "run " << r << ": " << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaModelRecompute,
                         ::testing::Values("qwen3", "qwen2", "llama"));

// WeightOffload moves every parameter (q/k norms and biases included: the families cover both)
// to pinned host memory and back: after each upload the forward gives the same bits; while
// released, using the model is an error, not a read of freed memory.
class CudaWeightOffload : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaWeightOffload, UploadGivesTheSameBitsAndReleasedWeightsAreRefused) {
  REQUIRE_GPU();
  auto model = std::make_shared<Transformer>(
      Transformer::load(fixture_path(std::string("models/") + GetParam())).to(Device::CUDA, DType::BF16));
  Batch batch = fixture_batch(model->config().vocab_size);
  const Tensor before = host(model->forward_hidden(batch));
  // Baseline: the same forward again on the same weights. If this differs, the forward itself is
  // not reproducible (e.g. memory it reads uninitialized), which is not the offload's doing.
  ASSERT_TRUE(same_host_bits(before, host(model->forward_hidden(batch))))
      << "the forward is not bit-reproducible: " << diff_summary(before, model->forward_hidden(batch));
  int64_t params = 0;
  model->weights().for_each([&](const std::string&, const Tensor&) { ++params; });
  WeightOffload off(model);
  EXPECT_FALSE(off.resident());
  EXPECT_GT(off.bytes(), 0);
  EXPECT_THROW(model->forward_hidden(batch), Error);
  for (int round = 0; round < 2; ++round) {
    off.upload();
    off.upload();  // no-op when resident
    EXPECT_TRUE(off.resident());
    int64_t bound = 0;
    model->weights().for_each([&](const std::string&, const Tensor& t) {
      EXPECT_EQ(t.device(), Device::CUDA);
      ++bound;
    });
    EXPECT_EQ(bound, params);
    const Tensor after = host(model->forward_hidden(batch));
    EXPECT_TRUE(same_host_bits(before, after)) << "round " << round << ": " << diff_summary(before, after);
    off.release();
    EXPECT_FALSE(off.resident());
  }
  EXPECT_EQ(off.uploads(), 2);
}

// upload_layered: the groups are copied on a copy stream while the forward waits for each
// right before its use. The forward (dense, fresh after each upload) and a PagedForward step
// (which waits for every group) give the bits of the never-offloaded model; release and a plain
// upload afterwards still work; destroying the offload while a layered upload is bound leaves
// the model usable.
TEST_P(CudaWeightOffload, LayeredUploadGivesTheSameBits) {
  REQUIRE_GPU();
  auto model = std::make_shared<Transformer>(
      Transformer::load(fixture_path(std::string("models/") + GetParam())).to(Device::CUDA, DType::BF16));
  const int64_t V = model->config().vocab_size;
  Batch batch = fixture_batch(V);
  const Tensor before = host(model->forward_hidden(batch));
  const Tensor logits_before = host(model->forward(batch));
  auto paged_logits = [&] {
    PagedForward f(*model, true);
    KvCache cache(model->config(), 4, 16, DType::BF16, Device::CUDA);
    std::vector<int32_t> table = {3, 1, 7};
    PagedStep step;
    const std::vector<int32_t> ids = {1, 5, 9, 2, 7, 3, 11, 4, 6};
    step.add(ids, 0, table);
    return host(f.step(step, cache));
  };
  const Tensor paged_before = paged_logits();
  {
    WeightOffload off(model);
    for (int round = 0; round < 2; ++round) {
      off.upload_layered();
      off.upload_layered();  // no-op when resident
      EXPECT_TRUE(off.resident());
      // The first forward looks its tokens up in the embedding's pinned host copy (the embedding
      // is copied last), the second in the device copy; the logits wait for the tied lm_head.
      const Tensor after = host(model->forward_hidden(batch));
      EXPECT_TRUE(same_host_bits(before, after)) << "round " << round << ": " << diff_summary(before, after);
      const Tensor logits = host(model->forward(batch));
      EXPECT_TRUE(same_host_bits(logits_before, logits)) << "round " << round << ": "
                                                         << diff_summary(logits_before, logits);
      off.release();
      off.upload_layered();
      const Tensor logits_first = host(model->forward(batch));  // the lm_head in the first forward
      EXPECT_TRUE(same_host_bits(logits_before, logits_first)) << "round " << round << ": "
                                                               << diff_summary(logits_before, logits_first);
      off.release();
      off.upload_layered();
      const Tensor paged = paged_logits();  // PagedForward first: it waits for every group
      EXPECT_TRUE(same_host_bits(paged_before, paged)) << "round " << round << ": "
                                                       << diff_summary(paged_before, paged);
      off.release();
    }
    off.upload();  // a plain upload after layered ones
    EXPECT_TRUE(same_host_bits(before, host(model->forward_hidden(batch))));
    off.release();
    off.upload_layered();  // destroyed while bound: the model keeps its weights
  }
  EXPECT_TRUE(same_host_bits(before, host(model->forward_hidden(batch))));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaWeightOffload, ::testing::Values("qwen3", "qwen2", "llama"));

// Ids, positions and cu_seqlens are checked when the forward starts, for host and device
// batches, with the messages of the CPU checks; nothing runs on bad data.
TEST(CudaModelBatch, BadIndicesAreRejectedOncePerForward) {
  REQUIRE_GPU();
  Transformer model =
      Transformer::load(fixture_path("models/qwen3")).to(Device::CUDA, DType::BF16);
  const int64_t V = model.config().vocab_size;
  Batch good = make_batch({{1, 2, 3}, {4, 5}}, V);
  Batch bad_id = good;
  bad_id.ids = good.ids.clone();
  bad_id.ids.data<int32_t>()[3] = static_cast<int32_t>(V);
  Batch bad_pos = good;
  bad_pos.positions = good.positions.clone();
  bad_pos.positions.data<int32_t>()[1] = -4;
  Batch bad_cu = good;
  bad_cu.cu_seqlens = good.cu_seqlens.clone();
  bad_cu.cu_seqlens.data<int32_t>()[1] = 7;
  for (bool on_device : {false, true}) {
    auto place = [&](const Batch& b) { return on_device ? batch_to_device(b) : b; };
    std::string m = error_message([&] { model.forward(place(bad_id)); }, ErrorKind::InvalidData);
    EXPECT_NE(m.find("token id " + std::to_string(V) + " at row 3"), std::string::npos) << m;
    m = error_message([&] { model.forward(place(bad_pos)); }, ErrorKind::InvalidData);
    EXPECT_NE(m.find("-4"), std::string::npos) << m;
    m = error_message([&] { model.forward_hidden(place(bad_cu)); }, ErrorKind::InvalidData);
    EXPECT_FALSE(m.empty());
  }
  // The device is healthy afterwards and a good batch runs.
  Tensor logits = model.forward(good);
  EXPECT_FALSE(compare(host(logits), host(logits)).has_nan);
  // Gradients must be f32 CUDA tensors.
  ForwardCache cache;
  Tensor h = model.forward_hidden(good, &cache);
  ModelWeights bf16_grads = zeros_weights(model.config(), DType::BF16, Device::CUDA);
  error_message([&] { model.backward_hidden(good, cache, h, bf16_grads); },
                ErrorKind::InvalidArgument);
}

// One micro-batch of the distillation step as `opd bench train` (and the trainer) composes it:
// forward_hidden over the packed batch, gather_rows of the completion rows, the fused lm_head
// + JSD (topk+tail), d_hidden scattered back through the inverse map (prompt rows 0, rounded to
// bf16), backward_hidden; the tied lm_head/embedding gradient receives both the loss's and the
// embedding's parts. bf16 CUDA vs the CPU f32 composition with the same bf16-rounded weights.
TEST(CudaModelStep, DistillMicroBatchMatchesTheCpu) {
  REQUIRE_GPU();
  Transformer loaded = Transformer::load(fixture_path("models/qwen3"));
  const ModelConfig& c = loaded.config();
  Transformer cpu_model = loaded.to(Device::CPU, DType::BF16).to(Device::CPU, DType::F32);
  Transformer gpu_model = loaded.to(Device::CUDA, DType::BF16);
  const int64_t V = c.vocab_size, H = c.hidden_size, K = 5;
  // Three sequences: (prompt, completion) = (4, 6), (1, 3), (7, 9).
  const std::vector<std::pair<int, int>> split = {{4, 6}, {1, 3}, {7, 9}};
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int32_t> rows, inverse;
  int64_t start = 0;
  for (size_t s = 0; s < split.size(); ++s) {
    const int len = split[s].first + split[s].second;
    std::vector<int32_t> seq;
    for (int p = 0; p < len; ++p) seq.push_back(static_cast<int32_t>((s * 31 + p * 17 + 5) % V));
    seqs.push_back(seq);
    for (int p = 0; p < len; ++p) {
      // Row p predicts token p + 1: completion tokens [prompt, len) come from rows [prompt-1, len-1).
      const bool loss_row = p >= split[s].first - 1 && p < len - 1;
      inverse.push_back(loss_row ? static_cast<int32_t>(rows.size()) : -1);
      if (loss_row) rows.push_back(static_cast<int32_t>(start + p));
    }
    start += len;
  }
  Batch batch = make_batch(seqs, V);
  const int64_t T = batch.num_tokens(), N = static_cast<int64_t>(rows.size());
  Tensor rows_t = Tensor::from_vector(rows, {N}), inverse_t = Tensor::from_vector(inverse, {T});
  TeacherTopK teacher;
  teacher.rows = N;
  teacher.k = K;
  teacher.ids = Tensor::empty({N, K}, DType::I32);
  teacher.logprobs = Tensor::empty({N, K}, DType::F32);
  teacher.actual_logprobs = Tensor::empty({N}, DType::F32);
  teacher.valid = Tensor::empty({N}, DType::I32);
  Tensor targets = Tensor::empty({N}, DType::I32), weights = Tensor::empty({N}, DType::F32);
  for (int64_t i = 0; i < N; ++i) {
    targets.data<int32_t>()[i] = batch.ids.data<int32_t>()[rows[i] + 1];
    weights.data<float>()[i] = 1.0f;
    for (int64_t j = 0; j < K; ++j) {
      teacher.ids.data<int32_t>()[i * K + j] = static_cast<int32_t>((i * 7 + j * 13) % V);
      teacher.logprobs.data<float>()[i * K + j] = static_cast<float>(-1.5 - 0.4 * j - 0.01 * i);
    }
    teacher.actual_logprobs.data<float>()[i] = -2.0f;
    teacher.valid.data<int32_t>()[i] = 1;
  }
  LossConfig cfg;  // topk+tail, beta 0.5, T 1
  cfg.vocab_tile = 32;  // several tiles over the 96-token vocabulary

  // CPU f32 reference.
  ModelWeights cpu_grads = zeros_weights(c);
  ForwardCache cpu_cache;
  Tensor hidden = cpu_model.forward_hidden(batch, &cpu_cache);
  Tensor hc = Tensor::poisoned({N, H}, DType::F32);
  ops::gather_rows(hidden, rows_t, hc);
  FusedLossArgs a;
  a.hidden = hc;
  a.lm_head = cpu_model.weights().lm_head;
  a.targets = targets;
  a.weights = weights;
  a.teacher = &teacher;
  a.n_total = static_cast<double>(N);
  Tensor d_hc = Tensor::poisoned({N, H}, DType::F32);
  LossResult cpu_loss = fused_lm_head_loss(cfg, a, &d_hc, &cpu_grads.lm_head);
  Tensor dh = Tensor::poisoned({T, H}, DType::F32);
  ops::gather_rows(d_hc, inverse_t, dh);
  cpu_model.backward_hidden(batch, cpu_cache, dh, cpu_grads);

  // CUDA bf16.
  ModelWeights gpu_grads = zeros_weights(c, DType::F32, Device::CUDA);
  ForwardCache gpu_cache;
  Tensor ghidden = gpu_model.forward_hidden(batch, &gpu_cache);
  Tensor ghc = dev_poison({N, H}, DType::BF16);
  ops::gather_rows(ghidden, rows_t.to(Device::CUDA), ghc);
  TeacherTopK gteacher = teacher;
  gteacher.ids = teacher.ids.to(Device::CUDA);
  gteacher.logprobs = teacher.logprobs.to(Device::CUDA);
  gteacher.actual_logprobs = teacher.actual_logprobs.to(Device::CUDA);
  gteacher.valid = teacher.valid.to(Device::CUDA);
  FusedLossArgs ga = a;
  ga.hidden = ghc;
  ga.lm_head = gpu_model.weights().lm_head;
  ga.targets = targets.to(Device::CUDA);
  ga.weights = weights.to(Device::CUDA);
  ga.teacher = &gteacher;
  Tensor gd_hc = dev_poison({N, H}, DType::F32);
  LossResult gpu_loss = fused_lm_head_loss(cfg, ga, &gd_hc, &gpu_grads.lm_head);
  Tensor gdh = dev_poison({T, H}, DType::BF16);
  ops::gather_rows(gd_hc, inverse_t.to(Device::CUDA), gdh);  // f32 -> bf16, prompt rows 0
  gpu_model.backward_hidden(batch, gpu_cache, gdh, gpu_grads);

  EXPECT_GT(cpu_loss.loss, 0);
  EXPECT_NEAR(gpu_loss.loss, cpu_loss.loss, 2e-2 * cpu_loss.loss);
  EXPECT_EQ(gpu_loss.rows_used, cpu_loss.rows_used);
  const Bounds bd = bounds_for(DType::BF16);
  auto cpu_by = by_name(cpu_grads);
  int checked = 0;
  gpu_grads.for_each([&](const std::string& name, const Tensor& g) {
    Diff d = compare(host(g), cpu_by.at(name));
    EXPECT_FALSE(d.has_nan) << name;
    EXPECT_LE(d.rel_l2, bd.grad_rel_l2) << name;
    EXPECT_LE(d.max_rel, bd.grad_max_rel) << name;
    ++checked;
  });
  EXPECT_EQ(checked, static_cast<int>(cpu_by.size()));
  std::printf("micro-batch: loss cpu %.6f gpu %.6f, %d gradients\n", cpu_loss.loss, gpu_loss.loss,
              checked);
}

}  // namespace
}  // namespace opd::test
