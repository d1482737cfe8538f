// core/text_io: bounded reads of user text files (regular files only, a size limit) and the
// JSON nesting guard that keeps deeply nested input from reaching recursive code (session 15:
// ~100 KB of '[' crashed `opd serve` and several commands with a stack overflow).
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "core/error.h"
#include "core/text_io.h"

namespace opd {
namespace {

namespace fs = std::filesystem;

std::string error_of(const std::function<void()>& fn, ErrorKind kind) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(JsonDepth, CountsBracketsOutsideStrings) {
  EXPECT_EQ(json_nesting_depth(""), 0);
  EXPECT_EQ(json_nesting_depth("17"), 0);
  EXPECT_EQ(json_nesting_depth("{}"), 1);
  EXPECT_EQ(json_nesting_depth(R"({"a": [1, {"b": [[]]}], "c": {}})"), 5);
  // Brackets inside strings, escaped quotes and backslashes do not count.
  EXPECT_EQ(json_nesting_depth(R"({"a": "[[[{{{", "b": "\"[[[", "c": "\\", "d": [1]})"), 2);
  EXPECT_EQ(json_nesting_depth(R"(["\\\"[[[["])"), 1);
  // Malformed text is measured as far as it goes (unbalanced closers do not go negative).
  EXPECT_EQ(json_nesting_depth("]]]][[["), 3);
  EXPECT_EQ(json_nesting_depth(std::string(100000, '[')), 100000);
}

TEST(JsonDepth, DeepTextIsRefusedNamingTheSource) {
  EXPECT_NO_THROW(check_json_depth(std::string(256, '[') + std::string(256, ']'), "x"));
  const std::string m = error_of(
      [] { check_json_depth(std::string(257, '{'), "request body"); }, ErrorKind::InvalidData);
  EXPECT_NE(m.find("request body: JSON nested 257 levels deep, over the limit of 256"),
            std::string::npos) << m;
  EXPECT_NO_THROW(check_json_depth("[[[]]]", "x", 3));
  EXPECT_THROW(check_json_depth("[[[[]]]]", "x", 3), Error);
}

TEST(TextFile, RegularFilesOnlyAndBounded) {
  const fs::path dir = fs::temp_directory_path() / ("opd_text_io_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string ok = (dir / "config.json").string();
  std::ofstream(ok) << "{\"a\": 1}\n";
  EXPECT_EQ(read_text_file(ok), "{\"a\": 1}\n");
  std::ofstream(dir / "empty.json").flush();
  EXPECT_EQ(read_text_file((dir / "empty.json").string()), "");
  // Over the limit.
  std::string m = error_of([&] { read_text_file(ok, 4); }, ErrorKind::InvalidData);
  EXPECT_NE(m.find(ok + " is 9 bytes, over the limit of 4"), std::string::npos) << m;
  // A directory, a symlink to /dev/zero (read forever before), a FIFO.
  m = error_of([&] { read_text_file(dir.string()); }, ErrorKind::InvalidData);
  EXPECT_NE(m.find("is not a regular file (a directory)"), std::string::npos) << m;
  fs::create_symlink("/dev/zero", dir / "zero.json");
  m = error_of([&] { read_text_file((dir / "zero.json").string()); }, ErrorKind::InvalidData);
  EXPECT_NE(m.find("zero.json is not a regular file (a device, FIFO or socket)"),
            std::string::npos) << m;
  ASSERT_EQ(::mkfifo((dir / "fifo.json").c_str(), 0600), 0);
  m = error_of([&] { read_text_file((dir / "fifo.json").string()); }, ErrorKind::InvalidData);
  EXPECT_NE(m.find("not a regular file"), std::string::npos) << m;
  // Missing: Io with the reason.
  m = error_of([&] { read_text_file((dir / "missing.json").string()); }, ErrorKind::Io);
  EXPECT_NE(m.find("missing.json: No such file or directory"), std::string::npos) << m;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace opd
