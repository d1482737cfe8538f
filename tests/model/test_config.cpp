// config.json parsing: real Hub configs of each family, transformers-generated fixtures
// (tools/make_config_fixtures.py: resolved fields, model.num_parameters() and the rotary
// embedding's frequencies and YaRN attention factor), every error
// path naming its field, and model_config_to_json round trips through opd and transformers.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/test_util.h"
#include "model/config.h"
#include "model/rope.h"  // rope_inv_freq against transformers' rotary embedding
#include "common/python_oracle.h"

namespace opd {
namespace {

using nlohmann::json;

// Content of Qwen/Qwen3-0.6B config.json.
const char* kQwen3_0_6B = R"({
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "initializer_range": 0.02,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// Content of Qwen/Qwen2.5-0.5B config.json.
const char* kQwen2_5_0_5B = R"({
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151643,
  "hidden_act": "silu",
  "hidden_size": 896,
  "initializer_range": 0.02,
  "intermediate_size": 4864,
  "max_position_embeddings": 32768,
  "max_window_layers": 24,
  "model_type": "qwen2",
  "num_attention_heads": 14,
  "num_hidden_layers": 24,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 32768,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.1",
  "use_cache": true,
  "use_mrope": false,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// Content of meta-llama/Llama-3.2-1B config.json (the base model: one eos id).
const char* kLlama3_2_1B = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// Parameter counts published with the models (and equal to transformers' num_parameters()).
TEST(Config, Qwen3_0_6B) {
  ModelConfig c = parse_model_config(kQwen3_0_6B, "config.json");
  EXPECT_EQ(c.arch, Architecture::Qwen3);
  EXPECT_STREQ(architecture_name(c.arch), "Qwen3ForCausalLM");
  EXPECT_EQ(c.model_type, "qwen3");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 1024);
  EXPECT_EQ(c.intermediate_size, 3072);
  EXPECT_EQ(c.num_hidden_layers, 28);
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 128);  // not hidden_size / heads (64): Qwen3 states it
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_FALSE(c.rope_scaling.type == RopeType::Llama3);
  EXPECT_EQ(c.max_position_embeddings, 40960);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.o_proj_bias());
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{151645});
  EXPECT_EQ(c.bos_token_id, 151643);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_EQ(c.num_parameters(), 596049920);
  EXPECT_EQ(c.num_embedding_parameters(), 151936 * 1024);
}

TEST(Config, Qwen2_5_0_5B) {
  ModelConfig c = parse_model_config(kQwen2_5_0_5B, "config.json");
  EXPECT_EQ(c.arch, Architecture::Qwen2);
  EXPECT_EQ(c.model_type, "qwen2");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 896);
  EXPECT_EQ(c.intermediate_size, 4864);
  EXPECT_EQ(c.num_hidden_layers, 24);
  EXPECT_EQ(c.num_attention_heads, 14);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 64);  // 896 / 14
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_FALSE(c.rope_scaling.type == RopeType::Llama3);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_TRUE(c.attention_bias);  // Qwen2 always has q/k/v biases
  EXPECT_FALSE(c.o_proj_bias());
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{151643});
  EXPECT_EQ(c.bos_token_id, 151643);
  EXPECT_EQ(c.num_parameters(), 494032768);
  EXPECT_EQ(c.num_embedding_parameters(), 151936 * 896);
}

TEST(Config, Llama3_2_1B) {
  ModelConfig c = parse_model_config(kLlama3_2_1B, "config.json");
  EXPECT_EQ(c.arch, Architecture::Llama);
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.intermediate_size, 8192);
  EXPECT_EQ(c.num_hidden_layers, 16);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_TRUE(c.rope_scaling.type == RopeType::Llama3);
  EXPECT_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{128001});
  EXPECT_EQ(c.bos_token_id, 128000);
  EXPECT_EQ(c.num_parameters(), 1235814400);
  EXPECT_EQ(c.num_embedding_parameters(), 128256 * 2048);
}

// --- fixtures resolved by transformers -------------------------------------------------------

