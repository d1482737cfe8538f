// Test helpers for comparing opd's tokenizer with Hugging Face `tokenizers`: run
// tools/tokenizer_oracle.py, read its JSON-lines output, locate tokenizer fixtures. When the
// oracle cannot run (no python3, no `tokenizers`, no pip-installed tokenizer package) the test
// is skipped with a loud message, except under CI (env CI set), where it fails: CI installs
// the oracle (scripts/deps.sh --oracles), so a missing oracle there is a broken setup.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include "common/test_util.h"

namespace opd::test {

struct OracleRun {
  bool ok = false;
  std::string why;     // when !ok: what is missing
  std::string stdout_text;
};

inline std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "opd_tok_" + std::to_string(::getpid()) + "_" + name;
}

inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs `python3 tools/tokenizer_oracle.py ARGS`; exit code 3 or a missing python3 -> !ok.
inline OracleRun run_oracle(const std::string& args) {
  OracleRun r;
  const std::string out = temp_path("oracle_stdout"), err = temp_path("oracle_stderr");
  const std::string cmd = "python3 " + shell_quote(source_dir() + "/tools/tokenizer_oracle.py") +
                          " " + args + " >" + shell_quote(out) + " 2>" + shell_quote(err);
  const int status = std::system(cmd.c_str());
  std::ifstream o(out), e(err);
  std::string err_text((std::istreambuf_iterator<char>(e)), std::istreambuf_iterator<char>());
  r.stdout_text.assign((std::istreambuf_iterator<char>(o)), std::istreambuf_iterator<char>());
  std::remove(out.c_str());
  std::remove(err.c_str());
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (code == 0) {
    r.ok = true;
  } else if (code == 3 || code == 127) {
    r.why = code == 127 ? "python3 not found" : err_text;
  } else {
    ADD_FAILURE() << "oracle failed (exit " << code << "): " << cmd << "\n" << err_text;
    r.why = "oracle error";
  }
  return r;
}

inline bool in_ci() { return std::getenv("CI") != nullptr; }

// Use in a test body: skip (or fail under CI) when the oracle is unavailable.
#define OPD_REQUIRE_ORACLE(run)                                                              \
  do {                                                                                       \
    if (!(run).ok) {                                                                         \
      if (::opd::test::in_ci()) FAIL() << "HF oracle unavailable under CI: " << (run).why;   \
      GTEST_SKIP() << "\n*** HF ORACLE UNAVAILABLE: " << (run).why                            \
                   << "*** install it with scripts/deps.sh --oracles; exactness NOT checked";\
    }                                                                                        \
  } while (0)

inline std::vector<nlohmann::json> read_json_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

inline std::string qwen3_tokenizer() { return fixture_path("tokenizers/qwen3/tokenizer.json"); }
inline std::string corpus_path() { return fixture_path("tokenizers/corpus.txt"); }

// Corpus lines as raw bytes (split on '\n', no final empty line), exactly as the oracle splits.
inline std::vector<std::string> corpus_lines(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t nl; (nl = data.find('\n', start)) != std::string::npos; start = nl + 1)
    lines.push_back(data.substr(start, nl - start));
  if (start < data.size()) lines.push_back(data.substr(start));
  return lines;
}

}  // namespace opd::test
