// `opd convert --from-gguf FILE --out DIR [--dtype bf16|f32]`: imports a GGUF model (llama.cpp's
// format, any of the quantizations dequant.h reads) as a Hugging Face directory that opd and
// transformers load: config.json, model.safetensors, generation_config.json, tokenizer.json and
// tokenizer_config.json (with the chat template) rebuilt from the GGUF metadata.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "cli/commands.h"
#include "core/error.h"
#include "model/gguf_convert.h"

namespace opd::cli {
namespace {

struct ConvertOptions {
  std::string from_gguf;
  std::string out;
  std::string dtype = "bf16";
};

void run_convert(const ConvertOptions& o) {
  const DType dtype = o.dtype == "f32" ? DType::F32 : DType::BF16;
  GgufConvertSummary s = convert_gguf_to_hf(o.from_gguf, o.out, dtype);
  std::string types;
  for (const auto& [t, n] : s.tensor_types) types += cat(types.empty() ? "" : ", ", t, " x", n);
  std::printf("converted %s -> %s\n", o.from_gguf.c_str(), o.out.c_str());
  std::printf("  %s, %lld layers, hidden %lld, vocab %lld, %lld parameters, %s\n",
              architecture_name(s.config.arch), (long long)s.config.num_hidden_layers,
              (long long)s.config.hidden_size, (long long)s.config.vocab_size,
              (long long)s.config.num_parameters(), s.config.torch_dtype.c_str());
  std::printf("  %lld GGUF tensors: %s\n", (long long)s.num_tensors, types.c_str());
}

}  // namespace

void register_convert(CLI::App& app) {
  auto opts = std::make_shared<ConvertOptions>();
  CLI::App* cmd = app.add_subcommand(
      "convert", "Convert a GGUF model file into a Hugging Face model directory");
  cmd->add_option("--from-gguf", opts->from_gguf,
                  "GGUF file to import (llama/qwen2/qwen3; F32, F16, BF16, Q8_0, Q4_0, Q4_1, "
                  "Q4_K, Q5_K, Q6_K tensors)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--out", opts->out, "output directory (must not exist, or be empty)")->required();
  cmd->add_option("--dtype", opts->dtype, "stored dtype of the weights (default: bf16)")
      ->check(CLI::IsMember({"bf16", "f32"}));
  cmd->callback([opts] { run_convert(*opts); });
}

}  // namespace opd::cli