std::vector<std::string> fixture_dirs() {
  std::vector<std::string> dirs;
  for (const auto& entry : std::filesystem::directory_iterator(test::fixture_path("configs"))) {
    if (entry.is_directory()) dirs.push_back(entry.path().string());
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

json load_json(const std::string& path) { return json::parse(test::read_file_bytes(path)); }

// Every field of `c` against what transformers resolved from the same file.
void expect_matches_transformers(const ModelConfig& c, const json& e, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(architecture_name(c.arch), e["architecture"].get<std::string>());
  EXPECT_EQ(c.model_type, e["model_type"].get<std::string>());
  EXPECT_EQ(c.vocab_size, e["vocab_size"].get<int64_t>());
  EXPECT_EQ(c.hidden_size, e["hidden_size"].get<int64_t>());
  EXPECT_EQ(c.intermediate_size, e["intermediate_size"].get<int64_t>());
  EXPECT_EQ(c.num_hidden_layers, e["num_hidden_layers"].get<int64_t>());
  EXPECT_EQ(c.num_attention_heads, e["num_attention_heads"].get<int64_t>());
  EXPECT_EQ(c.num_key_value_heads, e["num_key_value_heads"].get<int64_t>());
  EXPECT_EQ(c.head_dim, e["head_dim"].get<int64_t>());
  EXPECT_EQ(c.rms_norm_eps, e["rms_norm_eps"].get<double>());
  EXPECT_EQ(c.rope_theta, e["rope_theta"].get<double>());
  EXPECT_EQ(rope_type_name(c.rope_scaling.type), e["rope_type"].get<std::string>());
  if (c.rope_scaling.type == RopeType::Llama3) {
    EXPECT_EQ(c.rope_scaling.factor, e["factor"].get<double>());
    EXPECT_EQ(c.rope_scaling.low_freq_factor, e["low_freq_factor"].get<double>());
    EXPECT_EQ(c.rope_scaling.high_freq_factor, e["high_freq_factor"].get<double>());
  }
  if (c.rope_scaling.type != RopeType::Default) EXPECT_EQ(c.rope_scaling.factor, e["factor"].get<double>());
  if (c.rope_scaling.type == RopeType::Llama3 || c.rope_scaling.type == RopeType::Yarn) {
    EXPECT_EQ(c.rope_scaling.original_max_position_embeddings,
              e["original_max_position_embeddings"].get<int64_t>());
  }
  // The rotary embedding transformers builds from the file: frequencies and YaRN's cos/sin
  // factor, which opd applies squared in the attention scale.
  const auto ref_inv = e["rope_inv_freq"].get<std::vector<double>>();
  Tensor inv = rope_inv_freq(c);
  ASSERT_EQ(inv.numel(), static_cast<int64_t>(ref_inv.size()));
  for (size_t i = 0; i < ref_inv.size(); ++i) {
    EXPECT_NEAR(inv.data<float>()[i], ref_inv[i], 1e-6 * std::fabs(ref_inv[i])) << "inv_freq[" << i << "]";
  }
  const double m = e["rope_attention_scaling"].get<double>();
  EXPECT_NEAR(c.attention_scale(), m * m / std::sqrt(static_cast<double>(c.head_dim)), 1e-12);
  EXPECT_EQ(c.max_position_embeddings, e["max_position_embeddings"].get<int64_t>());
  EXPECT_EQ(c.tie_word_embeddings, e["tie_word_embeddings"].get<bool>());
  EXPECT_EQ(c.attention_bias, e["attention_bias"].get<bool>());
  EXPECT_EQ(c.o_proj_bias(), e["o_proj_bias"].get<bool>());
  EXPECT_EQ(c.qk_norm, e["qk_norm"].get<bool>());
  EXPECT_EQ(c.hidden_act, e["hidden_act"].get<std::string>());
  EXPECT_EQ(c.torch_dtype, e["dtype"].get<std::string>());
  EXPECT_EQ(c.eos_token_ids, e["eos_token_ids"].get<std::vector<int64_t>>());
  EXPECT_EQ(c.bos_token_id, e["bos_token_id"].get<int64_t>());
  EXPECT_EQ(c.num_parameters(), e["num_parameters"].get<int64_t>());
  EXPECT_EQ(c.num_embedding_parameters(), e["num_embedding_parameters"].get<int64_t>());
}

TEST(Config, FixturesMatchTransformers) {
  auto dirs = fixture_dirs();
  ASSERT_GE(dirs.size(), 10u) << "run tools/make_config_fixtures.py";
  for (const auto& dir : dirs) {
    ModelConfig c = load_model_config(dir);
    expect_matches_transformers(c, load_json(dir + "/expected.json"), dir);
  }
}

TEST(Config, RoundTripThroughJson) {
  for (const auto& dir : fixture_dirs()) {
    SCOPED_TRACE(dir);
    ModelConfig a = load_model_config(dir);
    std::string text = model_config_to_json(a);
    ModelConfig b = parse_model_config(text, dir + " (re-serialized)");
    // The re-parsed config must resolve to the same values transformers found in the original.
    expect_matches_transformers(b, load_json(dir + "/expected.json"), dir + " round trip");
    EXPECT_EQ(model_config_to_json(b), text);
  }
}

// model_config_to_json output loaded by transformers (AutoConfig + the model class on the
// meta device) resolves to the same fields and parameter count as the original file did.
TEST(Config, TransformersLoadsSerializedConfig) {
  std::string why;
  if (!test::python_can_import("transformers, torch", &why)) GTEST_SKIP() << why;
  test::ScratchDir scratch;
  std::vector<std::string> dirs = fixture_dirs();
  std::string args;
  for (size_t i = 0; i < dirs.size(); ++i) {
    std::string d = scratch.file(std::to_string(i));
    std::filesystem::create_directory(d);
    test::write_file_bytes(d + "/config.json", model_config_to_json(load_model_config(dirs[i])));
    args += " " + d;
  }
  // Prints, per directory, the fields the fixture tool records (same logic, fewer fields).
  const char* code = R"PY(
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
out = []
for d in sys.argv[1:]:
    cfg = AutoConfig.from_pretrained(d)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    a = m.model.layers[0].self_attn
    r = dict(cfg.rope_parameters)
    out.append({"architecture": type(m).__name__, "head_dim": a.head_dim,
                "num_key_value_heads": cfg.num_key_value_heads, "rope_theta": float(r["rope_theta"]),
                "rope_type": r["rope_type"], "factor": float(r.get("factor", 0)),
                "tie": bool(cfg.tie_word_embeddings), "attention_bias": a.q_proj.bias is not None,
                "o_proj_bias": a.o_proj.bias is not None, "rms_norm_eps": cfg.rms_norm_eps,
                "dtype": str(cfg.dtype).removeprefix("torch.") if cfg.dtype is not None else "",
                "num_parameters": m.num_parameters()})
    with torch.device("cpu"):
        rotary = type(m.model.rotary_emb)(config=cfg)
    out[-1]["inv_freq"] = [float(x) for x in rotary.inv_freq.float()]
    out[-1]["attention_scaling"] = float(rotary.attention_scaling)
print(json.dumps(out))
)PY";
  std::string out;
  int rc = test::run_python(code, args, &out);
  ASSERT_EQ(rc, 0) << out;
  json got = json::parse(out.substr(0, out.find("\n--- python3 stderr")));
  ASSERT_EQ(got.size(), dirs.size());
  for (size_t i = 0; i < dirs.size(); ++i) {
    SCOPED_TRACE(dirs[i]);
    json e = load_json(dirs[i] + "/expected.json");
    const json& g = got[i];
    EXPECT_EQ(g["architecture"], e["architecture"]);
    EXPECT_EQ(g["head_dim"], e["head_dim"]);
    EXPECT_EQ(g["num_key_value_heads"], e["num_key_value_heads"]);
    EXPECT_EQ(g["rope_theta"], e["rope_theta"]);
    EXPECT_EQ(g["rope_type"], e["rope_type"]);
    if (e["rope_type"] != "default") EXPECT_EQ(g["factor"], e["factor"]);
    // The rotary embedding transformers builds from opd's file equals the original's.
    const auto gi = g["inv_freq"].get<std::vector<double>>();
    const auto ei = e["rope_inv_freq"].get<std::vector<double>>();
    ASSERT_EQ(gi.size(), ei.size());
    for (size_t k = 0; k < gi.size(); ++k) EXPECT_NEAR(gi[k], ei[k], 1e-6 * std::fabs(ei[k])) << k;
    EXPECT_NEAR(g["attention_scaling"].get<double>(), e["rope_attention_scaling"].get<double>(), 1e-12);
    EXPECT_EQ(g["tie"], e["tie_word_embeddings"]);
    EXPECT_EQ(g["attention_bias"], e["attention_bias"]);
    EXPECT_EQ(g["o_proj_bias"], e["o_proj_bias"]);
    EXPECT_EQ(g["rms_norm_eps"], e["rms_norm_eps"]);
    EXPECT_EQ(g["dtype"], e["dtype"]);
    EXPECT_EQ(g["num_parameters"], e["num_parameters"]);
  }
}

// --- defaults and spellings ------------------------------------------------------------------

json base_json() { return json::parse(kQwen2_5_0_5B); }
ModelConfig parse(const json& j) { return parse_model_config(j.dump(), "config.json"); }

TEST(Config, DefaultsWhenOptionalFieldsAbsent) {
  json j = json::parse(kLlama3_2_1B);
  for (const char* key : {"num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                          "rope_scaling", "tie_word_embeddings", "attention_bias", "hidden_act",
                          "torch_dtype", "eos_token_id", "bos_token_id", "max_position_embeddings"}) {
    j.erase(key);
  }
  ModelConfig c = parse(j);
  EXPECT_EQ(c.num_key_value_heads, 32);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.rope_scaling.type == RopeType::Llama3);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_EQ(c.torch_dtype, "");
  // LlamaConfig's class defaults (transformers' generate stops at 2 for such a file);
  // session 17: opd had none.
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{2});
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.max_position_embeddings, 2048);  // LlamaConfig's default
  // Qwen2Config and Qwen3Config have none.
  json q = base_json();
  q.erase("eos_token_id");
  q.erase("bos_token_id");
  EXPECT_TRUE(parse(q).eos_token_ids.empty());
  EXPECT_EQ(parse(q).bos_token_id, -1);
  // A default outside a tiny vocabulary could never be produced: dropped, not refused.
  j["vocab_size"] = 2;
  EXPECT_TRUE(parse(j).eos_token_ids.empty());
  EXPECT_EQ(parse(j).bos_token_id, 1);
}

