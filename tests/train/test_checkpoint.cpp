// Checkpoints: round trip, LATEST, keep-last-N, refusal of corrupt/truncated/incomplete
// checkpoints with named errors and fallback to the previous one; signal flags; LR schedules.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numbers>

#include "common/test_util.h"
#include "core/sha256.h"
#include "train/checkpoint.h"
#include "train/schedule.h"
#include "train/signals.h"

namespace opd {
namespace {
namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() /
           ("opd_ckpt_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  static int& counter() {
    static int c = 0;
    return c;
  }
};

CheckpointData sample(int64_t step) {
  CheckpointData d;
  d.step = step;
  d.tensor_files["model"]["w"] = test::random_uniform({3, 5}, DType::F32, 10 + step);
  d.tensor_files["model"]["b"] = test::random_uniform({5}, DType::F64, 20 + step);
  d.tensor_files["optimizer"]["exp_avg.w"] = test::random_uniform({3, 5}, DType::F32, 30 + step);
  d.state["rng"] = {{"seed", 1234}, {"counter", step * 7}};
  d.state["data_cursor"] = {{"epoch", 0}, {"index", step * 64}};
  return d;
}

TEST(Checkpoint, RoundTripIsExact) {
  TempDir root;
  CheckpointData d = sample(3);
  std::string dir = save_checkpoint(root.path.string(), d, 0);
  EXPECT_EQ(fs::path(dir).filename(), "step-00000003");
  CheckpointData back = load_checkpoint(dir);
  EXPECT_EQ(back.step, 3);
  EXPECT_EQ(back.state["data_cursor"]["index"], 192);
  for (const auto& [file, tensors] : d.tensor_files)
    for (const auto& [name, t] : tensors) {
      const Tensor& b = back.tensor_files.at(file).at(name);
      ASSERT_EQ(b.shape(), t.shape());
      ASSERT_EQ(b.dtype(), t.dtype());
      EXPECT_EQ(0, std::memcmp(b.raw(), t.raw(), t.nbytes())) << file << "/" << name;
    }
  std::ifstream latest(root.path / "LATEST");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step-00000003");
}

TEST(Checkpoint, KeepLastDeletesOnlyOlderOnes) {
  TempDir root;
  for (int s = 1; s <= 5; ++s) save_checkpoint(root.path.string(), sample(s), 2);
  auto all = list_checkpoints(root.path.string());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(fs::path(all[0]).filename(), "step-00000004");
  EXPECT_EQ(fs::path(all[1]).filename(), "step-00000005");
  // keep_last = 0 keeps everything.
  for (int s = 6; s <= 8; ++s) save_checkpoint(root.path.string(), sample(s), 0);
  EXPECT_EQ(list_checkpoints(root.path.string()).size(), 5u);
}

// A second checkpoint of the same step (a run resumed from an older step re-saves it) replaces
// the first: step-N names a complete checkpoint at every instant (the folders swap names
// atomically; session 16: the old folder used to be deleted before the new one was renamed in).
// Folders a replacement left behind (".old-PID" after a crash between two renames where the file
// system cannot exchange) are removed by the next save, as unfinished temp folders are.
TEST(Checkpoint, ASecondSaveOfAStepReplacesItAndLeavesNothingBehind) {
  TempDir root;
  CheckpointData a = sample(3), b = sample(3);
  b.state["data_cursor"]["index"] = 999;
  b.tensor_files["model"]["w"] = test::random_uniform({3, 5}, DType::F32, 77);
  save_checkpoint(root.path.string(), a, 0);
  fs::create_directories(root.path / "step-00000002.old-424242");  // a replacement's leftover
  std::ofstream(root.path / "LATEST.tmp-424242") << "step-00000002\n";  // an interrupted update
  const std::string dir = save_checkpoint(root.path.string(), b, 0);
  EXPECT_EQ(fs::path(dir).filename(), "step-00000003");
  CheckpointData back = load_checkpoint(dir);
  EXPECT_EQ(back.state["data_cursor"]["index"], 999);
  const Tensor& w = back.tensor_files.at("model").at("w");
  EXPECT_EQ(0, std::memcmp(w.raw(), b.tensor_files["model"]["w"].raw(), w.nbytes()));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root.path)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"LATEST", "step-00000003"}));
}

TEST(Checkpoint, CorruptionIsRefusedByNameAndTheRunFallsBack) {
  TempDir root;
  save_checkpoint(root.path.string(), sample(1), 0);
  std::string d2 = save_checkpoint(root.path.string(), sample(2), 0);

  // Flip one byte in the newest model file: refused, naming the file; fallback to step 1.
  {
    std::fstream f(d2 + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-3, std::ios::end);
    char c;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(-3, std::ios::end);
    f.write(&c, 1);
  }
  try {
    load_checkpoint(d2);
    FAIL() << "corrupt checkpoint accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("SHA-256"), std::string::npos) << e.what();
  }
  auto latest = load_latest_checkpoint(root.path.string());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 1);

  // Truncation is named as such.
  std::string d3 = save_checkpoint(root.path.string(), sample(3), 0);
  fs::resize_file(d3 + "/state.json", 3);
  try {
    load_checkpoint(d3);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
  // A folder without a manifest (a crash before the rename cannot produce this name, but a
  // hand-copied folder can) is incomplete.
  fs::remove(d3 + "/MANIFEST.json");
  EXPECT_THROW(load_checkpoint(d3), Error);
  // Leftover temp folders from a crash are ignored.
  fs::create_directories(root.path / "step-00000009.tmp-123");
  EXPECT_EQ(load_latest_checkpoint(root.path.string())->step, 1);
}

