// The training loop in-process on tiny random models with the demo's tokenizer: SFT equals
// cross-entropy, every completion source (on-policy, dataset, seq-kd teacher) runs, resume after
// a stop signal and after a corrupt checkpoint reproduces the uninterrupted run bit for bit,
// non-finite steps are skipped, saved and bounded, bad options are named.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/checkpoint_weights.h"
#include "common/payload_check_run.h"
#include "common/python_oracle.h"
#include "common/run_dir_test.h"
#include "common/test_util.h"
#include "core/error.h"
#include "model/init.h"
#include "model/safetensors.h"
#include "model/transformer.h"
#include "tokenizer/tokenizer.h"
#include "train/checkpoint.h"
#include "train/metrics.h"
#include "train/signals.h"
#include "train/trainer.h"

namespace opd {
namespace {

namespace fs = std::filesystem;

class TrainerTest : public test::TinyDistillationTest {
 protected:
  TrainerTest() : TinyDistillationTest("opd_trainer_", 24) {}
  void SetUp() override {
    TinyDistillationTest::SetUp();
    std::ofstream eval(path("eval.jsonl"));
    eval << "{\"prompt\": \"1+2=\", \"completion\": \"3\"}\n{\"prompt\": \"10+5=\", \"completion\": \"15\"}\n";
    clear_stop_request();
  }
  void TearDown() override {
    clear_stop_request();
    TinyDistillationTest::TearDown();
  }

