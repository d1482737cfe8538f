// Where a CLI command runs a model it loads itself (`opd generate`, `opd eval`): the
// `--device cpu|cuda` and `--dtype bf16|f32` flags, their checks, and the load onto the device.
// The CPU runs the f32 reference path; cuda runs the model in --dtype (bf16 by default, as
// `opd train --device cuda` computes), through the same engine code.
#pragma once

#include <string>
#include <string_view>

#include "core/tensor.h"
#include "model/transformer.h"

namespace CLI { class App; }

namespace opd::cli {

struct ModelDevice {
  std::string device = "cpu";  // cpu | cuda
  std::string dtype = "bf16";  // cuda only: bf16 | f32
  Device where() const { return device == "cuda" ? Device::CUDA : Device::CPU; }
  DType cuda_dtype() const { return dtype == "f32" ? DType::F32 : DType::BF16; }
};

// Adds --device and --dtype to `cmd`; `what` names what runs there ("the model", "the model and
// --teacher").
void add_model_device_flags(CLI::App* cmd, ModelDevice& flags, std::string_view what);

// Unsupported, naming `command`, when --device cuda has no usable GPU here (no driver or GPU, or a
// build without CUDA); the message says to use --device cpu. A no-op for cpu.
void check_model_device(const ModelDevice& flags, std::string_view command);

// Transformer::load(dir), moved to the GPU in the chosen dtype for cuda (after check_model_device).
Transformer load_model_on(const std::string& dir, const ModelDevice& flags, std::string_view command);

}  // namespace opd::cli
