// Bad command-line input to the model-writing and checking commands (`opd init`, `convert`,
// `shrink`, `doctor`, `score`, `eval`) through the opd binary: each is refused up front with a
// message naming the flag or file, the value and the limit, and leaves no partial output.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "core/error.h"
#include "gguf/gguf_test_util.h"

namespace opd {
namespace {

namespace fs = std::filesystem;
using Result = test::OpdResult;

Result run(const std::string& args) { return test::run_opd(args, test::Stderr::Merge); }

std::string demo(const std::string& rel) { return test::source_dir() + "/demo/" + rel; }

bool has(const Result& r, const std::string& needle) {
  return r.out.find(needle) != std::string::npos;
}

// A fresh per-test directory (removed on destruction) to put inputs and outputs in.
class Scratch {
 public:
  explicit Scratch(const std::string& name)
      : dir_(fs::temp_directory_path() /
             ("opd_cli_inputs_" + std::to_string(::getpid()) + "_" + name)) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& rel) const { return (dir_ / rel).string(); }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.push_back(e.path().filename().string());
    return out;
  }

 private:
  fs::path dir_;
};

void write(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  ASSERT_TRUE(f.good()) << path;
}

std::string init_cmd(const std::string& out) {
  return "init --config " + demo("student.config.json") + " --out " + out;
}

// --- opd init -------------------------------------------------------------------------------

TEST(CliInit, RefusesANonEmptyOutputDirectoryAsConvertDoes) {
  Scratch s("init_nonempty");
  const std::string out = s.path("model");
  fs::create_directories(out);
  write(out + "/old.txt", "someone's file");
  Result r = run(init_cmd(out));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "init: output " + out + " exists and is not an empty directory")) << r.out;
  EXPECT_FALSE(fs::exists(out + "/model.safetensors"));
  EXPECT_TRUE(fs::exists(out + "/old.txt"));
  // An existing empty directory, and "DIR/", are fine.
  const std::string empty = s.path("empty");
  fs::create_directories(empty);
  r = run(init_cmd(empty + "/"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(empty + "/model.safetensors"));
  r = run(init_cmd("''"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "--out is empty")) << r.out;
}

TEST(CliInit, StdMustBeFiniteAndNonNegative) {
  Scratch s("init_std");
  for (const char* bad : {"nan", "inf", "-inf", "-1"}) {
    Result r = run(init_cmd(s.path("m")) + " --std " + bad);
    EXPECT_NE(r.code, 0) << bad << ": " << r.out;
    EXPECT_TRUE(has(r, std::string("opd init: --std ") + bad + " must be finite and >= 0"))
        << bad << ": " << r.out;
    EXPECT_FALSE(fs::exists(s.path("m"))) << bad;
  }
  // 0 = the config's initializer_range (0.02 in the demo config).
  Result r = run(init_cmd(s.path("zero")) + " --std 0");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "std 0.02")) << r.out;
  // A config whose initializer_range is not a positive number is named.
  auto cfg = nlohmann::json::parse(test::read_file(demo("student.config.json")));
  cfg["initializer_range"] = -0.5;
  write(s.path("neg.json"), cfg.dump());
  r = run("init --config " + s.path("neg.json") + " --out " + s.path("neg"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "initializer_range = -0.5 must be a finite number > 0")) << r.out;
}