  TrainOptions base(const std::string& out) const {
    TrainOptions o;
    o.student = path("student");
    o.teacher = path("teacher");
    o.data = {path("train.jsonl")};
    o.out = path(out);
    o.batch_size = 4;
    o.micro_batch_size = 3;  // uneven micro-batches: accumulation must still give the step mean
    o.max_steps = 6;
    o.learning_rate = 1e-2;
    o.max_completion_length = 5;
    o.teacher_top_k = 8;
    o.save_minutes = 0;
    o.tensorboard = false;
    o.lmbda = 0.5;
    return o;
  }
};

using test::expect_bitwise_equal;
using test::final_weights;

// Runs `o` while a watcher thread raises SIGTERM (as a stop signal arriving mid-run would) once
// `ready()` holds, polled every millisecond; returns the interrupted run's result.
TrainResult train_until_sigterm(const TrainOptions& o, const std::function<bool()>& ready) {
  std::atomic<bool> done{false};
  std::thread killer([&] {
    while (!done) {
      if (ready()) {
        std::raise(SIGTERM);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  TrainResult r = train(o);
  done = true;
  killer.join();
  return r;
}

TEST_F(TrainerTest, SftLossIsTheMeanCrossEntropyOfTheStep) {
  TrainOptions o = base("sft");
  o.teacher.clear();
  o.sft = true;
  o.lmbda = 0;
  o.batch_size = 24;  // the whole (shuffled) dataset in one step
  o.max_steps = 1;
  o.learning_rate = 0;
  TrainResult r = train(o);
  EXPECT_EQ(r.steps, 1);
  auto lines = MetricsLog::read(path("sft/metrics.jsonl"));
  ASSERT_FALSE(lines.empty());
  const double loss = lines.back().at("loss").get<double>();

  // Reference: mean next-token CE over every completion token, from full logits.
  Transformer m = Transformer::load(path("student"));
  Tokenizer tok = Tokenizer::load(path("student"));
  std::ifstream in(path("train.jsonl"));
  std::string line;
  double sum = 0;
  int64_t n = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    auto p = tok.encode(j["prompt"].get<std::string>());
    auto c = tok.encode(j["completion"].get<std::string>());
    c.push_back(256);  // EOS appended to raw completions
    std::vector<int32_t> ids = p;
    ids.insert(ids.end(), c.begin(), c.end());
    Tensor logits = m.forward(make_batch({ids}, 272));
    for (size_t pos = p.size(); pos < ids.size(); ++pos) {
      const float* z = logits.data<float>() + (pos - 1) * 272;
      double mx = -1e30, s = 0;
      for (int v = 0; v < 272; ++v) mx = std::max(mx, double(z[v]));
      for (int v = 0; v < 272; ++v) s += std::exp(z[v] - mx);
      sum += mx + std::log(s) - z[ids[pos]];
      ++n;
    }
  }
  EXPECT_NEAR(loss, sum / n, 1e-5 * std::abs(sum / n)) << "tokens " << n;
  EXPECT_EQ(lines.back().at("completion_tokens").get<int64_t>(), n);
}

TEST_F(TrainerTest, EverySourceOfCompletionsRuns) {
  struct Case { double lmbda; bool seq_kd; const char* want; };
  for (Case c : {Case{1.0, false, "on-policy"}, Case{0.0, false, "dataset"}, Case{0.0, true, "teacher"}}) {
    TrainOptions o = base(std::string("src_") + c.want);
    o.lmbda = c.lmbda;
    o.seq_kd = c.seq_kd;
    o.max_steps = 3;
    o.num_generations = 2;
    o.eval_data = {path("eval.jsonl")};
    TrainResult r = train(o);
    EXPECT_EQ(r.steps, 3);
    EXPECT_GE(r.eval_before, 0);
    EXPECT_GE(r.eval_after, 0);
    int64_t steps = 0;
    for (const auto& l : MetricsLog::read(o.out + "/metrics.jsonl")) {
      if (!l.contains("loss")) continue;  // eval lines
      ++steps;
      EXPECT_EQ(l.at("source"), c.want);
      EXPECT_TRUE(std::isfinite(l.at("loss").get<double>()));
      EXPECT_GT(l.at("loss").get<double>(), 0);  // random teacher != random student
      EXPECT_EQ(l.at("skipped"), 0);
      if (c.lmbda == 1.0) EXPECT_TRUE(l.contains("reverse_kl_estimate"));
      // Steps that generate report where the rollout went; its parts fit inside it.
      const bool generated = c.lmbda == 1.0 || c.seq_kd;
      EXPECT_EQ(l.contains("time/rollout/decode_forward_s"), generated) << c.want;
      if (generated) {
        double parts = 0;
        for (const char* k : {"sync_wait_s", "prefill_s", "decode_forward_s", "sample_s", "host_s"}) {
          const double v = l.at(std::string("time/rollout/") + k).get<double>();
          EXPECT_GE(v, 0) << k;
          parts += v;
        }
        EXPECT_GT(l.at("time/rollout/prefill_s").get<double>(), 0) << c.want;
        EXPECT_GT(l.at("time/rollout/decode_forward_s").get<double>(), 0) << c.want;
        EXPECT_LE(parts, l.at("time/rollout_s").get<double>() * 1.001 + 1e-4) << c.want;
      }
    }
    EXPECT_EQ(steps, 3);
    // The checkpoint is a model directory that loads.
    Transformer back = Transformer::load(r.last_checkpoint);
    EXPECT_EQ(back.config().hidden_size, 32);
    EXPECT_TRUE(fs::exists(r.last_checkpoint + "/tokenizer.json"));
  }
}

// The exported checkpoint is a Hugging Face model directory for transformers itself (DESIGN.md:
// "checkpoints are written back in that layout so transformers and vLLM load them unchanged"):
// AutoModelForCausalLM loads it and gives opd's logits (f32, to rounding), and AutoTokenizer
// encodes text to opd's ids. Skips (reported) where python3 lacks transformers/torch.
TEST_F(TrainerTest, CheckpointLoadsInTransformersWithTheSameLogitsAndIds) {
  std::string why;
  if (!test::python_can_import("transformers, torch", &why)) GTEST_SKIP() << why;
  TrainOptions o = base("hf");
  o.max_steps = 2;
  const TrainResult r = train(o);
  const std::string dir = r.last_checkpoint;
  const std::string text = "12+34=46";
  const std::vector<int32_t> ids = Tokenizer::load(dir).encode(text);
  ASSERT_GE(ids.size(), 3u);
  const Transformer model = Transformer::load(dir);
  const Tensor logits = model.forward(make_batch({ids}, model.config().vocab_size));  // f32 [T, V]
  const char* code = R"PY(
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, text = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(d)
ids = tok(text, add_special_tokens=False)["input_ids"]
m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
with torch.no_grad():
    out = m(torch.tensor([ids])).logits[0]
print(json.dumps({"ids": ids, "logits": out.flatten().tolist()}))
)PY";
  std::string out;
  ASSERT_EQ(test::run_python(code, dir + " '" + text + "'", &out), 0) << out;
  const nlohmann::json got = nlohmann::json::parse(out.substr(0, out.find("\n--- python3 stderr")));
  EXPECT_EQ(got.at("ids").get<std::vector<int32_t>>(), ids);
  const std::vector<float> hf = got.at("logits").get<std::vector<float>>();
  ASSERT_EQ(static_cast<int64_t>(hf.size()), logits.numel());
  const float* mine = logits.data<float>();
  double num = 0, den = 0, worst = 0;
  for (size_t i = 0; i < hf.size(); ++i) {
    num += (mine[i] - hf[i]) * (mine[i] - hf[i]);
    den += static_cast<double>(hf[i]) * hf[i];
    worst = std::max(worst, std::fabs(mine[i] - hf[i]) / (1e-4 + std::fabs(hf[i])));
  }
  EXPECT_GT(den, 0);
  EXPECT_LT(std::sqrt(num / den), 1e-5) << "relative L2 between opd and transformers logits";
  EXPECT_LT(worst, 1e-2) << "worst elementwise relative difference";
}

TEST_F(TrainerTest, FullSupportEqualsTopKTailWithEveryId) {
  // topk+tail with K = V has an empty tail, so it is the full divergence; the full mode computes
  // it from the teacher's dense logits in tiles instead of a scored payload.
  auto first_loss = [&](const std::string& mode, int64_t k) {
    TrainOptions o = base("support_" + mode);
    o.loss_support = mode;
    o.teacher_top_k = k;
    o.lmbda = 0;
    o.max_steps = 1;
    o.kd_temperature = 1.3;
    train(o);
    return MetricsLog::read(o.out + "/metrics.jsonl").back().at("loss").get<double>();
  };
  const double full = first_loss("full", 8);
  const double tail = first_loss("topk+tail", 272);
  EXPECT_NEAR(full, tail, 2e-5 * std::abs(full)) << "full " << full << " topk+tail(K=V) " << tail;
  EXPECT_GT(full, 0);
}

TEST_F(TrainerTest, StopSignalCheckpointsAndResumeIsBitwiseExact) {
  TrainOptions full = base("full");
  train(full);

  TrainOptions part = base("part");
  TrainResult r1 = train_until_sigterm(part, [&] {  // once the run has finished its second step
    int64_t torn = 0;
    return fs::exists(part.out + "/metrics.jsonl") &&
           MetricsLog::read(part.out + "/metrics.jsonl", &torn).size() >= 2;
  });
  ASSERT_TRUE(r1.stopped_by_signal);
  ASSERT_LT(r1.steps, 6);
  ASSERT_FALSE(r1.last_checkpoint.empty());
  clear_stop_request();
  TrainResult r2 = train(part);
  EXPECT_EQ(r2.first_step, r1.steps);
  EXPECT_EQ(r2.steps, 6);
  expect_bitwise_equal(final_weights(full.out), final_weights(part.out));
  // No step appears twice in the metrics of the resumed run.
  std::set<int64_t> seen;
  for (const auto& l : MetricsLog::read(part.out + "/metrics.jsonl"))
    if (l.contains("loss")) EXPECT_TRUE(seen.insert(l.at("step").get<int64_t>()).second);
  EXPECT_EQ(seen.size(), 6u);
}

TEST_F(TrainerTest, CorruptCheckpointIsRefusedAndThePreviousOneResumes) {
  TrainOptions full = base("full");
  train(full);
  TrainOptions part = base("part");
  part.max_steps = 4;
  part.save_steps = 2;
  part.save_total_limit = 0;
  // Same schedule as the 6-step run: the LR depends on total steps, so keep them equal by
  // stopping early through a corrupt tail instead: train 4 of 6 steps with a cosine over 6.
  part.lr_scheduler_type = full.lr_scheduler_type;
  part.max_steps = 6;
  TrainResult r1 = train_until_sigterm(
      part, [&] { return list_checkpoints(part.out + "/checkpoints").size() >= 2; });
  clear_stop_request();
  auto list = list_checkpoints(part.out + "/checkpoints");
  ASSERT_GE(list.size(), 2u);
  // Flip one byte in the newest checkpoint's weights.
  const std::string victim = list.back() + "/model.safetensors";
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(victim) - 3));
    char c = 0;
    f.read(&c, 1);
    f.seekp(static_cast<std::streamoff>(fs::file_size(victim) - 3));
    c = static_cast<char>(c ^ 0x5a);
    f.write(&c, 1);
  }
  EXPECT_THROW(load_checkpoint(list.back()), Error);
  TrainResult r2 = train(part);
  const int64_t previous = load_checkpoint(list[list.size() - 2]).step;
  EXPECT_EQ(r2.first_step, previous) << "resumed from the checkpoint before the corrupt one";
  EXPECT_EQ(r2.steps, 6);
  expect_bitwise_equal(final_weights(full.out), final_weights(part.out));
  (void)r1;
}

// Running a finished run's command again resumes at its last step and trains nothing: the
// result names that checkpoint (it said "done: 3 steps, last loss 0, checkpoint " with no path
// until session 15); a --resume path that does not exist is named with the flag's choices.
TEST_F(TrainerTest, ARerunOfAFinishedRunTrainsNothingAndNamesItsCheckpoint) {
  TrainOptions o = base("rerun");
  o.max_steps = 2;
  const TrainResult first = train(o);
  ASSERT_EQ(first.steps, 2);
  const TrainResult again = train(o);
  EXPECT_EQ(again.first_step, 2);
  EXPECT_EQ(again.steps, 2);
  EXPECT_EQ(again.last_checkpoint, first.last_checkpoint);
  o.max_steps = 1;  // below the checkpoint: nothing to train either, and no step undone
  const TrainResult lower = train(o);
  EXPECT_EQ(lower.steps, 2);
  EXPECT_EQ(lower.last_checkpoint, first.last_checkpoint);
  o.resume = path("rerun") + "/checkpoints/autoo";
  try {
    train(o);
    ADD_FAILURE() << "a missing --resume path was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("no such checkpoint directory (--resume takes auto, never"),
              std::string::npos) << e.what();
  }
}

// Resuming with settings that make the continuation not the saved run is refused before any
// tensor is read, each naming the option, both values and the way out: another --seed (it orders
// the data the cursor indexes; the data cursor's own refusal did not name the flag), `opd sft`
// on an `opd train` run (resumed silently until session 16), a --student of another shape (an
// "invalid data: checkpoint tensor ..." that blamed the checkpoint) and edited --data (a bare
// "data cursor: saved for dataset <sha>" naming neither flag nor file). The run then resumes.
TEST_F(TrainerTest, AResumeThatWouldNotContinueTheSavedRunIsRefusedNamingBothValues) {
  TrainOptions first = base("refuse");
  first.max_steps = 2;
  ASSERT_EQ(train(first).steps, 2);
  const std::string ckpt = list_checkpoints(first.out + "/checkpoints").back();
  auto expect_refused = [&](TrainOptions o, const std::vector<std::string>& needles) {
    o.max_steps = 4;
    try {
      train(o);
      ADD_FAILURE() << "resumed; expected a refusal naming " << needles.front();
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument) << e.what();
      for (const auto& n : needles)
        EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << "no '" << n << "' in " << e.what();
    }
    EXPECT_EQ(list_checkpoints(first.out + "/checkpoints").size(), 1u) << "nothing was trained";
  };
  TrainOptions o = first;
  o.seed = 7;
  expect_refused(o, {"cannot resume from " + ckpt, "--seed was 42 in the checkpoint, now 7",
                     "--student " + ckpt + " --out NEW_DIR"});
  o = first;
  o.sft = true;
  o.teacher = "";
  expect_refused(o, {"the command was opd train in the checkpoint, now opd sft"});
  o = first;
  save_model_dir(path("wide"), test::tiny_demo_config(48, 1), init_weights(test::tiny_demo_config(48, 1), 1),
                 test::source_dir() + "/demo/tokenizer");
  o.student = path("wide");
  expect_refused(o, {"--student " + path("wide") + " is not the model the checkpoint trained",
                     "model.embed_tokens.weight is [272, 48] in --student",
                     "--student was \"" + path("student") + "\" in the checkpoint"});
  {  // the same file edited: its last line moved to the front (same count, other order)
    std::ifstream in(path("train.jsonl"));
    std::vector<std::string> lines;
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    std::ofstream out(path("edited.jsonl"));
    out << lines.back() << "\n";
    for (size_t i = 0; i + 1 < lines.size(); ++i) out << lines[i] << "\n";
  }
  o = first;
  o.data = {path("edited.jsonl")};
  expect_refused(o, {"its data cursor does not fit this run's data (--data was [\"" + path("train.jsonl") +
                         "\"] in the checkpoint, now [\"" + path("edited.jsonl") + "\"])",
                     "the data or its tokenization changed"});
  o = first;
  o.max_steps = 4;
  EXPECT_EQ(train(o).steps, 4) << "the saved settings still resume";
}