TEST(Config, NullMeansDefault) {
  json j = base_json();
  j["eos_token_id"] = nullptr;
  j["bos_token_id"] = nullptr;
  j["num_key_value_heads"] = nullptr;
  j["rope_scaling"] = nullptr;
  ModelConfig c = parse(j);
  EXPECT_TRUE(c.eos_token_ids.empty());
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_EQ(c.num_key_value_heads, 14);
  json l = json::parse(kLlama3_2_1B);  // Llama: null means none, absent means 1 and 2
  l["eos_token_id"] = nullptr;
  l["bos_token_id"] = nullptr;
  EXPECT_TRUE(parse(l).eos_token_ids.empty());
  EXPECT_EQ(parse(l).bos_token_id, -1);
}

TEST(Config, RopeParametersAndLegacyKeys) {
  json j = json::parse(kLlama3_2_1B);
  json rope = j["rope_scaling"];
  j.erase("rope_scaling");
  j.erase("rope_theta");
  rope["rope_theta"] = 700000.0;
  j["rope_parameters"] = rope;  // transformers 5 spelling
  ModelConfig c = parse(j);
  EXPECT_EQ(c.rope_theta, 700000.0);
  EXPECT_TRUE(c.rope_scaling.type == RopeType::Llama3);
  EXPECT_EQ(c.rope_scaling.factor, 32.0);

  // `type` is the old name of `rope_type`; rope_theta may sit outside the dict.
  json k = json::parse(kLlama3_2_1B);
  k["rope_scaling"].erase("rope_type");
  k["rope_scaling"]["type"] = "llama3";
  c = parse(k);
  EXPECT_TRUE(c.rope_scaling.type == RopeType::Llama3);
  EXPECT_EQ(c.rope_theta, 500000.0);

  // "default" and {} mean no scaling.
  k["rope_scaling"] = {{"rope_type", "default"}};
  EXPECT_FALSE(parse(k).rope_scaling.type == RopeType::Llama3);
  k["rope_scaling"] = json::object();
  EXPECT_FALSE(parse(k).rope_scaling.type == RopeType::Llama3);

  // dtype wins over torch_dtype (transformers 5 keeps `dtype` when both are present).
  json d = base_json();
  d["dtype"] = "float32";
  EXPECT_EQ(parse(d).torch_dtype, "float32");
}

