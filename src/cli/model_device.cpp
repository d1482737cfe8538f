// --device / --dtype of the commands that load a model to run it (cli/model_device.h).
#include "cli/model_device.h"

#include <CLI/CLI.hpp>

#include "core/error.h"

namespace opd::cli {

void add_model_device_flags(CLI::App* cmd, ModelDevice& flags, std::string_view what) {
  cmd->add_option("--device", flags.device,
                  "where " + std::string(what) +
                      " run: cpu (f32 reference) | cuda (on the GPU in --dtype)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--dtype", flags.dtype, "cuda: compute dtype bf16 | f32 (the CPU runs f32)")
      ->check(CLI::IsMember({"bf16", "f32"}))
      ->capture_default_str();
}

void check_model_device(const ModelDevice& flags, std::string_view command) {
  if (flags.where() != Device::CUDA) return;
  OPD_CHECK(device_hooks::cuda_device_count() > 0, Unsupported, command,
            " --device cuda: no usable CUDA device here (",
            device_hooks::cuda_compiled() ? "no GPU or driver" : "a build without CUDA",
            "); use --device cpu");
}

Transformer load_model_on(const std::string& dir, const ModelDevice& flags,
                          std::string_view command) {
  check_model_device(flags, command);
  Transformer model = Transformer::load(dir);
  if (flags.where() != Device::CUDA) return model;
  return model.to(Device::CUDA, flags.cuda_dtype());
}

}  // namespace opd::cli
