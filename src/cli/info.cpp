// `opd info DIR [--json]`: what a model directory holds — architecture, shapes, parameter
// counts (total and without embeddings), vocabulary, stored dtypes, tied embeddings, EOS ids
// and the tokenizer fingerprint that teacher/student compatibility checks compare.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <map>
#include <set>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "tokenizer/fingerprint.h"

namespace opd::cli {
namespace {

struct InfoOptions {
  std::string dir;
  bool json = false;
};

void run_info(const InfoOptions& o) {
  ModelConfig c = load_model_config(o.dir);
  WeightStore store = WeightStore::open_dir(o.dir);
  // Every expected tensor must be present with its shape (this is also a load check).
  std::map<std::string, int64_t> stored_dtypes;
  std::set<std::string> used;
  for (const auto& [name, shape] : parameter_shapes(c)) {
    used.insert(name);
    OPD_CHECK(store.contains(name), InvalidData, o.dir, ": tensor '", name,
              "' expected by config.json is missing from the safetensors files");
    Tensor t = store.get(name);
    OPD_CHECK(t.shape() == shape, InvalidData, o.dir, ": tensor '", name, "' has shape ",
              shape_str(t.shape()), ", config.json implies ", shape_str(shape));
    stored_dtypes[std::string(dtype_name(t.dtype()))] += t.numel();
  }
  check_stored_tied_lm_head(c, store, Tensor());
  // Stored tensors the config does not read (a layer count below the stored one, biases with
  // attention_bias false): the model would compute something else than its checkpoint.
  const std::vector<std::string> unused = unused_tensors(store, used, c.tie_word_embeddings);
  warn_unused_tensors(store, unused);
  const int64_t total = c.num_parameters();
  const int64_t non_embedding = total - c.num_embedding_parameters();
  TokenizerFingerprint fp = tokenizer_fingerprint(o.dir, c.vocab_size);

  if (o.json) {
    nlohmann::json j;
    j["path"] = o.dir;
    j["architecture"] = architecture_name(c.arch);
    j["model_type"] = c.model_type;
    j["vocab_size"] = c.vocab_size;
    j["hidden_size"] = c.hidden_size;
    j["intermediate_size"] = c.intermediate_size;
    j["num_hidden_layers"] = c.num_hidden_layers;
    j["num_attention_heads"] = c.num_attention_heads;
    j["num_key_value_heads"] = c.num_key_value_heads;
    j["head_dim"] = c.head_dim;
    j["rope_theta"] = c.rope_theta;
    j["rope_scaling"] =
        c.rope_scaling.type == RopeType::Default ? "none" : rope_type_name(c.rope_scaling.type);
    j["tie_word_embeddings"] = c.tie_word_embeddings;
    j["attention_bias"] = c.attention_bias;
    j["qk_norm"] = c.qk_norm;
    j["config_dtype"] = c.torch_dtype;
    j["stored_dtypes"] = stored_dtypes;
    j["unused_tensors"] = unused;
    j["num_parameters"] = total;
    j["num_non_embedding_parameters"] = non_embedding;
    j["eos_token_ids"] = c.eos_token_ids;
    j["bos_token_id"] = c.bos_token_id;
    j["tokenizer_fingerprint"] = fp.sha256;
    j["has_tokenizer"] = fp.has_tokenizer;
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::string dtypes;
  for (const auto& [d, n] : stored_dtypes) dtypes += cat(dtypes.empty() ? "" : ", ", d, " (", n, ")");
  std::string eos;
  for (int64_t e : c.eos_token_ids) eos += cat(eos.empty() ? "" : ", ", e);
  std::printf("model          %s\n", o.dir.c_str());
  std::printf("architecture   %s (%s)\n", architecture_name(c.arch), c.model_type.c_str());
  std::printf("layers         %lld x (hidden %lld, intermediate %lld)\n",
              (long long)c.num_hidden_layers, (long long)c.hidden_size,
              (long long)c.intermediate_size);
  std::printf("attention      %lld query / %lld kv heads, head_dim %lld%s%s\n",
              (long long)c.num_attention_heads, (long long)c.num_key_value_heads,
              (long long)c.head_dim, c.qk_norm ? ", q/k RMSNorm" : "",
              c.attention_bias ? ", q/k/v bias" : "");
  std::printf("rope           theta %g%s\n", c.rope_theta,
              c.rope_scaling.type == RopeType::Default
                  ? ""
                  : cat(", ", rope_type_name(c.rope_scaling.type), " scaling x",
                        c.rope_scaling.factor)
                        .c_str());
  std::printf("vocab          %lld%s\n", (long long)c.vocab_size,
              c.tie_word_embeddings ? " (tied input/output embeddings)" : " (separate lm_head)");
  std::printf("parameters     %lld total, %lld without embeddings and lm_head\n", (long long)total,
              (long long)non_embedding);
  std::printf("dtype          config: %s; stored: %s\n",
              c.torch_dtype.empty() ? "(unset)" : c.torch_dtype.c_str(), dtypes.c_str());
  if (!unused.empty())
    std::printf("unused         %zu stored tensor%s not read (config.json disagrees): %s%s\n",
                unused.size(), unused.size() > 1 ? "s" : "", unused.front().c_str(),
                unused.size() > 1 ? ", ..." : "");
  std::printf("special ids    bos %lld, eos [%s]\n", (long long)c.bos_token_id, eos.c_str());
  std::printf("fingerprint    %s%s\n", fp.sha256.c_str(),
              fp.has_tokenizer ? "" : " (no tokenizer.json: vocab size only)");
}

}  // namespace

void register_info(CLI::App& app) {
  auto opts = std::make_shared<InfoOptions>();
  CLI::App* cmd = app.add_subcommand(
      "info", "Describe a Hugging Face model directory (config.json + safetensors)");
  cmd->add_option("dir", opts->dir, "model directory")->required()->check(CLI::ExistingDirectory);
  cmd->add_flag("--json", opts->json, "print one JSON object instead of a table");
  cmd->callback([opts] { run_info(*opts); });
}

}  // namespace opd::cli