TEST(Config, EosList) {
  json j = base_json();
  j["eos_token_id"] = {151643, 151645};
  EXPECT_EQ(parse(j).eos_token_ids, (std::vector<int64_t>{151643, 151645}));
  j["eos_token_id"] = json::array();
  EXPECT_TRUE(parse(j).eos_token_ids.empty());
}

TEST(Config, ArchitectureFromModelTypeAlone) {
  json j = base_json();
  j.erase("architectures");
  EXPECT_EQ(parse(j).arch, Architecture::Qwen2);
}

// --- errors ------------------------------------------------------------------------------------

// Asserts that parsing throws opd::Error of `kind` whose message contains every `parts`.
void expect_error(const json& j, ErrorKind kind, std::initializer_list<std::string> parts) {
  std::string text = j.dump();
  try {
    parse_model_config(text, "config.json");
    ADD_FAILURE() << "no error for " << text;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
        << "message lacks '" << p << "': " << e.what();
  }
}

// RoPE scaling types beyond llama3 (session 17: "linear" and "yarn" were refused although
// transformers runs them; Qwen2.5 model cards recommend yarn for long context).
TEST(Config, RopeLinearAndYarn) {
  json j = json::parse(kLlama3_2_1B);
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  ModelConfig c = parse(j);
  EXPECT_EQ(c.rope_scaling.type, RopeType::Linear);
  EXPECT_EQ(c.rope_scaling.factor, 2.0);
  EXPECT_EQ(c.attention_scale(), 1.0 / 8.0);  // head_dim 64
  j["rope_scaling"] = {{"rope_type", "linear"}};
  expect_error(j, ErrorKind::InvalidData, {"field 'rope_scaling.factor' is required but missing"});

  json q = base_json();  // Qwen2.5: the model card's block, max_position_embeddings 32768
  q["rope_scaling"] = {{"factor", 4.0}, {"original_max_position_embeddings", 32768}, {"type", "yarn"}};
  c = parse(q);
  EXPECT_EQ(c.rope_scaling.type, RopeType::Yarn);
  EXPECT_EQ(c.rope_scaling.factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 32768);
  EXPECT_EQ(c.rope_scaling.beta_fast, 32.0);
  EXPECT_EQ(c.rope_scaling.beta_slow, 1.0);
  EXPECT_TRUE(c.rope_scaling.truncate);
  const double m = 0.1 * std::log(4.0) + 1.0;  // get_mscale(factor)
  EXPECT_DOUBLE_EQ(c.rope_scaling.attention_factor, m);
  EXPECT_DOUBLE_EQ(c.attention_scale(), m * m / 8.0);
  // Without original_max_position_embeddings: max_position_embeddings (standardize_rope_params).
  q["rope_scaling"].erase("original_max_position_embeddings");
  EXPECT_EQ(parse(q).rope_scaling.original_max_position_embeddings, 32768);
  // A top-level original_max_position_embeddings wins over the dict's (transformers applies it
  // when it builds the rotary embedding), for yarn and llama3 alike.
  q["rope_scaling"]["original_max_position_embeddings"] = 8192;
  q["original_max_position_embeddings"] = 16384;
  EXPECT_EQ(parse(q).rope_scaling.original_max_position_embeddings, 16384);
  json l = json::parse(kLlama3_2_1B);
  l["original_max_position_embeddings"] = 4096;
  EXPECT_EQ(parse(l).rope_scaling.original_max_position_embeddings, 4096);
  // Explicit attention_factor; mscale pair; falsy betas mean the defaults; factor null.
  q = base_json();
  q["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 8.0}, {"attention_factor", 1.5},
                       {"beta_fast", 0}, {"beta_slow", 0}, {"truncate", false}};
  c = parse(q);
  EXPECT_EQ(c.rope_scaling.attention_factor, 1.5);
  EXPECT_EQ(c.rope_scaling.beta_fast, 32.0);
  EXPECT_EQ(c.rope_scaling.beta_slow, 1.0);
  EXPECT_FALSE(c.rope_scaling.truncate);
  q["rope_scaling"].erase("attention_factor");
  q["rope_scaling"]["mscale"] = 0.707;
  q["rope_scaling"]["mscale_all_dim"] = 0.707;
  EXPECT_DOUBLE_EQ(parse(q).rope_scaling.attention_factor, 1.0);
  q["rope_scaling"]["mscale_all_dim"] = 0;  // both needed, else get_mscale(factor)
  EXPECT_DOUBLE_EQ(parse(q).rope_scaling.attention_factor, 0.1 * std::log(8.0) + 1.0);
  q["rope_scaling"]["factor"] = nullptr;  // DeepSeek-V3 style: max / original
  q["rope_scaling"]["original_max_position_embeddings"] = 4096;
  EXPECT_EQ(parse(q).rope_scaling.factor, 8.0);
  // Round trip: the resolved attention factor is written, so transformers needs no mscale rule.
  q["rope_scaling"]["mscale_all_dim"] = 1.3;
  c = parse(q);
  ModelConfig back = parse_model_config(model_config_to_json(c), "re-serialized");
  EXPECT_EQ(back.rope_scaling.type, RopeType::Yarn);
  EXPECT_EQ(back.rope_scaling.attention_factor, c.rope_scaling.attention_factor);
  EXPECT_EQ(back.rope_scaling.factor, c.rope_scaling.factor);
  EXPECT_EQ(back.rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_EQ(back.attention_scale(), c.attention_scale());
}

// transformers' ACT2FN maps "swish" to SiLU as well.
TEST(Config, SwishIsSilu) {
  json j = base_json();
  j["hidden_act"] = "swish";
  EXPECT_EQ(parse(j).hidden_act, "swish");
  EXPECT_NE(model_config_to_json(parse(j)).find("\"hidden_act\": \"swish\""), std::string::npos);
}

TEST(ConfigErrors, MissingRequiredField) {
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads"}) {
    json j = base_json();
    j.erase(key);
    expect_error(j, ErrorKind::InvalidData,
                 {std::string("config.json: field '") + key + "' is required but missing"});
  }
}

