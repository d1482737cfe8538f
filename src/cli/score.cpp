// `opd score --model DIR | --teacher-url URL --input FILE.jsonl --top-k K [--temperature T]`:
// teacher top-K scores of token sequences. Input: one JSON object per line,
//   {"ids": [token ids of prompt + completion], "completion_start": n}   (n >= 1; default 1)
// Output (stdout or --output): one object per input line, in order,
//   {"index": i, "completion_start": n, "ids": [[K ids] per position n..len-1],
//    "logprobs": [[K logprobs] ...], "actual_logprobs": [...]}
// logprobs are log p_T(v | ids[0..p-1]) over the full vocabulary at temperature T. With
// --teacher-url the responses go through the client's validation (teacher/client.h).
// --device cuda scores in process on the GPU (CudaScorer, bf16; teacher/cuda_scorer.h).
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <vector>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/log.h"
#include "model/config.h"
#include "teacher/client.h"
#include "teacher/protocol.h"
#include "teacher/scorer.h"
#include "tokenizer/fingerprint.h"

namespace opd::cli {
namespace {

struct ScoreOptions {
  std::string model, teacher_url, teacher_config, input, output, api = "auto", device = "cpu";
  int64_t top_k = 0;
  double temperature = 1.0;
  int64_t batch = 64;
  int chunks = 8;
  int64_t min_chunk_rows = 2048;
};

// `vocab` (the teacher's, 0 = unknown) bounds the ids here, so a bad id is named by its line
// rather than by its index in a batched request.
ScoreSequence parse_line(const std::string& line, int64_t lineno, const std::string& file,
                         int64_t vocab) {
  const std::string where = cat(file, ":", lineno);
  nlohmann::json j = parse_json(line, where.c_str());
  OPD_CHECK(j.is_object() && j.contains("ids") && j["ids"].is_array(), InvalidData, where,
            ": expected {\"ids\": [...], \"completion_start\": n}");
  ScoreSequence s;
  for (size_t p = 0; p < j["ids"].size(); ++p) {
    const auto& v = j["ids"][p];
    OPD_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= INT32_MAX,
              InvalidData, where, ": ids[", p, "] = ", v.dump().substr(0, 40),
              " is not a token id");
    OPD_CHECK(vocab <= 0 || v.get<int64_t>() < vocab, InvalidData, where, ": ids[", p, "] = ",
              v.get<int64_t>(), " is outside the teacher's vocabulary [0, ", vocab, ")");
    s.ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
  }
  s.begin = 1;
  if (j.contains("completion_start")) {
    OPD_CHECK(j["completion_start"].is_number_integer(), InvalidData, where,
              ": completion_start must be an integer");
    s.begin = j["completion_start"].get<int64_t>();
  }
  s.end = static_cast<int64_t>(s.ids.size());
  OPD_CHECK(s.begin >= 1 && s.begin <= s.end, InvalidData, where, ": completion_start ", s.begin,
            " must be in [1, ", s.end, "] (the sequence has ", s.end, " tokens)");
  return s;
}

// A scorer error names a sequence by its index in the batched request ("sequence 5", or
// "chunk 2 of 4 (sequences 16..31): ... sequence 3" from a chunking client); prefix the input
// line it came from, or the batch's line range when no sequence is named.
std::string with_input_line(const std::string& msg, const std::string& file,
                            const std::vector<int64_t>& lines) {
  static const std::regex chunk_re("\\(sequences ([0-9]+)\\.\\.[0-9]+\\)");
  static const std::regex seq_re("sequence ([0-9]+)");
  std::smatch m;
  size_t first = 0;
  std::string rest = msg;
  if (std::regex_search(msg, m, chunk_re)) {
    first = std::stoull(m[1].str());
    rest = m.suffix().str();
  }
  if (std::regex_search(rest, m, seq_re) && m[1].str().size() < 10) {
    const size_t s = first + std::stoull(m[1].str());
    if (s < lines.size())
      return cat(file, ":", lines[s], ": ", msg, " (sequence ", s, " of the request holding lines ",
                 lines.front(), "..", lines.back(), ")");
  }
  return cat(file, ":", lines.front(), "..", lines.back(), ": ", msg);
}

void run_score(const ScoreOptions& o) {
  OPD_CHECK(o.model.empty() != o.teacher_url.empty(), InvalidArgument,
            "opd score: give exactly one of --model DIR and --teacher-url URL");
  std::unique_ptr<Scorer> scorer;
  if (!o.model.empty()) {
    scorer = make_local_scorer(o.model, o.device == "cuda" ? Device::CUDA : Device::CPU);
  } else {
    OPD_CHECK(o.device == "cpu", InvalidArgument,
              "opd score: --device applies to --model (a --teacher-url server picks its own)");
    ClientOptions co;
    co.url = o.teacher_url;
    co.api = parse_teacher_api(o.api);
    if (!o.teacher_config.empty()) {  // what a vLLM server does not report
      const int64_t v = load_model_config(o.teacher_config).vocab_size;
      co.assume_teacher_vocab = v;
      co.assume_teacher_fingerprint = tokenizer_fingerprint(o.teacher_config, v).sha256;
    }
    co.loss.temperature = o.temperature;
    co.loss.mode = SupportMode::TopKTail;
    co.chunks = o.chunks;
    co.min_chunk_rows = o.min_chunk_rows;
    scorer = std::make_unique<TeacherClient>(co);
  }
  const int64_t vocab = scorer->info().vocab_size;
  const int64_t max_len = scorer->info().max_model_len;
  int64_t past_context = 0;
  std::ifstream in(o.input);
  OPD_CHECK(in.good(), Io, "opd score: cannot open ", o.input);
  // --output is written to a temporary sibling and renamed at the end, so a failed run leaves
  // no partial file (and an existing file stays as it was).
  std::FILE* out = stdout;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(nullptr, &std::fclose);
  const std::string tmp = o.output + ".tmp." + std::to_string(::getpid());
  struct RemoveUnlessDone {
    const std::string& path;
    bool active = false;
    ~RemoveUnlessDone() {
      if (active) std::remove(path.c_str());
    }
  } cleanup{tmp};
  if (!o.output.empty()) {
    std::error_code ec;
    OPD_CHECK(!std::filesystem::is_directory(o.output, ec), InvalidArgument, "opd score: --output ",
              o.output, " is a directory; give a file name");
    file.reset(std::fopen(tmp.c_str(), "w"));
    OPD_CHECK(file != nullptr, Io, "opd score: cannot write ", tmp, " (for --output ", o.output,
              "): ", std::strerror(errno));
    cleanup.active = true;
    out = file.get();
  }
  ScoreRequest q;
  q.k = o.top_k;
  q.temperature = o.temperature;
  int64_t index = 0, lineno = 0, rows = 0;
  std::vector<int64_t> batch_lines;  // the input line of each sequence of q
  const auto t_start = std::chrono::steady_clock::now();
  double last_progress = 0;
  auto seconds_since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  auto flush = [&] {
    if (q.sequences.empty()) return;
    ScoreResponse r;
    try {
      r = scorer->score(q);
    } catch (const Error& e) {
      throw Error(e.kind(), with_input_line(e.what(), o.input, batch_lines));
    }
    for (size_t s = 0; s < q.sequences.size(); ++s) {
      nlohmann::json j;
      j["index"] = index++;
      j["completion_start"] = q.sequences[s].begin;
      nlohmann::json ids = nlohmann::json::array(), lps = nlohmann::json::array(),
                     act = nlohmann::json::array();
      for (int64_t row = r.row_offsets[s]; row < r.row_offsets[s + 1]; ++row) {
        ids.push_back(std::vector<int32_t>(r.ids.begin() + row * r.k, r.ids.begin() + (row + 1) * r.k));
        lps.push_back(std::vector<float>(r.logprobs.begin() + row * r.k,
                                         r.logprobs.begin() + (row + 1) * r.k));
        act.push_back(r.actual_logprobs[row]);
      }
      j["ids"] = std::move(ids);
      j["logprobs"] = std::move(lps);
      j["actual_logprobs"] = std::move(act);
      std::fprintf(out, "%s\n", j.dump().c_str());
    }
    rows += r.num_rows();
    q.sequences.clear();
    batch_lines.clear();
    // Progress of a long input (its length is not known ahead: the file is streamed): a line
    // every 10 s.
    const double elapsed = seconds_since(t_start);
    if (elapsed - last_progress >= 10) {
      last_progress = elapsed;
      log_info("opd score: ", index, " sequences (", o.input, " line ", lineno, "), ", rows,
               " positions scored in ", static_cast<int64_t>(elapsed), " s (",
               static_cast<int64_t>(rows / elapsed), " positions/s)");
    }
  };
  std::string line;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    q.sequences.push_back(parse_line(line, lineno, o.input, vocab));
    batch_lines.push_back(lineno);
    const int64_t len = static_cast<int64_t>(q.sequences.back().ids.size());
    if (max_len > 0 && len > max_len && past_context++ == 0)
      log_warn(o.input, ":", lineno, ": ", len, " tokens, past the teacher's context length ",
               max_len, " (max_position_embeddings): positions beyond it were not trained and "
               "score unreliably (a vLLM teacher refuses them); later lines past it are counted");
    if (static_cast<int64_t>(q.sequences.size()) >= o.batch) flush();
  }
  flush();
  if (past_context > 1)
    log_warn(o.input, ": ", past_context, " sequences are longer than the teacher's context length ",
             max_len);
  if (file) {
    const bool ok = std::fflush(file.get()) == 0 && ::fsync(::fileno(file.get())) == 0 &&
                    std::fclose(file.release()) == 0;
    OPD_CHECK(ok, Io, "opd score: cannot write ", tmp, ": ", std::strerror(errno));
    OPD_CHECK(std::rename(tmp.c_str(), o.output.c_str()) == 0, Io, "opd score: cannot rename ",
              tmp, " to ", o.output, ": ", std::strerror(errno));
    cleanup.active = false;
  }
  log_info("opd score: ", index, " sequences, ", rows, " positions scored (K = ", o.top_k,
           ", T = ", o.temperature, ")");
}

}  // namespace

