// The training loop on the GPU (`opd train --device cuda`) against the CPU reference backend, on
// tiny random models with the demo tokenizer: the same steps give the same losses (f32 on CUDA:
// to rounding; bf16: to bf16 tolerance), every completion source runs on the GPU (rollout,
// in-process CUDA teacher, seq-kd), checkpoints hold the f32 master weights and load on the host,
// and a stopped + resumed GPU run ends bit-identical to an uninterrupted one.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "common/checkpoint_weights.h"
#include "core/cuda/allocator.h"
#include "common/payload_check_run.h"
#include "common/run_dir_test.h"
#include "cuda/cuda_test_util.h"
#include "model/init.h"
#include "model/safetensors.h"
#include "model/transformer.h"
#include "train/checkpoint.h"
#include "train/metrics.h"
#include "train/signals.h"
#include "train/trainer.h"

namespace opd {
namespace {

namespace fs = std::filesystem;

// The tiny demo config with head_dim 64 (the CUDA attention kernels' tile sizes).
ModelConfig gpu_tiny(int64_t hidden, int64_t layers) {
  ModelConfig c = test::tiny_demo_config(hidden, layers);
  c.head_dim = 64;
  return c;
}

class CudaTrainerTest : public test::RunDirTest {
 protected:
  CudaTrainerTest() : RunDirTest("opd_cuda_trainer_") {}
  void SetUp() override {
    RunDirTest::SetUp();
    const std::string tok = test::source_dir() + "/demo/tokenizer";
    save_model_dir(path("student"), gpu_tiny(64, 2), init_weights(gpu_tiny(64, 2), 1), tok);
    save_model_dir(path("teacher"), gpu_tiny(96, 2), init_weights(gpu_tiny(96, 2), 2, 0.1), tok);
    std::ofstream data(path("train.jsonl"));
    for (int i = 0; i < 24; ++i) {
      const int a = (i * 37) % 100, b = (i * 53 + 11) % 100;
      data << "{\"prompt\": \"" << a << "+" << b << "=\", \"completion\": \"" << a + b << "\"}\n";
    }
    clear_stop_request();
  }
  void TearDown() override {
    clear_stop_request();
    RunDirTest::TearDown();
  }