TEST(ConfigErrors, WrongTypes) {
  json j = base_json();
  j["num_attention_heads"] = "abc";
  expect_error(j, ErrorKind::InvalidData,
               {"config.json: field 'num_attention_heads' must be a positive integer, got \"abc\""});
  j = base_json();
  j["hidden_size"] = 896.5;
  expect_error(j, ErrorKind::InvalidData, {"field 'hidden_size' must be a positive integer, got 896.5"});
  j = base_json();
  j["vocab_size"] = true;
  expect_error(j, ErrorKind::InvalidData, {"field 'vocab_size'", "got true"});
  j = base_json();
  j["num_hidden_layers"] = 0;
  expect_error(j, ErrorKind::InvalidData, {"field 'num_hidden_layers' must be a positive integer, got 0"});
  j = base_json();
  j["intermediate_size"] = -4864;
  expect_error(j, ErrorKind::InvalidData, {"field 'intermediate_size'", "got -4864"});
  j = base_json();
  j["vocab_size"] = 1ull << 40;  // beyond the int32 bound on sizes
  expect_error(j, ErrorKind::InvalidData, {"field 'vocab_size'"});
  j = base_json();
  j["tie_word_embeddings"] = "true";
  expect_error(j, ErrorKind::InvalidData, {"field 'tie_word_embeddings' must be true or false"});
  j = base_json();
  j["rms_norm_eps"] = "1e-6";
  expect_error(j, ErrorKind::InvalidData, {"field 'rms_norm_eps' must be a positive finite number"});
  j = base_json();
  j["eos_token_id"] = "</s>";
  expect_error(j, ErrorKind::InvalidData, {"field 'eos_token_id'"});
  j = base_json();
  j["eos_token_id"] = {1, -2};
  expect_error(j, ErrorKind::InvalidData, {"field 'eos_token_id'", "got -2"});
  j = base_json();
  j["architectures"] = "Qwen2ForCausalLM";
  expect_error(j, ErrorKind::InvalidData, {"field 'architectures' must be a non-empty list"});
  j = base_json();
  j["rope_scaling"] = "llama3";
  expect_error(j, ErrorKind::InvalidData, {"field 'rope_scaling' must be an object"});
  j = base_json();
  j["torch_dtype"] = 16;
  expect_error(j, ErrorKind::InvalidData, {"field 'torch_dtype' must be a string"});
}