// Legitimate changes are warned about naming the flag and both values (the learning-rate
// scheduler, --max-steps, warmup and the teacher resumed silently until session 16, when only 11
// hard-coded options were compared); settings of how the same steps are computed or saved
// (--micro-batch-size, --save-total-limit) are not.
TEST_F(TrainerTest, ALegitimateChangeOnResumeIsWarnedNamingOldAndNewValues) {
  TrainOptions o = base("warn");
  o.max_steps = 2;
  ASSERT_EQ(train(o).steps, 2);
  save_model_dir(path("teacher2"), test::tiny_demo_config(48, 2),
                 init_weights(test::tiny_demo_config(48, 2), 5, 0.1), test::source_dir() + "/demo/tokenizer");
  o.max_steps = 4;
  o.learning_rate = 2e-2;
  o.lr_scheduler_type = "linear";
  o.warmup_steps = 1;
  o.teacher = path("teacher2");
  o.micro_batch_size = 2;
  o.save_total_limit = 1;
  const TrainResult r = train(o);
  EXPECT_EQ(r.first_step, 2);
  EXPECT_EQ(r.steps, 4);
  std::ifstream f(o.out + "/train.log");
  const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  for (const std::string& w :
       {std::string("resume: --learning-rate was 0.01 in the checkpoint, now 0.02"),
        std::string("resume: --lr-scheduler-type was \"cosine\" in the checkpoint, now \"linear\""),
        std::string("resume: --warmup-steps was 0 in the checkpoint, now 1"),
        std::string("resume: --max-steps was 2 in the checkpoint, now 4"),
        "resume: --teacher was \"" + path("teacher") + "\" in the checkpoint, now \"" + path("teacher2") + "\""})
    EXPECT_NE(log.find(w), std::string::npos) << "no '" << w << "' in\n" << log;
  EXPECT_EQ(log.find("--micro-batch-size was"), std::string::npos) << log;
  EXPECT_EQ(log.find("--save-total-limit was"), std::string::npos) << log;
}