  TrainOptions base(const std::string& out, const std::string& device,
                    const std::string& dtype = "f32") const {
    TrainOptions o;
    o.student = path("student");
    o.teacher = path("teacher");
    o.data = {path("train.jsonl")};
    o.out = path(out);
    o.batch_size = 4;
    o.micro_batch_size = 3;  // uneven micro-batches
    o.max_steps = 3;
    o.learning_rate = 1e-3;
    o.max_completion_length = 5;
    o.teacher_top_k = 8;
    o.save_minutes = 0;
    o.tensorboard = false;
    o.lmbda = 0;
    o.device = device;
    o.dtype = dtype;
    return o;
  }
  std::vector<double> losses(const std::string& out) const {
    std::vector<double> v;
    for (const auto& l : MetricsLog::read(path(out) + "/metrics.jsonl"))
      if (l.contains("loss")) v.push_back(l.at("loss").get<double>());
    return v;
  }
};

using test::checkpoint_weights;

TEST_F(CudaTrainerTest, SameStepsAsTheCpuInF32AndBf16) {
  REQUIRE_GPU();
  // Dataset completions (lmbda 0): the sequences do not depend on the backend.
  TrainResult cpu = train(base("cpu", "cpu"));
  TrainResult f32 = train(base("f32", "cuda", "f32"));
  TrainResult bf16 = train(base("bf16", "cuda", "bf16"));
  const auto lc = losses("cpu"), lf = losses("f32"), lb = losses("bf16");
  ASSERT_EQ(lc.size(), 3u);
  ASSERT_EQ(lf.size(), 3u);
  ASSERT_EQ(lb.size(), 3u);
  for (size_t i = 0; i < lc.size(); ++i) {
    ASSERT_TRUE(std::isfinite(lc[i]) && lc[i] > 0);
    EXPECT_NEAR(lf[i], lc[i], 1e-4 * lc[i]) << "step " << i + 1 << " f32 CUDA vs CPU";
    EXPECT_NEAR(lb[i], lc[i], 3e-2 * lc[i]) << "step " << i + 1 << " bf16 CUDA vs CPU";
  }
  // The checkpoints hold f32 master weights; the f32 GPU run's are the CPU's to rounding.
  const auto wc = checkpoint_weights(cpu.last_checkpoint), wf = checkpoint_weights(f32.last_checkpoint),
             wb = checkpoint_weights(bf16.last_checkpoint);
  ASSERT_EQ(wc.size(), wf.size());
  for (const auto& [name, t] : wc) {
    ASSERT_EQ(wf.at(name).dtype(), DType::F32) << name;
    ASSERT_EQ(wb.at(name).dtype(), DType::F32) << name;
    const test::Diff d = test::compare(wf.at(name), t);
    EXPECT_FALSE(d.has_nan) << name;
    // Adam's update is ~lr * sign(g): an element whose gradient is within rounding of 0 may move
    // differently, so the bound is looser than the losses'.
    EXPECT_LT(d.rel_l2, 2e-3) << name << " f32 CUDA vs CPU after 3 steps";
  }
  Transformer back = Transformer::load(bf16.last_checkpoint);
  EXPECT_EQ(back.config().hidden_size, 64);
}

TEST_F(CudaTrainerTest, EverySourceOfCompletionsRunsOnTheGpu) {
  REQUIRE_GPU();
  struct Case { double lmbda; bool seq_kd; const char* want; };
  for (Case c : {Case{1.0, false, "on-policy"}, Case{0.0, true, "teacher"}}) {
    TrainOptions o = base(std::string("src_") + c.want, "cuda", "bf16");
    o.lmbda = c.lmbda;
    o.seq_kd = c.seq_kd;
    o.num_generations = 2;
    TrainResult r = train(o);
    EXPECT_EQ(r.steps, 3);
    int64_t steps = 0;
    for (const auto& l : MetricsLog::read(o.out + "/metrics.jsonl")) {
      if (!l.contains("loss")) continue;
      ++steps;
      EXPECT_EQ(l.at("source"), c.want);
      EXPECT_TRUE(std::isfinite(l.at("loss").get<double>()));
      EXPECT_GT(l.at("loss").get<double>(), 0);
      EXPECT_GT(l.at("memory/peak_device_bytes").get<int64_t>(), 0);
    }
    EXPECT_EQ(steps, 3);
  }
}

TEST_F(CudaTrainerTest, AnInProcessTeachersBadScoresStopTheRunBeforeAnyUpdate) {
  REQUIRE_GPU();
  // On the GPU the in-process teacher's payload check runs on a helper thread beside the first
  // micro-batch's forward (Trainer::score); its rejection must surface there and stop the run
  // before any gradient is applied or checkpoint written (TrainerTest's CPU twin).
  test::write_teacher_beyond_student_vocab(path("far_teacher"), gpu_tiny(96, 2));
  for (double lmbda : {0.0, 1.0}) {
    TrainOptions o = base(lmbda == 0 ? "far_dataset" : "far_on_policy", "cuda", "bf16");
    o.teacher = path("far_teacher");
    o.vocab_policy = "clip-to-student";
    o.lmbda = lmbda;
    test::expect_payload_check_stops_the_run(o);
  }
}

TEST_F(CudaTrainerTest, ResumeOnTheGpuIsBitwiseExact) {
  REQUIRE_GPU();
  // 4 steps at once, or 2 steps and then a resumed run to 4 (constant LR: the schedule does not
  // depend on max_steps), both on-policy on the GPU.
  auto opts = [&](const std::string& out, int64_t steps) {
    TrainOptions o = base(out, "cuda", "bf16");
    o.lmbda = 1;
    o.lr_scheduler_type = "constant";
    o.max_steps = steps;
    return o;
  };
  TrainResult whole = train(opts("whole", 4));
  train(opts("parts", 2));
  TrainResult resumed = train(opts("parts", 4));
  EXPECT_EQ(resumed.first_step, 2);
  EXPECT_EQ(resumed.steps, 4);
  test::expect_bitwise_equal(checkpoint_weights(whole.last_checkpoint),
                             checkpoint_weights(resumed.last_checkpoint), "after resume");
}

// The memory options change where bytes live, not what is computed: elementwise recompute
// rebuilds bit-identical activations and the offloaded teacher is the same bits after its
// upload, so 3 on-policy steps (teacher scoring every step, seq-kd's teacher rollout in a second
// run) end with bit-identical weights, at a lower peak.
TEST_F(CudaTrainerTest, MemoryOptionsGiveBitIdenticalStepsWithLessMemory) {
  REQUIRE_GPU();
  for (bool seq_kd : {false, true}) {
    auto opts = [&](const std::string& out, bool saving) {
      TrainOptions o = base(out + (seq_kd ? "_seqkd" : ""), "cuda", "bf16");
      o.lmbda = seq_kd ? 0 : 1;
      o.seq_kd = seq_kd;
      o.recompute_granularity = saving ? "elementwise" : "none";
      o.offload_teacher = saving;
      return o;
    };
    TrainResult plain = train(opts("plain", false));
    TrainResult saving = train(opts("saving", true));
    EXPECT_EQ(saving.steps, 3);
    ASSERT_NO_FATAL_FAILURE(test::expect_bitwise_equal(
        checkpoint_weights(plain.last_checkpoint), checkpoint_weights(saving.last_checkpoint),
        "(seq_kd " + std::to_string(seq_kd) + ")"));
    auto peak = [&](const std::string& out) {
      int64_t p = 0;
      for (const auto& l : MetricsLog::read(path(out) + "/metrics.jsonl"))
        if (l.contains("memory/peak_device_bytes"))
          p = std::max(p, l.at("memory/peak_device_bytes").get<int64_t>());
      return p;
    };
    const std::string sfx = seq_kd ? "_seqkd" : "";
    EXPECT_LT(peak("saving" + sfx), peak("plain" + sfx)) << "seq_kd " << seq_kd;
  }
}

// The f32 gradients (4P bytes) exist only in the training phase, from the first step on: the
// first step's scoring phase peaks no higher than the later ones' (before the fix, the buffers
// built with the optimizer lived until the first AdamW step: W1's first rollout and scoring
// peaked 4P = 2.2 GiB above the later ones on the H200). Per-phase peaks come from the trainer's
// metrics (memory/peak_<phase>_bytes).
TEST_F(CudaTrainerTest, GradientsExistOnlyInTheTrainingPhaseFromTheFirstStep) {
  REQUIRE_GPU();
  TrainOptions o = base("phases", "cuda", "bf16");
  o.lmbda = 1;
  o.ignore_eos = true;
  TrainResult r = train(o);
  ASSERT_EQ(r.steps, 3);
  std::vector<int64_t> score, train_peak;
  for (const auto& l : MetricsLog::read(path("phases") + "/metrics.jsonl")) {
    if (!l.contains("memory/peak_score_bytes")) continue;
    score.push_back(l.at("memory/peak_score_bytes").get<int64_t>());
    train_peak.push_back(l.at("memory/peak_train_bytes").get<int64_t>());
    EXPECT_GT(l.at("memory/peak_rollout_bytes").get<int64_t>(), 0);
  }
  ASSERT_EQ(score.size(), 3u);
  const int64_t grads = 4 * gpu_tiny(64, 2).num_parameters();
  // Every completion is 5 tokens (EOS ignored); the prompts differ by a few tokens per step,
  // a few KB of the teacher's activations, far below 4P / 2.
  for (size_t k = 1; k < score.size(); ++k)
    EXPECT_LT(score[0] - score[k], grads / 2) << "step 1 scoring " << score[0] << ", step "
                                              << k + 1 << " " << score[k] << ", 4P " << grads;
  EXPECT_GT(train_peak[0], 0);
}

// The rollout keeps its cached device blocks (KV cache, packed weights, step buffers) between
// rollouts when the memory plan leaves room on the device (EngineOptions::release_device_memory,
// decided in the trainer; OPD_ROLLOUT_KEEP_MEMORY overrides it for measurements): the same
// weights bit for bit, and fewer cudaMalloc calls than a run that hands them back every step.
TEST_F(CudaTrainerTest, RolloutMemoryKeptOrReleasedGivesBitIdenticalSteps) {
  REQUIRE_GPU();
  auto run = [&](const std::string& out, const char* keep) {
    setenv("OPD_ROLLOUT_KEEP_MEMORY", keep, 1);
    TrainOptions o = base(out, "cuda", "bf16");
    o.lmbda = 1;
    o.max_steps = 4;
    o.ignore_eos = true;
    const int64_t mallocs = cuda::device_allocator().stats().device_mallocs;
    TrainResult r = train(o);
    unsetenv("OPD_ROLLOUT_KEEP_MEMORY");
    EXPECT_EQ(r.steps, 4);
    return std::make_pair(r, cuda::device_allocator().stats().device_mallocs - mallocs);
  };
  const auto [released, released_mallocs] = run("released", "0");
  const auto [kept, kept_mallocs] = run("kept", "1");
  ASSERT_NO_FATAL_FAILURE(test::expect_bitwise_equal(checkpoint_weights(released.last_checkpoint),
                                                     checkpoint_weights(kept.last_checkpoint),
                                                     "rollout memory kept vs released"));
  EXPECT_LT(kept_mallocs, released_mallocs)
      << "keeping the rollout's blocks saved no cudaMalloc (" << kept_mallocs << " vs "
      << released_mallocs << ")";
}

// Without --device-memory-budget the GPU's memory is the budget: a run whose plan cannot fit
// in any memory setting (here a rollout of 128 prompts x 1,024 samples x ~4k tokens: ~280 GB of
// KV cache with --kv-cache-gb 1000) stops at start-up naming the device and the plan, instead of
// running out of memory in its first rollout.
TEST_F(CudaTrainerTest, APlanThatCannotFitTheDeviceStopsAtStartUp) {
  REQUIRE_GPU();
  TrainOptions o = base("huge", "cuda", "bf16");
  o.lmbda = 1;
  o.batch_size = 128;
  o.num_generations = 1024;
  o.max_completion_length = 4096;
  o.kv_cache_gb = 1000;
  try {
    train(o);
    ADD_FAILURE() << "a run planned past the device's memory started";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument) << m;
    EXPECT_NE(m.find("the device's"), std::string::npos) << m;
    EXPECT_NE(m.find("no memory setting fits"), std::string::npos) << m;
  }
  EXPECT_FALSE(fs::exists(path("huge") + "/metrics.jsonl")) << "a step ran";
}

}  // namespace
}  // namespace opd
