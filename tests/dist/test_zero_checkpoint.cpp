// Sharded ZeRO checkpoints (dist/zero_checkpoint.h) over forked processes with the CPU
// communicator: a 2-rank checkpoint resumes on 1, 2 and 3 ranks (and a full single-process
// checkpoint on 2) and the next step equals an uninterrupted single-process AdamW bitwise (the
// gradient comes from rank 0 only, so sums are exact and nothing depends on the world size); the
// folder holds every rank's shard in its manifest and a model export equal to the master
// weights; a rank whose shard write fails makes the save fail on every rank naming it, with the
// previous checkpoint still the latest; a corrupt shard makes the checkpoint corrupt.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "common/test_util.h"
#include "dist/zero_checkpoint.h"
#include "dist_test_util.h"
#include "model/safetensors.h"

namespace opd::dist {
namespace {

namespace fs = std::filesystem;
using test::expect;

const std::vector<Shape> kShapes = {{7, 5}, {13}, {3, 4, 2}, {1}, {100}, {2, 33}};
const std::vector<std::string> kNames = {"a.weight", "b.bias", "c.weight", "d", "e.weight", "f.weight"};

Tensor weight(size_t i) { return test::random_uniform(kShapes[i], DType::F32, 50 + i, -1, 1); }
Tensor grad_at(size_t i, int step) {
  return test::random_uniform(kShapes[i], DType::F32, 9000 + 100 * step + i, -0.5, 0.5);
}

// Single-process AdamW after `steps` steps (the reference of every resumed run).
struct Reference {
  std::vector<Tensor> master, grad;
  std::unique_ptr<AdamW> opt;
  explicit Reference(int steps) {
    std::vector<OptimParam> ps;
    for (size_t i = 0; i < kShapes.size(); ++i) {
      master.push_back(weight(i));
      grad.push_back(Tensor::zeros(kShapes[i], DType::F32));
      ps.push_back({master[i], grad[i], Tensor()});
    }
    opt = std::make_unique<AdamW>(ps, AdamWConfig{});
    for (int s = 1; s <= steps; ++s) {
      for (size_t i = 0; i < kShapes.size(); ++i) grad[i].copy_from(grad_at(i, s));
      opt->step(1e-2, 0);
    }
  }
};

std::string bitwise(const Tensor& a, const Tensor& b, const std::string& what) {
  if (a.numel() != b.numel() || a.dtype() != b.dtype()) return what + ": size or dtype; ";
  Tensor ha = a.to(Device::CPU), hb = b.to(Device::CPU);
  return std::memcmp(ha.raw(), hb.raw(), ha.nbytes()) == 0 ? "" : what + ": not bitwise equal; ";
}

class ZeroCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = cat(::testing::TempDir(), "/opd_zero_ckpt_", ::getpid(), "_",
                ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  static std::unique_ptr<ZeroOptimizer> make(Communicator& comm, int64_t bucket) {
    ZeroConfig zc;
    zc.bucket_numel = bucket;
    zc.align = 4;
    zc.model_dtype = DType::F32;
    return std::make_unique<ZeroOptimizer>(comm, kShapes, zc);
  }
  static void feed(ZeroOptimizer& zo, int rank, int step) {
    if (rank != 0) return;  // only rank 0 contributes: the global gradient is exact
    for (size_t i = 0; i < kShapes.size(); ++i) zo.grad(i).copy_from(grad_at(i, step));
  }
  static CheckpointData data(int64_t step) {
    CheckpointData d;
    d.step = step;
    d.state["note"] = "zero checkpoint test";
    d.files["config.json"] = "{\"model_type\": \"test\"}";
    return d;
  }
  // A `world`-rank job: steps 1..steps, a sharded checkpoint after each step in save_at.
  void train_and_save(int world, int steps, std::vector<int> save_at, const char* fault = nullptr) {
    const int port = pick_free_port();
    auto out = test::run_ranks(world, [&](int rank) {
      if (fault) ::setenv("OPD_TEST_CKPT_FAULT", fault, 1);
      auto comm = make_cpu_communicator(Store::connect(test::local_env(rank, world, port), 60));
      auto zo = make(*comm, 40);
      std::vector<Tensor> w;
      for (size_t i = 0; i < kShapes.size(); ++i) w.push_back(weight(i));
      zo->load_weights(w);
      std::string err;
      for (int s = 1; s <= steps; ++s) {
        feed(*zo, rank, s);
        zo->step(1e-2, 0);
        if (std::find(save_at.begin(), save_at.end(), s) == save_at.end()) continue;
        try {
          const std::string path = save_zero_checkpoint(*zo, root_, data(s), kNames, 0);
          err += expect(path == cat(root_, "/step-0000000", s), "returned path " + path);
        } catch (const Error& e) {
          // A failed save: every rank reports it, naming the failing rank and its file.
          const std::string m = e.what();
          return cat("save failed: ", m);
        }
      }
      return err;
    });
    outcomes_ = out;
  }
  // Resume the newest verified checkpoint on `world` ranks (bucket size other than the writer's),
  // take step `step`, and compare with `steps`-step single-process AdamW bitwise.
  void resume_and_check(int world, int step) {
    const int port = pick_free_port();
    auto out = test::run_ranks(world, [&](int rank) {
      auto comm = make_cpu_communicator(Store::connect(test::local_env(rank, world, port), 60));
      auto zo = make(*comm, 1000);
      // The ranks share the verification and agree on the newest checkpoint that verifies.
      auto ck = load_checkpoint_collectively(comm->store(), root_, "");
      if (!ck) return std::string("no checkpoint");
      if (!ck->tensor_files.empty()) return std::string("tensors were loaded");
      load_zero_checkpoint(*zo, *ck, kNames, kShapes);
      std::string err = expect(zo->steps() == ck->step, "steps after load");
      feed(*zo, rank, step);
      zo->step(1e-2, 0);
      Reference ref(step);
      auto st = zo->gather_state();
      for (size_t i = 0; i < kShapes.size(); ++i) {
        err += bitwise(st.master[i], ref.master[i], cat("master ", i));
        err += bitwise(st.exp_avg[i], ref.opt->exp_avg()[i], cat("exp_avg ", i));
        err += bitwise(st.exp_avg_sq[i], ref.opt->exp_avg_sq()[i], cat("exp_avg_sq ", i));
        err += bitwise(zo->param(i), ref.master[i], cat("model copy ", i));
      }
      return err;
    });
    EXPECT_TRUE(test::all_ok(out)) << "resume on " << world << " ranks";
  }
  std::string root_;
  std::vector<test::RankOutcome> outcomes_;
};

TEST_F(ZeroCheckpoint, TwoRankCheckpointResumesOnOneTwoAndThreeRanks) {
  train_and_save(2, 2, {1, 2});
  ASSERT_TRUE(test::all_ok(outcomes_));
  const auto list = list_checkpoints(root_);
  ASSERT_EQ(list.size(), 2u);
  // The folder: every rank's shard in the manifest, the model export = the master weights.
  const CheckpointData ck = load_checkpoint(list.back());
  EXPECT_EQ(ck.step, 2);
  EXPECT_TRUE(is_sharded_checkpoint(ck));
  EXPECT_EQ(ck.state.at("note"), "zero checkpoint test");
  EXPECT_EQ(ck.state.at("optimizer_steps"), 2);
  EXPECT_EQ(ck.files.at("config.json"), "{\"model_type\": \"test\"}");
  EXPECT_TRUE(ck.tensor_files.count("optimizer.rank-00000-of-00002"));
  EXPECT_TRUE(ck.tensor_files.count("optimizer.rank-00001-of-00002"));
  const Reference ref2(2);
  for (size_t i = 0; i < kShapes.size(); ++i)
    EXPECT_EQ(bitwise(ck.tensor_files.at("model").at(kNames[i]), ref2.master[i], kNames[i]), "");
  std::ifstream latest(root_ + "/LATEST");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step-00000002");
  for (const auto& e : fs::directory_iterator(root_))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();

  // One process: the full state, through the same re-sharding reader.
  const CheckpointData lazy = load_checkpoint(list.back(), {true, false});
  const auto full = read_full_state(lazy, kNames, kShapes);
  EXPECT_EQ(full.steps, 2);
  for (size_t i = 0; i < kShapes.size(); ++i) {
    EXPECT_EQ(bitwise(full.master[i], ref2.master[i], "master"), "");
    EXPECT_EQ(bitwise(full.exp_avg[i], ref2.opt->exp_avg()[i], "exp_avg"), "");
    EXPECT_EQ(bitwise(full.exp_avg_sq[i], ref2.opt->exp_avg_sq()[i], "exp_avg_sq"), "");
  }
  for (int world : {1, 2, 3}) resume_and_check(world, 3);
}

TEST_F(ZeroCheckpoint, FullSingleProcessCheckpointResumesOnTwoRanks) {
  const Reference ref(2);
  CheckpointData d = data(2);
  for (size_t i = 0; i < kShapes.size(); ++i) {
    d.tensor_files["model"][kNames[i]] = ref.master[i];
    d.tensor_files["optimizer"]["exp_avg." + kNames[i]] = ref.opt->exp_avg()[i];
    d.tensor_files["optimizer"]["exp_avg_sq." + kNames[i]] = ref.opt->exp_avg_sq()[i];
  }
  d.state["optimizer_steps"] = 2;
  save_checkpoint(root_, d, 0);
  resume_and_check(2, 3);
  resume_and_check(3, 3);
}

TEST_F(ZeroCheckpoint, AFailedShardWriteFailsTheSaveOnEveryRank) {
  train_and_save(2, 2, {1, 2}, "fail:1:2");
  ASSERT_EQ(outcomes_.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(outcomes_[r].ok()) << "rank " << r;
    const std::string& m = outcomes_[r].message;
    EXPECT_NE(m.find("checkpoint step 2 failed"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 1 could not write"), std::string::npos) << m;
    EXPECT_NE(m.find("optimizer.rank-00001-of-00002.safetensors"), std::string::npos) << m;
    EXPECT_NE(m.find("previous checkpoint stays the latest"), std::string::npos) << m;
  }
  const auto list = list_checkpoints(root_);
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(fs::path(list[0]).filename(), "step-00000001");
  std::ifstream latest(root_ + "/LATEST");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step-00000001");
  for (const auto& e : fs::directory_iterator(root_))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << "left behind: " << e.path();
  resume_and_check(3, 2);  // the previous checkpoint is whole
}

TEST_F(ZeroCheckpoint, ACorruptShardMakesTheCheckpointCorrupt) {
  train_and_save(2, 2, {1, 2});
  ASSERT_TRUE(test::all_ok(outcomes_));
  const std::string shard = root_ + "/step-00000002/optimizer.rank-00001-of-00002.safetensors";
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x40);
    f.seekp(-5, std::ios::end);
    f.write(&c, 1);
  }
  try {
    load_checkpoint(root_ + "/step-00000002", {true, false});
    ADD_FAILURE() << "a corrupt shard was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(shard), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("SHA-256"), std::string::npos) << e.what();
  }
  std::string path;
  auto ck = load_latest_checkpoint(root_, &path, {true, false});
  ASSERT_TRUE(ck.has_value());
  EXPECT_EQ(ck->step, 1);
  resume_and_check(3, 2);  // falls back to step 1, then takes step 2
  // An explicit path to the corrupt checkpoint is refused on every rank, naming the file.
  const int port = pick_free_port();
  auto out = test::run_ranks(2, [&](int rank) {
    auto store = Store::connect(test::local_env(rank, 2, port), 60);
    try {
      load_checkpoint_collectively(*store, root_, root_ + "/step-00000002");
    } catch (const Error& e) {
      const std::string m = e.what();
      return expect(m.find(shard) != std::string::npos && m.find("SHA-256") != std::string::npos, m);
    }
    return std::string("accepted");
  });
  EXPECT_TRUE(test::all_ok(out));
  // A missing shard too.
  fs::remove(shard);
  EXPECT_THROW(load_checkpoint(root_ + "/step-00000002", {false, false}), Error);
}

}  // namespace
}  // namespace opd::dist