TEST(CliInit, TokenizerMustBeADirectoryHoldingTokenizerJson) {
  Scratch s("init_tok");
  Result r = run(init_cmd(s.path("a")) + " --tokenizer " + s.path("nonexistent"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "--tokenizer " + s.path("nonexistent") + " is not a directory")) << r.out;
  r = run(init_cmd(s.path("a")) + " --tokenizer " + demo("tokenizer/tokenizer.json"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "is not a directory")) << r.out;
  fs::create_directories(s.path("no_tok"));
  write(s.path("no_tok/tokenizer_config.json"), "{}");
  r = run(init_cmd(s.path("a")) + " --tokenizer " + s.path("no_tok"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "holds no tokenizer.json")) << r.out;
  EXPECT_FALSE(fs::exists(s.path("a")));
  r = run(init_cmd(s.path("a")) + " --tokenizer " + demo("tokenizer"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(s.path("a/tokenizer.json")));
  EXPECT_FALSE(has(r, "token ids (highest id + 1)")) << r.out;  // 257 ids <= 272
}

TEST(CliInit, WarnsWhenTheTokenizerHasMoreIdsThanTheModel) {
  Scratch s("init_vocab");
  auto cfg = nlohmann::json::parse(test::read_file(demo("student.config.json")));
  cfg["vocab_size"] = 250;  // the demo tokenizer has 257 ids
  cfg["bos_token_id"] = cfg["eos_token_id"] = cfg["pad_token_id"] = 0;
  write(s.path("c.json"), cfg.dump());
  Result r = run("init --config " + s.path("c.json") + " --out " + s.path("m") + " --tokenizer " +
                 demo("tokenizer"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "has 257 token ids (highest id + 1) but the model's vocab_size is 250"))
      << r.out;
}

// --- opd convert / opd shrink ---------------------------------------------------------------

// A complete tiny Llama GGUF (3 layers, byte-level vocabulary, f32 tensors) whose rms eps and
// rope theta are the given values.
std::string tiny_gguf(float eps, float theta) {
  constexpr uint64_t H = 32, heads = 4, kv = 2, D = 8, I = 48, layers = 3;
  test::GgufBuilder b;
  b.kv_str("general.architecture", "llama")
      .kv_u32("llama.block_count", layers)
      .kv_u32("llama.context_length", 256)
      .kv_u32("llama.embedding_length", H)
      .kv_u32("llama.feed_forward_length", I)
      .kv_u32("llama.attention.head_count", heads)
      .kv_u32("llama.attention.head_count_kv", kv)
      .kv_f32("llama.rope.freq_base", theta)
      .kv_f32("llama.attention.layer_norm_rms_epsilon", eps);
  const uint64_t V = test::add_byte_level_vocab(b);
  uint64_t seed = 1;
  auto add = [&](const std::string& name, std::vector<uint64_t> ne) {
    int64_t n = 1;
    for (uint64_t d : ne) n *= static_cast<int64_t>(d);
    Tensor w = test::random_uniform({n}, DType::F32, seed++, -0.5, 0.5);
    b.tensor_f32(name, std::move(ne), w.data<float>());
  };
  add("token_embd.weight", {H, V});
  for (uint64_t l = 0; l < layers; ++l) {
    const std::string g = "blk." + std::to_string(l) + ".";
    add(g + "attn_norm.weight", {H});
    add(g + "attn_q.weight", {H, heads * D});
    add(g + "attn_k.weight", {H, kv * D});
    add(g + "attn_v.weight", {H, kv * D});
    add(g + "attn_output.weight", {heads * D, H});
    add(g + "ffn_norm.weight", {H});
    add(g + "ffn_gate.weight", {H, I});
    add(g + "ffn_up.weight", {H, I});
    add(g + "ffn_down.weight", {I, H});
  }
  add("output_norm.weight", {H});
  return b.build();
}

TEST(CliConvert, TrailingSlashOutIsTheDirectoryAndEmptyOutIsRefused) {
  Scratch s("convert_slash");
  write(s.path("ok.gguf"), tiny_gguf(1e-5f, 10000.0f));
  Result r = run("convert --from-gguf " + s.path("ok.gguf") + " --out " + s.path("hf") + "/");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(s.path("hf/config.json")));
  EXPECT_TRUE(fs::exists(s.path("hf/model.safetensors")));
  r = run("shrink --model " + s.path("hf") + " --out " + s.path("small") + "// --keep-layers 0,2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(s.path("small/config.json")));
  for (const auto& e : s.entries())
    EXPECT_EQ(e.find(".tmp."), std::string::npos) << "left behind: " << e;
  r = run("convert --from-gguf " + s.path("ok.gguf") + " --out ''");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "convert: --out is empty")) << r.out;
  r = run("shrink --model " + s.path("hf") + " --out '' --keep-layers 0");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "shrink: --out is empty")) << r.out;
  // The non-empty check is unchanged (and applies to "DIR/" too).
  r = run("convert --from-gguf " + s.path("ok.gguf") + " --out " + s.path("hf") + "/");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "exists and is not an empty directory")) << r.out;
}