// A teacher whose weights were rewritten under the same --teacher path (robustness.md session
// 16 left it undetected: the options compare the path only): each checkpoint saves the
// teacher's weights fingerprint and a resume warns naming both; an unchanged teacher resumes
// without a word about it.
TEST_F(TrainerTest, ATeacherRewrittenUnderTheSamePathIsWarnedOnResume) {
  auto log_of = [](const std::string& out) {
    std::ifstream f(out + "/train.log");
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  };
  TrainOptions o = base("same");
  o.max_steps = 2;
  ASSERT_EQ(train(o).steps, 2);
  o.max_steps = 3;
  ASSERT_EQ(train(o).first_step, 2);
  EXPECT_EQ(log_of(o.out).find("teacher's weights fingerprint"), std::string::npos) << log_of(o.out);

  o = base("rewritten");
  o.max_steps = 2;
  const TrainResult first = train(o);
  ASSERT_EQ(first.steps, 2);
  std::ifstream state(first.last_checkpoint + "/state.json");
  const nlohmann::json saved = nlohmann::json::parse(state)["teacher"];
  EXPECT_EQ(saved["teacher"], path("teacher"));
  const std::string before = saved["weights_fingerprint"].get<std::string>();
  ASSERT_EQ(before.size(), 64u);
  // Retrained in place: same config, names and shapes, other values.
  const ModelConfig tc = test::tiny_demo_config(48, 2);
  save_model_dir(path("teacher"), tc, init_weights(tc, 9, 0.1), test::source_dir() + "/demo/tokenizer");
  o.max_steps = 3;
  ASSERT_EQ(train(o).first_step, 2);
  const std::string log = log_of(o.out);
  const std::string w = "resume: the teacher's weights fingerprint (config.json, safetensors "
                        "headers and sampled data) was " + before.substr(0, 16) + " (--teacher \"" +
                        path("teacher") + "\") in the checkpoint, now ";
  EXPECT_NE(log.find(w), std::string::npos) << "no '" << w << "' in\n" << log;
  EXPECT_NE(log.find("its files changed under the same path"), std::string::npos) << log;
  EXPECT_EQ(log.find("--teacher was"), std::string::npos) << "the path did not change\n" << log;
}

