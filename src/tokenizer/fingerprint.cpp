// Canonical-JSON SHA-256 fingerprint of a tokenizer (see fingerprint.h).
#include "tokenizer/fingerprint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/text_io.h"
#include "core/sha256.h"

namespace opd {

TokenizerFingerprint tokenizer_fingerprint(const std::string& model_dir, int64_t vocab_size) {
  TokenizerFingerprint fp;
  nlohmann::json canon = nlohmann::json::object();
  canon["vocab_size"] = vocab_size;
  const std::string path = model_dir + "/tokenizer.json";
  if (std::filesystem::exists(path)) {
    const std::string text = read_text_file(path);
    check_json_depth(text, path);
    nlohmann::json tok;
    try {
      tok = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      OPD_FAIL(InvalidData, path, ": not valid JSON: ", e.what());
    }
    if (!tok.is_object()) OPD_FAIL(InvalidData, path, ": top level is not a JSON object");
    for (const char* key : {"model", "added_tokens", "normalizer", "pre_tokenizer"})
      canon[key] = tok.contains(key) ? tok[key] : nlohmann::json();
    fp.has_tokenizer = true;
    // Highest id + 1 over the BPE vocabulary and the added tokens.
    auto see = [&](const nlohmann::json& id) {
      if (id.is_number_integer()) fp.tokenizer_vocab = std::max(fp.tokenizer_vocab, id.get<int64_t>() + 1);
    };
    if (tok.contains("model") && tok["model"].is_object() && tok["model"].contains("vocab") &&
        tok["model"]["vocab"].is_object())
      for (const auto& item : tok["model"]["vocab"].items()) see(item.value());
    if (tok.contains("added_tokens") && tok["added_tokens"].is_array())
      for (const auto& t : tok["added_tokens"])
        if (t.is_object() && t.contains("id")) see(t["id"]);
  }
  // nlohmann::json objects are std::map-backed: dump() has sorted keys, so it is canonical.
  fp.sha256 = sha256_hex(canon.dump());
  return fp;
}

}  // namespace opd
