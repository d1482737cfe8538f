// A gtest fixture base that owns a fresh scratch directory per process and per test (the plain
// and _asan variants of a suite run concurrently, so the pid is part of the name): created
// empty before each test, removed after it. The training tests write their models, data and
// run outputs below it.
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>
#include <utility>

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

}  // namespace opd::test