// `--resume PATH` of an older checkpoint (of this run or another) while --out holds later ones:
// they are written over as the run passes their steps, which was silent until session 16.
TEST_F(TrainerTest, ResumingAnOlderCheckpointWarnsThatLaterOnesAreOverwritten) {
  TrainOptions o = base("rewind");
  o.max_steps = 4;
  o.save_steps = 2;
  ASSERT_EQ(train(o).steps, 4);
  const auto list = list_checkpoints(o.out + "/checkpoints");
  ASSERT_EQ(list.size(), 2u);
  o.resume = list.front();
  EXPECT_EQ(train(o).first_step, 2);
  std::ifstream f(o.out + "/train.log");
  const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::string w = "resume: --resume " + list.front() + " is at step 2 but " + o.out +
                        "/checkpoints holds later checkpoints (the newest " + list.back() + ")";
  EXPECT_NE(log.find(w), std::string::npos) << "no '" << w << "' in\n" << log;
}

// A student whose chat template lives in chat_template.jinja (how recent transformers save it)
// keeps it: the run renders chat lines with it, and every checkpoint's Hugging Face export
// carries the file (it was neither read nor exported until session 15).
TEST_F(TrainerTest, AChatTemplateJinjaFileIsUsedAndExported) {
  const std::string tmpl = "{% for m in messages %}{{ m['content'] }}{% endfor %}";
  std::ofstream(path("student") + "/chat_template.jinja") << tmpl;
  std::ofstream(path("chat.jsonl")) << "{\"messages\": [{\"role\": \"user\", \"content\": \"1+2=\"}, "
                                       "{\"role\": \"assistant\", \"content\": \"3\"}]}\n";
  TrainOptions o = base("jinja");
  o.data = {path("chat.jsonl")};
  o.max_steps = 1;
  o.lmbda = 0;
  const TrainResult r = train(o);
  ASSERT_EQ(r.steps, 1);
  std::ifstream f(r.last_checkpoint + "/chat_template.jinja");
  ASSERT_TRUE(f.good()) << "no chat_template.jinja in " << r.last_checkpoint;
  const std::string got((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(got, tmpl);
}

TEST_F(TrainerTest, NonFiniteStepsAreSkippedSavedAndBounded) {
  // A student whose final norm holds a NaN: every loss is NaN.
  ModelConfig c = test::tiny_demo_config(32, 1);
  ModelWeights w = init_weights(c, 1);
  w.final_norm.data<float>()[3] = std::nanf("");
  save_model_dir(path("nan_student"), c, w, test::source_dir() + "/demo/tokenizer");
  TrainOptions o = base("nan");
  o.student = path("nan_student");
  o.lmbda = 0;  // dataset completions: a NaN student cannot sample (the rollout names the logit)
  o.max_bad_steps = 2;
  try {
    train(o);
    FAIL() << "a run whose every step is non-finite must stop";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidData);
    EXPECT_NE(std::string(e.what()).find("--max-bad-steps"), std::string::npos) << e.what();
  }
  // Named by the step as metrics.jsonl and the log number it (1-based; was step-0 until
  // session 15, one less than the metrics' step).
  EXPECT_FALSE(fs::exists(o.out + "/bad_batches/step-0.json"));
  EXPECT_TRUE(fs::exists(o.out + "/bad_batches/step-1.json"));
  auto bad = nlohmann::json::parse(std::ifstream(o.out + "/bad_batches/step-1.json"));
  EXPECT_EQ(bad["sequences"].size(), 4u);
  // The weights were never updated with a NaN: the skipped steps wrote no checkpoint.
  EXPECT_TRUE(list_checkpoints(o.out + "/checkpoints").empty());
}

TEST_F(TrainerTest, ANonFiniteRolloutIsABadStepToo) {
  // On-policy, the NaN student cannot sample: each such step is skipped, counted and its
  // prompts saved, and the run stops after --max-bad-steps (not at the first one).
  ModelConfig c = test::tiny_demo_config(32, 1);
  ModelWeights w = init_weights(c, 1);
  w.final_norm.data<float>()[3] = std::nanf("");
  save_model_dir(path("nan_student"), c, w, test::source_dir() + "/demo/tokenizer");
  TrainOptions o = base("nan_rollout");
  o.student = path("nan_student");
  o.lmbda = 1;
  o.max_bad_steps = 2;
  try {
    train(o);
    FAIL() << "a run whose every rollout fails must stop";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidData);
    EXPECT_NE(std::string(e.what()).find("--max-bad-steps"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("is not finite"), std::string::npos) << e.what();
  }
  // Every skipped step in metrics.jsonl has its batch under the same step number.
  std::vector<int64_t> skipped;
  for (const auto& l : MetricsLog::read(o.out + "/metrics.jsonl"))
    if (l.value("skipped", 0) == 1) skipped.push_back(l.at("step").get<int64_t>());
  EXPECT_EQ(skipped, (std::vector<int64_t>{1, 2}));
  EXPECT_FALSE(fs::exists(o.out + "/bad_batches/step-0.json"));
  for (int step : {1, 2, 3}) {
    const std::string f = o.out + "/bad_batches/step-" + std::to_string(step) + ".json";
    ASSERT_TRUE(fs::exists(f)) << f;
    auto bad = nlohmann::json::parse(std::ifstream(f));
    EXPECT_EQ(bad["sequences"].size(), 4u);
    EXPECT_NE(bad["reason"].get<std::string>().find("rollout failed"), std::string::npos);
  }
  EXPECT_TRUE(list_checkpoints(o.out + "/checkpoints").empty());
}

TEST_F(TrainerTest, AnInProcessTeachersBadScoresStopTheRunBeforeAnyUpdate) {
  // A teacher whose top-K ids all lie beyond the student's vocabulary fails the payload check
  // under --vocab-policy clip-to-student: the run stops at the first step with the check's
  // message, before any gradient is applied or checkpoint written. (On the CPU the check runs
  // in the step; on the GPU beside the first micro-batch's forward, CudaTrainerTest's twin.)
  test::write_teacher_beyond_student_vocab(path("far_teacher"), test::tiny_demo_config(48, 2));
  for (double lmbda : {0.0, 1.0}) {
    TrainOptions o = base(lmbda == 0 ? "far_teacher_dataset" : "far_teacher_on_policy");
    o.teacher = path("far_teacher");
    o.vocab_policy = "clip-to-student";
    o.lmbda = lmbda;
    test::expect_payload_check_stops_the_run(o);
  }
}

TEST_F(TrainerTest, BadOptionsAreNamed) {
  auto expect_msg = [&](TrainOptions o, const std::string& needle) {
    try {
      train(o);
      ADD_FAILURE() << "expected an error mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  TrainOptions o = base("bad");
  o.lmbda = 1.5;
  expect_msg(o, "--lmbda");
  o = base("bad");
  o.teacher_url = "http://127.0.0.1:1";
  expect_msg(o, "exactly one of --teacher");
  o = base("bad");
  o.loss_support = "dense";
  expect_msg(o, "dense");
  o = base("bad");
  o.data = {path("missing.jsonl")};
  expect_msg(o, "missing.jsonl");
  o = base("bad");
  o.recompute_granularity = "selective";
  expect_msg(o, "'selective' is not one of none, elementwise, layer");
  o = base("bad");
  o.offload_teacher = true;  // the CPU backend has no device memory to save
  expect_msg(o, "--offload-teacher needs --device cuda");
  o = base("bad");
  o.device_memory_budget_gb = 16;  // a budget of device memory on the CPU backend
  expect_msg(o, "--device-memory-budget 16 must be >= 0 and needs --device cuda");
  o = base("bad");
  o.device = "cuda";
  o.device_memory_budget_gb = -1;
  expect_msg(o, "--device-memory-budget -1 must be >= 0");
  o = base("bad");
  o.device = "cuda";
  o.offload_teacher = true;
  o.loss_support = "full";
  expect_msg(o, "--offload-teacher cannot be used with --loss-support full");
  o = base("bad");
  o.teacher = "";
  o.teacher_url = "http://127.0.0.1:1, ";
  expect_msg(o, "entry 2 is empty");
  // A teacher with another vocabulary is refused unless a policy says what to do.
  ModelConfig c = test::tiny_demo_config(48, 1);
  c.vocab_size = 288;
  save_model_dir(path("other_teacher"), c, init_weights(c, 3), test::source_dir() + "/demo/tokenizer");
  o = base("bad");
  o.teacher = path("other_teacher");
  expect_msg(o, "not compatible");
}

}  // namespace
}  // namespace opd
