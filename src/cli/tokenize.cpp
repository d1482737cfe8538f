// `opd tokenize --tokenizer PATH [--decode] [--add-special-tokens] [--skip-special-tokens]`:
// text lines on stdin -> one JSON array of token ids per line on stdout (or, with --decode,
// JSON arrays -> text lines). A line is everything up to '\n' ('\r' stays part of the text);
// invalid UTF-8 becomes U+FFFD as in Python's errors="replace". `--bench FILE` times encode on
// a file's lines instead (single thread, text already in memory) and prints one JSON object.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "core/error.h"
#include "core/text_io.h"
#include "tokenizer/tokenizer.h"

namespace opd::cli {
namespace {

struct TokenizeOptions {
  std::string tokenizer;
  bool decode = false;
  bool add_special_tokens = false;
  bool skip_special_tokens = false;
  std::string bench_file;
  int bench_repeat = 3;
};

void write_ids(std::string& out, const std::vector<int32_t>& ids) {
  out += '[';
  char buf[16];
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ',';
    const int n = std::snprintf(buf, sizeof buf, "%d", ids[i]);
    out.append(buf, static_cast<size_t>(n));
  }
  out += "]\n";
}

std::vector<int32_t> parse_ids(const std::string& line, size_t line_no) {
  nlohmann::json j;
  check_json_depth(line, cat("stdin line ", line_no));
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {
    OPD_FAIL(InvalidData, "stdin line ", line_no, ": not valid JSON: ", e.what());
  }
  if (!j.is_array())
    OPD_FAIL(InvalidData, "stdin line ", line_no, ": expected a JSON array of token ids");
  std::vector<int32_t> ids;
  ids.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    if (!j[i].is_number_integer())
      OPD_FAIL(InvalidData, "stdin line ", line_no, ": element ", i, " (", j[i].dump(),
               ") is not an integer");
    const int64_t v = j[i].get<int64_t>();
    if (v < 0 || v > INT32_MAX)
      OPD_FAIL(InvalidData, "stdin line ", line_no, ": element ", i, " = ", v,
               " is not a valid token id");
    ids.push_back(static_cast<int32_t>(v));
  }
  return ids;
}

void run_bench(const Tokenizer& tok, const TokenizeOptions& o) {
  std::ifstream in(o.bench_file, std::ios::binary);
  if (!in) OPD_FAIL(Io, "cannot open ", o.bench_file);
  std::vector<std::string> lines;
  size_t bytes = 0;
  for (std::string line; std::getline(in, line);) {
    bytes += line.size();
    lines.push_back(std::move(line));
  }
  double first = 0, best = 1e300;
  size_t tokens = 0;
  for (int r = 0; r < std::max(1, o.bench_repeat); ++r) {
    size_t n = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (const std::string& line : lines) n += tok.encode(line, o.add_special_tokens).size();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r == 0) first = s;
    best = std::min(best, s);
    tokens = n;
  }
  nlohmann::json j;
  j["engine"] = "opd";
  j["lines"] = lines.size();
  j["bytes"] = bytes;
  j["tokens"] = tokens;
  j["first_pass_s"] = first;
  j["best_pass_s"] = best;
  j["mb_per_s"] = static_cast<double>(bytes) / 1e6 / best;
  j["tokens_per_s"] = static_cast<double>(tokens) / best;
  j["first_pass_mb_per_s"] = static_cast<double>(bytes) / 1e6 / first;
  std::printf("%s\n", j.dump().c_str());
}

void run_tokenize(const TokenizeOptions& o) {
  const Tokenizer tok = Tokenizer::load(o.tokenizer);
  if (!o.bench_file.empty()) {
    run_bench(tok, o);
    return;
  }
  std::ios::sync_with_stdio(false);
  std::string line, out;
  size_t line_no = 0;
  while (std::getline(std::cin, line)) {
    ++line_no;
    out.clear();
    if (o.decode) {
      try {
        out = tok.decode(parse_ids(line, line_no), o.skip_special_tokens);
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::InvalidArgument) throw;
        OPD_FAIL(InvalidData, "stdin line ", line_no, ": ", e.what());
      }
      out += '\n';
    } else {
      write_ids(out, tok.encode(line, o.add_special_tokens));
    }
    std::fwrite(out.data(), 1, out.size(), stdout);
  }
  if (std::ferror(stdout)) OPD_FAIL(Io, "writing to stdout failed");
  std::fflush(stdout);
}

}  // namespace

void register_tokenize(CLI::App& app) {
  auto o = std::make_shared<TokenizeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "tokenize", "Text lines on stdin -> JSON arrays of token ids (or back with --decode)");
  cmd->add_option("--tokenizer", o->tokenizer, "tokenizer.json or a model directory")->required();
  cmd->add_flag("--decode", o->decode, "read JSON arrays of ids, write text lines");
  cmd->add_flag("--add-special-tokens", o->add_special_tokens,
                "apply the tokenizer's post-processor (e.g. Llama-3's <|begin_of_text|>)");
  cmd->add_flag("--skip-special-tokens", o->skip_special_tokens,
                "with --decode: leave special tokens out of the text");
  cmd->add_option("--bench", o->bench_file,
                  "time single-thread encode of this file's lines and print JSON");
  cmd->add_option("--bench-repeat", o->bench_repeat, "passes over the file (best is reported)");
  cmd->callback([o] { run_tokenize(*o); });
}

}  // namespace opd::cli