TEST(CliConvert, GgufFloatMetadataMustBeFiniteAndPositive) {
  Scratch s("convert_floats");
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    float eps, theta;
    const char* needle;
  };
  const Case cases[] = {
      {-1.0f, 10000.0f, "'llama.attention.layer_norm_rms_epsilon' = -1 must be finite and > 0"},
      {0.0f, 10000.0f, "'llama.attention.layer_norm_rms_epsilon' = 0 must be finite and > 0"},
      {nan, 10000.0f, "'llama.attention.layer_norm_rms_epsilon' = nan must be finite and > 0"},
      {1e-5f, inf, "'llama.rope.freq_base' = inf must be finite and > 0"},
      {1e-5f, -inf, "'llama.rope.freq_base' = -inf must be finite and > 0"},
      {1e-5f, 0.0f, "'llama.rope.freq_base' = 0 must be finite and > 0"},
  };
  for (const Case& c : cases) {
    write(s.path("bad.gguf"), tiny_gguf(c.eps, c.theta));
    Result r = run("convert --from-gguf " + s.path("bad.gguf") + " --out " + s.path("hf"));
    EXPECT_NE(r.code, 0) << c.needle << ": " << r.out;
    EXPECT_TRUE(has(r, c.needle)) << c.needle << ": " << r.out;
    EXPECT_FALSE(fs::exists(s.path("hf"))) << c.needle;
  }
  write(s.path("ok.gguf"), tiny_gguf(1e-5f, 500000.0f));
  Result r = run("convert --from-gguf " + s.path("ok.gguf") + " --out " + s.path("hf"));
  ASSERT_EQ(r.code, 0) << r.out;
  auto cfg = nlohmann::json::parse(test::read_file(s.path("hf/config.json")));
  EXPECT_EQ(cfg["rms_norm_eps"].get<double>(), 1e-5);
  EXPECT_EQ(cfg["rope_theta"].get<double>(), 500000.0);
}

// --- opd doctor -----------------------------------------------------------------------------

TEST(CliDoctor, InvalidSettingsAreErrorsNamingTheFlag) {
  const std::string base = "doctor --student " + demo("teacher") + " --teacher " + demo("teacher");
  Result r = run(base);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::pair<const char*, const char*> bad[] = {
      {"--vocab-policy bogus", "--vocab-policy"},
      {"--loss-support bogus", "--loss-support"},
      {"--device tpu", "--device tpu must be cpu or cuda"},
      {"--dtype f16", "--dtype f16 must be bf16 or f32"},
      {"--recompute-granularity bogus", "--recompute-granularity"},
      {"--nproc 0", "--nproc 0 must be in [1, 65536]"},
      {"--nproc -3", "--nproc -3 must be in [1, 65536]"},
      {"--zero-stage 3", "--zero-stage 3 must be 1 or 2"},
      {"--micro-batch-tokens -5", "--micro-batch-tokens -5 must be in [1, 2^31]"},
      {"--kv-cache-gb nan", "--kv-cache-gb nan must be > 0 and <= 1e6"},
      {"--kv-cache-gb 1e12", "--kv-cache-gb 1e+12 must be > 0 and <= 1e6"},
      {"--kv-cache-gb -1", "--kv-cache-gb -1 must be > 0 and <= 1e6"},
      {"--device-memory-budget nan", "--device-memory-budget nan"},
      {"--device-memory-budget 4", "needs --device cuda"},  // as opd train
  };
  for (const auto& [flags, needle] : bad) {
    r = run(base + " " + flags);
    EXPECT_EQ(r.code, 1) << flags << ": " << r.out;
    EXPECT_TRUE(has(r, needle)) << flags << ": " << r.out;
    EXPECT_FALSE(has(r, "0 error(s)")) << flags << ": " << r.out;
  }
}

