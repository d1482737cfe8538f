// A gtest fixture base that owns a fresh scratch directory per process and per test (the plain
// and _asan variants of a suite run concurrently, so the pid is part of the name): created
// empty before each test, removed after it. The training tests write their models, data and
// run outputs below it; TinyDistillationTest fills it with write_tiny_distillation's playground
// and builds `opd train` command lines over it.
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "common/test_util.h"  // write_tiny_distillation

namespace opd::test {

class RunDirTest : public ::testing::Test {
 protected:
  // The directory is $TMPDIR/<prefix><pid>_<test name>.
  explicit RunDirTest(std::string prefix) : prefix_(std::move(prefix)) {}

  void SetUp() override {
    root_ = std::filesystem::temp_directory_path() /
            (prefix_ + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  // `rel` below the test's directory.
  std::string path(const std::string& rel) const { return (root_ / rel).string(); }

  std::filesystem::path root_;

 private:
  std::string prefix_;
};

// RunDirTest holding write_tiny_distillation's student/, teacher/ and train.jsonl (`lines`
// additions).
class TinyDistillationTest : public RunDirTest {
 protected:
  TinyDistillationTest(std::string prefix, int lines)
      : RunDirTest(std::move(prefix)), lines_(lines) {}

  void SetUp() override {
    RunDirTest::SetUp();
    write_tiny_distillation(root_.string(), lines_);
  }

  // `opd train` on the playground for `steps` steps of `batch_size` sequences into OUT: micro-
  // batches of 2, completions of at most 5 tokens, teacher top-8, LR 0.01, checkpoints by step
  // only, no TensorBoard. Callers append what their test varies.
  std::vector<std::string> tiny_train_args(const std::string& out, int steps,
                                           int batch_size) const {
    return {"train", "--student", path("student"), "--teacher", path("teacher"), "--data",
            path("train.jsonl"), "--out", path(out), "--max-steps", std::to_string(steps),
            "--batch-size", std::to_string(batch_size), "--micro-batch-size", "2",
            "--max-completion-length", "5", "--teacher-top-k", "8", "--learning-rate", "0.01",
            "--save-minutes", "0", "--no-tensorboard"};
  }

 private:
  int lines_;
};

}  // namespace opd::test