TEST(ConfigErrors, NotJsonOrNotObject) {
  try {
    parse_model_config("{\"vocab_size\": 1,", "dir/config.json");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidData);
    EXPECT_NE(std::string(e.what()).find("dir/config.json: not valid JSON"), std::string::npos);
  }
  expect_error(json::array({1, 2}), ErrorKind::InvalidData, {"config.json: expected a JSON object"});
}

TEST(ConfigErrors, UnknownArchitecture) {
  json j = base_json();
  j["architectures"] = {"MistralForCausalLM"};
  expect_error(j, ErrorKind::Unsupported, {"field 'architectures'", "MistralForCausalLM"});
  j = base_json();
  j.erase("architectures");
  j["model_type"] = "gemma";
  expect_error(j, ErrorKind::Unsupported, {"field 'model_type'", "gemma"});
  j.erase("model_type");
  expect_error(j, ErrorKind::InvalidData, {"field 'architectures' is missing"});
  j = base_json();
  j["model_type"] = "llama";
  expect_error(j, ErrorKind::InvalidData, {"field 'model_type' is 'llama'", "Qwen2ForCausalLM"});
}

TEST(ConfigErrors, UnsupportedFeatures) {
  json j = base_json();
  j["hidden_act"] = "gelu";
  expect_error(j, ErrorKind::Unsupported, {"field 'hidden_act' is 'gelu'", "'silu' (alias 'swish')"});
  j = base_json();
  j["use_sliding_window"] = true;  // max_window_layers 24 == num_hidden_layers: nothing slides
  EXPECT_NO_THROW(parse(j));
  j["max_window_layers"] = 21;
  expect_error(j, ErrorKind::Unsupported, {"field 'use_sliding_window'"});
  j = base_json();
  j["layer_types"] = json::array();
  for (int i = 0; i < 24; ++i) j["layer_types"].push_back(i == 3 ? "sliding_attention" : "full_attention");
  expect_error(j, ErrorKind::Unsupported, {"field 'layer_types'", "sliding_attention"});
  j = json::parse(kLlama3_2_1B);
  j["mlp_bias"] = true;
  expect_error(j, ErrorKind::Unsupported, {"field 'mlp_bias'"});
  j = base_json();
  j["quantization_config"] = {{"quant_method", "fp8"}};
  expect_error(j, ErrorKind::Unsupported, {"field 'quantization_config'"});
  j = base_json();
  j["torch_dtype"] = "float8_e4m3fn";
  expect_error(j, ErrorKind::Unsupported, {"field 'torch_dtype'", "float8_e4m3fn"});
}