// --- opd score ------------------------------------------------------------------------------

TEST(CliScore, ErrorsNameTheInputLineAndLeaveNoPartialOutput) {
  Scratch s("score");
  std::string lines;
  for (int i = 1; i <= 79; ++i)  // line 70 of 79: sequence 5 of the second request of 64
    lines += "{\"ids\": [1, 2, " + std::to_string(i == 70 ? 999 : 3) + "], \"completion_start\": 1}\n";
  write(s.path("in.jsonl"), lines);
  const std::string base = "score --model " + demo("teacher") + " --top-k 2 --input ";
  Result r = run(base + s.path("in.jsonl") + " --output " + s.path("out.jsonl"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, s.path("in.jsonl") + ":70: ids[2] = 999 is outside the teacher's vocabulary "
                     "[0, 272)")) << r.out;
  EXPECT_EQ(s.entries(), std::vector<std::string>{"in.jsonl"}) << "no partial or temporary output";

  // A good run writes every line; a later failing run leaves that file as it was.
  write(s.path("ok.jsonl"), "{\"ids\": [1, 2, 3]}\n{\"ids\": [4, 5, 6, 7], \"completion_start\": 2}\n");
  r = run(base + s.path("ok.jsonl") + " --output " + s.path("out.jsonl"));
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string good = test::read_file(s.path("out.jsonl"));
  EXPECT_EQ(std::count(good.begin(), good.end(), '\n'), 2) << good;
  EXPECT_NE(good.find("\"completion_start\":1"), std::string::npos) << "the default is 1: " << good;
  r = run(base + s.path("in.jsonl") + " --output " + s.path("out.jsonl"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_EQ(test::read_file(s.path("out.jsonl")), good);
  // A request-wide error names the lines of the request.
  r = run("score --model " + demo("teacher") + " --top-k 500 --input " + s.path("ok.jsonl"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, s.path("ok.jsonl") + ":1..2: score request: k = 500")) << r.out;
  for (const auto& e : s.entries())
    EXPECT_EQ(e.find(".tmp."), std::string::npos) << "left behind: " << e;
  // The completion_start default is documented.
  r = run("score --help");
  EXPECT_TRUE(has(r, "without completion_start, n = 1")) << r.out;
}

// --- opd eval -------------------------------------------------------------------------------

TEST(CliEval, KvCacheGbAndLimitAreValidatedNamingTheFlag) {
  const std::string base =
      "eval --model " + demo("teacher") + " --data " + demo("data/eval.jsonl");
  for (const char* v : {"nan", "inf", "1e12", "-1", "0"}) {
    Result r = run(base + " --kv-cache-gb " + v);
    EXPECT_NE(r.code, 0) << v << ": " << r.out;
    EXPECT_TRUE(has(r, "opd eval: --kv-cache-gb ") && has(r, "must be > 0 and <= 1e6"))
        << v << ": " << r.out;
    EXPECT_FALSE(has(r, "9223372036854775808")) << r.out;
  }
  Result r = run(base + " --limit -1");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "opd eval: --limit -1 must be >= 0 (0 = all samples)")) << r.out;
  r = run(base + " --limit 3 --kv-cache-gb 0.01");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "exact match 3/3")) << r.out;
}

TEST(CliEval, ChatDataWithoutATemplateNamesWhereEvalReadsIt) {
  Scratch s("eval_chat");
  write(s.path("chat.jsonl"),
        "{\"messages\": [{\"role\": \"user\", \"content\": \"1+1=\"}, "
        "{\"role\": \"assistant\", \"content\": \"2\"}]}\n");
  Result r = run("eval --model " + demo("teacher") + " --data " + s.path("chat.jsonl"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "needs a chat template")) << r.out;
  EXPECT_FALSE(has(r, "--chat-template")) << "opd eval has no such flag: " << r.out;
  EXPECT_TRUE(has(r, "none was found in " + demo("teacher") +
                        " (a \"chat_template\" in its tokenizer_config.json, or chat_template.jinja)"))
      << r.out;
}

}  // namespace
}  // namespace opd
