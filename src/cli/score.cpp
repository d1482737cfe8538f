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

#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/log.h"
#include "teacher/client.h"
#include "teacher/protocol.h"
#include "teacher/scorer.h"

namespace opd::cli {
namespace {

struct ScoreOptions {
  std::string model, teacher_url, input, output, api = "auto", device = "cpu";
  int64_t top_k = 0;
  double temperature = 1.0;
  int64_t batch = 64;
  int chunks = 8;
  int64_t min_chunk_rows = 2048;
};

ScoreSequence parse_line(const std::string& line, int64_t lineno, const std::string& file) {
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
    co.loss.temperature = o.temperature;
    co.loss.mode = SupportMode::TopKTail;
    co.chunks = o.chunks;
    co.min_chunk_rows = o.min_chunk_rows;
    scorer = std::make_unique<TeacherClient>(co);
  }
  std::ifstream in(o.input);
  OPD_CHECK(in.good(), Io, "opd score: cannot open ", o.input);
  std::FILE* out = stdout;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(nullptr, &std::fclose);
  if (!o.output.empty()) {
    file.reset(std::fopen(o.output.c_str(), "w"));
    OPD_CHECK(file != nullptr, Io, "opd score: cannot write ", o.output);
    out = file.get();
  }
  ScoreRequest q;
  q.k = o.top_k;
  q.temperature = o.temperature;
  int64_t index = 0, lineno = 0, rows = 0;
  auto flush = [&] {
    if (q.sequences.empty()) return;
    ScoreResponse r = scorer->score(q);
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
  };
  std::string line;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    q.sequences.push_back(parse_line(line, lineno, o.input));
    if (static_cast<int64_t>(q.sequences.size()) >= o.batch) flush();
  }
  flush();
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
  cmd->add_option("--input", o->input, "JSONL: {\"ids\": [...], \"completion_start\": n}")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--output", o->output, "JSONL output file (default stdout)");
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