TEST(ConfigErrors, HeadGeometry) {
  json j = base_json();
  j["num_key_value_heads"] = 3;  // 14 % 3 != 0
  expect_error(j, ErrorKind::InvalidData, {"field 'num_key_value_heads' (3) must divide num_attention_heads (14)"});
  j = base_json();
  j.erase("num_key_value_heads");  // Qwen2Config's default is 32, which 14 heads cannot share
  expect_error(j, ErrorKind::InvalidData, {"field 'num_key_value_heads' (32, the default when absent)"});
  j["num_attention_heads"] = 64;
  j["head_dim"] = 14;
  EXPECT_EQ(parse(j).num_key_value_heads, 32);
  j = base_json();
  j["hidden_size"] = 900;  // 900 % 14 != 0 and no head_dim
  expect_error(j, ErrorKind::InvalidData, {"field 'head_dim' is missing", "does not divide hidden_size (900)"});
  j["head_dim"] = 64;  // explicit head_dim makes it fine for Qwen2
  EXPECT_NO_THROW(parse(j));
  j = json::parse(kLlama3_2_1B);
  j["hidden_size"] = 2050;  // Llama requires the division even with head_dim given
  expect_error(j, ErrorKind::InvalidData, {"field 'num_attention_heads' (32) must divide hidden_size (2050)"});
  j = json::parse(kQwen3_0_6B);
  j["head_dim"] = 127;
  expect_error(j, ErrorKind::InvalidData, {"field 'head_dim' must be even", "127"});
}