// A checkpoint's step is written in state.json, MANIFEST.json and its directory's name; an
// edited state.json with a re-sealed manifest (SHA-256 and size recomputed) must not resume at
// another step (until session 15 it said "resumed from checkpoint step 7" in step-00000003).
TEST(Checkpoint, AStepThatDisagreesWithTheManifestOrTheNameIsRefused) {
  TempDir root;
  const std::string d = save_checkpoint(root.path.string(), sample(3), 0);
  auto read = [](const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  };
  auto reseal = [&](const std::function<void(nlohmann::json&)>& state_edit,
                    const std::function<void(nlohmann::json&)>& manifest_edit) {
    auto state = nlohmann::json::parse(read(d + "/state.json"));
    state_edit(state);
    const std::string text = state.dump();
    std::ofstream(d + "/state.json", std::ios::binary | std::ios::trunc) << text;
    auto m = nlohmann::json::parse(read(d + "/MANIFEST.json"));
    m["files"]["state.json"]["sha256"] = sha256_hex(text);
    m["files"]["state.json"]["bytes"] = text.size();
    manifest_edit(m);
    std::ofstream(d + "/MANIFEST.json", std::ios::binary | std::ios::trunc) << m.dump();
  };
  auto refused = [&](const std::string& needle) {
    try {
      load_checkpoint(d);
      ADD_FAILURE() << "accepted; expected: " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidData) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  reseal([](auto& st) { st["step"] = 7; }, [](auto&) {});
  refused("state.json says step 7, MANIFEST.json says 3");
  reseal([](auto&) {}, [](auto& m) { m["step"] = 7; });
  refused("state.json says step 7 but the directory is named step-00000003");
  reseal([](auto& st) { st["step"] = 3; }, [](auto& m) { m["step"] = 3; });
  EXPECT_EQ(load_checkpoint(d).step, 3);
  // A manifest that does not list state.json says so (the file itself is there).
  reseal([](auto&) {}, [](auto& m) { m["files"].erase("state.json"); });
  refused("lists no state.json");
  // A path that is not there is named as such, not as "has no MANIFEST.json".
  try {
    load_checkpoint((root.path / "autoo").string());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("autoo does not exist"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, NothingToResumeFrom) {
  TempDir root;
  EXPECT_FALSE(load_latest_checkpoint(root.path.string()).has_value());
  EXPECT_FALSE(load_latest_checkpoint((root.path / "missing").string()).has_value());
}

TEST(Signals, HangupIsCountedAndDoesNotStop) {
  install_training_signal_handlers();
  clear_stop_request();
  int before = hangups_received();
  ASSERT_EQ(::raise(SIGHUP), 0);
  EXPECT_EQ(hangups_received(), before + 1);  // and we are still running
  EXPECT_EQ(stop_requested(), StopRequest::None);
  ASSERT_EQ(::raise(SIGPIPE), 0);  // ignored
  ASSERT_EQ(::raise(SIGTERM), 0);
  EXPECT_EQ(stop_requested(), StopRequest::Terminate);
  clear_stop_request();
  ASSERT_EQ(::raise(SIGINT), 0);  // the first SIGINT only requests a stop
  EXPECT_EQ(stop_requested(), StopRequest::Interrupt);
  clear_stop_request();
}

TEST(LrSchedule, MatchesTheTransformersFormulas) {
  LrSchedule s;
  s.base_lr = 1e-3;
  s.warmup_steps = 10;
  s.total_steps = 110;
  s.kind = LrScheduleKind::Cosine;
  EXPECT_DOUBLE_EQ(s.lr_at(0), 0.0);
  EXPECT_DOUBLE_EQ(s.lr_at(5), 0.5e-3);
  EXPECT_DOUBLE_EQ(s.lr_at(10), 1e-3);
  EXPECT_NEAR(s.lr_at(60), 0.5e-3, 1e-15);                               // half way: cos(pi/2)
  EXPECT_NEAR(s.lr_at(35), 1e-3 * 0.5 * (1 + std::cos(std::numbers::pi * 0.25)), 1e-15);
  EXPECT_NEAR(s.lr_at(110), 0.0, 1e-18);
  s.kind = LrScheduleKind::Linear;
  EXPECT_DOUBLE_EQ(s.lr_at(60), 0.5e-3);
  EXPECT_DOUBLE_EQ(s.lr_at(200), 0.0);
  s.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(s.lr_at(200), 1e-4);
  s.kind = LrScheduleKind::Constant;
  EXPECT_DOUBLE_EQ(s.lr_at(500), 1e-3);
  EXPECT_EQ(parse_lr_schedule("cosine"), LrScheduleKind::Cosine);
  EXPECT_THROW(parse_lr_schedule("exponential"), Error);
}

}  // namespace
}  // namespace opd
