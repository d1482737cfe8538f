// `opd shrink --model DIR --out DIR (--keep-layers SPEC | --drop-layers SPEC)`: a smaller student
// made of a subset of a model's decoder layers (model/shrink.h), e.g. --drop-layers odd keeps
// layers 0, 2, 4, ... SPEC is a comma list of layer indices, `even` or `odd`.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "cli/commands.h"
#include "core/error.h"
#include "model/config.h"
#include "model/shrink.h"

namespace opd::cli {
namespace {

struct ShrinkOptions {
  std::string model;
  std::string out;
  std::string keep;
  std::string drop;
};

void run_shrink(const ShrinkOptions& o) {
  const ModelConfig c = load_model_config(o.model);
  OPD_CHECK(o.keep.empty() != o.drop.empty(), InvalidArgument,
            "opd shrink: give one of --keep-layers or --drop-layers");
  std::vector<int64_t> keep;
  if (!o.keep.empty()) {
    keep = parse_layer_selection(o.keep, c.num_hidden_layers, "--keep-layers");
  } else {
    keep = complement_layers(parse_layer_selection(o.drop, c.num_hidden_layers, "--drop-layers"),
                             c.num_hidden_layers);
    OPD_CHECK(!keep.empty(), InvalidArgument, "--drop-layers '", o.drop, "' drops every layer");
  }
  ModelConfig s = shrink_model_dir(o.model, o.out, keep);
  std::string list;
  for (int64_t l : keep) list += cat(list.empty() ? "" : ",", l);
  std::printf("wrote %s: %lld of %lld layers (kept %s), %lld parameters (was %lld)\n",
              o.out.c_str(), (long long)s.num_hidden_layers, (long long)c.num_hidden_layers,
              list.c_str(), (long long)s.num_parameters(), (long long)c.num_parameters());
}

}  // namespace

void register_shrink(CLI::App& app) {
  auto opts = std::make_shared<ShrinkOptions>();
  CLI::App* cmd = app.add_subcommand(
      "shrink", "Make a smaller student by keeping a subset of a model's layers");
  cmd->add_option("--model", opts->model, "source Hugging Face model directory")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--out", opts->out, "output directory (must not exist, or be empty)")->required();
  auto* keep = cmd->add_option("--keep-layers", opts->keep,
                               "layers to keep: comma list (0,2,4), even or odd (no default)");
  auto* drop = cmd->add_option("--drop-layers", opts->drop,
                               "layers to remove: comma list, even or odd (no default)");
  keep->excludes(drop);
  cmd->callback([opts] { run_shrink(*opts); });
}

}  // namespace opd::cli