TEST(ConfigErrors, Rope) {
  json j = json::parse(kLlama3_2_1B);
  j["rope_scaling"]["rope_type"] = "longrope";
  expect_error(j, ErrorKind::Unsupported, {"field 'rope_scaling.rope_type' is 'longrope'"});
  j = json::parse(kLlama3_2_1B);
  j["rope_scaling"] = {{"type", "ntk"}, {"factor", 2.0}};
  expect_error(j, ErrorKind::Unsupported, {"field 'rope_scaling.type' is 'ntk'"});
  j = json::parse(kLlama3_2_1B);
  j["rope_parameters"] = {{"rope_type", "dynamic"}, {"factor", 2.0}};
  j.erase("rope_scaling");
  expect_error(j, ErrorKind::Unsupported,
               {"field 'rope_parameters.rope_type' is 'dynamic'", "running sequence length"});
  // partial_rotary_factor: the scaled types would rotate part of the head in transformers
  // (which then fails for these families); the default type ignores it there, and here.
  j = json::parse(kLlama3_2_1B);
  j["rope_scaling"]["partial_rotary_factor"] = 0.5;
  expect_error(j, ErrorKind::Unsupported, {"field 'rope_scaling.partial_rotary_factor' is 0.5", "llama3"});
  j = json::parse(kLlama3_2_1B);
  j["partial_rotary_factor"] = 0.25;
  expect_error(j, ErrorKind::Unsupported, {"field 'partial_rotary_factor' is 0.25"});
  j["rope_scaling"] = nullptr;
  EXPECT_NO_THROW(parse(j));
  j = base_json();
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}, {"attention_factor", 0.0}};
  expect_error(j, ErrorKind::InvalidData, {"field 'rope_scaling.attention_factor' must be a positive number"});
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}, {"beta_fast", -1.0}};
  expect_error(j, ErrorKind::InvalidData, {"field 'rope_scaling.beta_fast'", "positive"});
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 0.5}};
  expect_error(j, ErrorKind::InvalidData, {"field 'rope_scaling.factor' must be a number >= 1, got 0.5"});
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}, {"truncate", "no"}};
  expect_error(j, ErrorKind::InvalidData, {"field 'rope_scaling.truncate' must be true or false"});
  j = json::parse(kLlama3_2_1B);
  j["rope_scaling"].erase("factor");
  expect_error(j, ErrorKind::InvalidData, {"field 'rope_scaling.factor' is required but missing"});
  j = json::parse(kLlama3_2_1B);
  j["rope_scaling"]["high_freq_factor"] = 1.0;
  expect_error(j, ErrorKind::InvalidData, {"field 'rope_scaling.high_freq_factor' must be greater"});
  j = json::parse(kLlama3_2_1B);
  j["rope_scaling"]["factor"] = 0.5;
  expect_error(j, ErrorKind::InvalidData, {"field 'rope_scaling.factor' must be a number >= 1"});
  j = json::parse(kLlama3_2_1B);
  j["rope_scaling"]["original_max_position_embeddings"] = "8192";
  expect_error(j, ErrorKind::InvalidData, {"field 'rope_scaling.original_max_position_embeddings'"});
  j = base_json();
  j["rope_theta"] = 0;
  expect_error(j, ErrorKind::InvalidData, {"field 'rope_theta' must be a positive finite number, got 0"});
  j = base_json();
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", -1.0}};
  expect_error(j, ErrorKind::InvalidData, {"field 'rope_parameters.rope_theta'"});
  j = base_json();
  j["rms_norm_eps"] = 0.0;
  expect_error(j, ErrorKind::InvalidData, {"field 'rms_norm_eps' must be a positive finite number"});
}

TEST(ConfigErrors, TokenIdsOutsideVocabulary) {
  json j = base_json();
  j["eos_token_id"] = {151643, 151936};
  expect_error(j, ErrorKind::InvalidData, {"field 'eos_token_id' contains 151936", "151936"});
  j = base_json();
  j["bos_token_id"] = 200000;
  expect_error(j, ErrorKind::InvalidData, {"field 'bos_token_id' is 200000"});
}

TEST(ConfigErrors, ParameterCountOverflow) {
  json j = base_json();
  const int64_t big = (int64_t{1} << 31) - 1;
  j["vocab_size"] = big;
  j["hidden_size"] = big - 1;  // even, so 2 heads x ... divides
  j["num_attention_heads"] = 1;
  j["num_key_value_heads"] = 1;
  j["intermediate_size"] = big;
  j["num_hidden_layers"] = kMaxModelLayers;  // the most layers a config may have (config.h)
  j["head_dim"] = big - 1;
  ModelConfig c = parse(j);
  try {
    (void)c.num_parameters();
    ADD_FAILURE() << "no overflow error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidData);
    EXPECT_NE(std::string(e.what()).find("overflows"), std::string::npos);
  }
}

TEST(ConfigErrors, MissingFileIsIo) {
  test::ScratchDir dir;
  try {
    load_model_config(dir.path());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Io);
    EXPECT_NE(std::string(e.what()).find(dir.path() + "/config.json"), std::string::npos);
  }
}

}  // namespace
}  // namespace opd