void register_score(CLI::App& app) {
  auto o = std::make_shared<ScoreOptions>();
  CLI::App* cmd = app.add_subcommand(
      "score", "Teacher top-K log-probabilities of token sequences (JSONL in, JSONL out)");
  cmd->add_option("--model", o->model, "teacher model directory (in-process scorer)")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--device", o->device,
                  "where --model scores: cpu (f32 reference) | cuda (bf16 on the GPU)")
      ->default_val("cpu")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--teacher-url", o->teacher_url, "a teacher server: http://host:port");
  cmd->add_option("--teacher-api", o->api, "auto | opd | vllm")->default_val("auto");
  cmd->add_option("--teacher-config", o->teacher_config, "a vLLM --teacher-url: directory with "
                  "the served model's config.json and tokenizer files, for the vocabulary and "
                  "tokenizer fingerprint vLLM does not report");
  cmd->add_option("--input", o->input, "JSONL: {\"ids\": [...], \"completion_start\": n}: "
                  "positions n..len-1 are scored (n >= 1; without completion_start, n = 1)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--output", o->output, "JSONL output file (default stdout; written whole "
                  "or not at all: through a temporary file renamed at the end)");
  cmd->add_option("--top-k", o->top_k, "entries per position")->required()->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  cmd->add_option("--temperature", o->temperature, "softmax temperature")->default_val(1.0);
  cmd->add_option("--batch", o->batch, "sequences per request")
      ->default_val(64)
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--chunks", o->chunks,
                  "--teacher-url: split each request into up to this many concurrent chunks of "
                  "whole sequences (1 = never; docs/teacher.md)")
      ->default_val(8)
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--min-chunk-rows", o->min_chunk_rows,
                  "--teacher-url: scored positions per chunk at least (smaller requests go whole)")
      ->default_val(2048)
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd->callback([o] { run_score(*o); });
}

}  // namespace opd::cli
