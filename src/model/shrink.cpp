// Layer-subset student (see shrink.h).
#include "model/shrink.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/text_io.h"
#include "model/output_dir.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace opd {

namespace fs = std::filesystem;

std::vector<int64_t> parse_layer_selection(const std::string& spec, int64_t num_layers,
                                           const std::string& flag) {
  std::vector<int64_t> out;
  if (spec == "even" || spec == "odd") {
    for (int64_t i = spec == "even" ? 0 : 1; i < num_layers; i += 2) out.push_back(i);
  } else {
    std::stringstream ss(spec);
    std::string item;
    while (std::getline(ss, item, ',')) {
      size_t used = 0;
      long long v = -1;
      try {
        v = std::stoll(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      OPD_CHECK(used == item.size() && !item.empty(), InvalidArgument, flag, " '", spec, "': '",
                item, "' is not a layer index (give e.g. 0,2,4 or even or odd)");
      OPD_CHECK(v >= 0 && v < num_layers, InvalidArgument, flag, " '", spec, "': layer ", v,
                " is outside [0, ", num_layers, ")");
      OPD_CHECK(std::find(out.begin(), out.end(), v) == out.end(), InvalidArgument, flag, " '",
                spec, "': layer ", v, " is listed twice");
      out.push_back(v);
    }
  }
  std::sort(out.begin(), out.end());
  OPD_CHECK(!out.empty(), InvalidArgument, flag, " '", spec, "' selects no layer");
  return out;
}

std::vector<int64_t> complement_layers(const std::vector<int64_t>& layers, int64_t num_layers) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < num_layers; ++i)
    if (std::find(layers.begin(), layers.end(), i) == layers.end()) out.push_back(i);
  return out;
}

namespace {

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  OPD_CHECK(in.good(), Io, "cannot open ", p.string());
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  OPD_CHECK(out.good(), Io, "cannot create ", path.string());
  out << text;
  out.close();
  OPD_CHECK(out.good(), Io, "cannot write ", path.string());
}

}  // namespace

ModelConfig shrink_model_dir(const std::string& in_dir, const std::string& out_dir,
                             const std::vector<int64_t>& keep) {
  const ModelConfig src = load_model_config(in_dir);
  OPD_CHECK(!keep.empty(), InvalidArgument, "shrink: no layer kept");
  for (size_t j = 0; j < keep.size(); ++j)
    OPD_CHECK(keep[j] >= 0 && keep[j] < src.num_hidden_layers &&
                  (j == 0 || keep[j] > keep[j - 1]),
              InvalidArgument, "shrink: kept layers must be increasing and in [0, ",
              src.num_hidden_layers, "), got ", keep[j], " at position ", j);
  const fs::path out = checked_output_dir(out_dir, "shrink");
  std::error_code ec;

  ModelConfig dst = src;
  dst.num_hidden_layers = static_cast<int64_t>(keep.size());
  WeightStore store = WeightStore::open_dir(in_dir);
  std::map<std::string, Tensor> tensors;
  const std::string prefix = "model.layers.";
  for (const auto& [name, shape] : parameter_shapes(dst)) {
    std::string from = name;
    if (name.rfind(prefix, 0) == 0) {
      const size_t dot = name.find('.', prefix.size());
      const int64_t j = std::stoll(name.substr(prefix.size(), dot - prefix.size()));
      from = cat(prefix, keep[static_cast<size_t>(j)], name.substr(dot));
    }
    Tensor t = store.get(from);  // zero-copy from the mapping; error names tensor and directory
    OPD_CHECK(t.shape() == shape, InvalidData, in_dir, ": tensor '", from, "' has shape ",
              shape_str(t.shape()), ", config.json implies ", shape_str(shape));
    tensors[name] = t;
  }

  // config.json: the original text with the layer count (and per-layer lists) changed, so
  // fields opd does not model survive.
  const std::string cfg_path = (fs::path(in_dir) / "config.json").string();
  const std::string cfg_text = read_text_file(cfg_path, int64_t{64} << 20);
  check_json_depth(cfg_text, cfg_path);
  nlohmann::ordered_json cfg = nlohmann::ordered_json::parse(cfg_text);
  cfg["num_hidden_layers"] = dst.num_hidden_layers;
  // transformers' per-layer list (Qwen2/Qwen3: "full_attention" / "sliding_attention").
  if (cfg.contains("layer_types") && cfg["layer_types"].is_array()) {
    OPD_CHECK(static_cast<int64_t>(cfg["layer_types"].size()) == src.num_hidden_layers, InvalidData,
              in_dir, "/config.json: layer_types has ", cfg["layer_types"].size(),
              " entries for ", src.num_hidden_layers, " layers");
    nlohmann::ordered_json picked = nlohmann::ordered_json::array();
    for (int64_t l : keep) picked.push_back(cfg["layer_types"][static_cast<size_t>(l)]);
    cfg["layer_types"] = picked;
  }
  if (cfg.contains("max_window_layers") && cfg["max_window_layers"].is_number_integer() &&
      cfg["max_window_layers"].get<int64_t>() > dst.num_hidden_layers)
    cfg["max_window_layers"] = dst.num_hidden_layers;

  const fs::path tmp = out.string() + ".tmp." + std::to_string(::getpid());
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  OPD_CHECK(!ec, Io, "cannot create ", tmp.string(), ": ", ec.message());
  try {
    save_safetensors((tmp / "model.safetensors").string(), tensors,
                     {{"format", "pt"}, {"source", cat("opd shrink of ", in_dir)}});
    write_text(tmp / "config.json", cfg.dump(2) + "\n");
    for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
                          "chat_template.jinja", "special_tokens_map.json", "vocab.json",
                          "merges.txt"}) {
      const fs::path p = fs::path(in_dir) / f;
      if (fs::exists(p, ec)) {
        fs::copy_file(p, tmp / f, fs::copy_options::overwrite_existing, ec);
        OPD_CHECK(!ec, Io, "cannot copy ", p.string(), ": ", ec.message());
      }
    }
    if (fs::exists(out, ec)) fs::remove(out, ec);
    fs::rename(tmp, out, ec);
    OPD_CHECK(!ec, Io, "cannot rename ", tmp.string(), " to ", out_dir, ": ", ec.message());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  return load_model_config(out_dir);
}

}  // namespace opd
