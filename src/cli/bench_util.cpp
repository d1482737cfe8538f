// The helpers of cli/bench_util.h shared by the `opd bench` subcommands: median, the
// Qwen3-0.6B shape, and running a twin script for its JSON result line.
#include "cli/bench_util.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "core/error.h"  // cat
#include "model/presets.h"

#if defined(OPD_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "core/cuda/allocator.h"  // current_stream
#include "core/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"  // fill_normal, fill_uniform
#endif

namespace opd::cli {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

ModelConfig qwen3_06b(int64_t layers) {
  ModelConfig c = model_preset("qwen3-0.6b");
  c.num_hidden_layers = layers;
  return c;
}

ModelWeights random_bf16_cuda_weights(const ModelConfig& config, uint64_t seed) {
#if defined(OPD_WITH_CUDA)
  ModelWeights w = zeros_weights(config, DType::BF16, Device::CUDA);
  cudaStream_t stream = cuda::current_stream();
  w.for_each([&](const std::string&, Tensor& t) {
    if (t.ndim() == 1) cuda::fill_uniform(t.raw(), t.numel(), DType::BF16, seed++, 1.0f, 1.0f, stream);
    else cuda::fill_normal(t.raw(), t.numel(), DType::BF16, seed++, 0.0f, 0.02f, stream);
  });
  OPD_CUDA_CHECK(cudaDeviceSynchronize());
  return w;
#else
  (void)config;
  (void)seed;
  OPD_FAIL(Unsupported, "random CUDA weights in a build without CUDA");
#endif
}

nlohmann::json run_twin(const TwinRun& twin) {
  std::string script = twin.script;
  if (!script.empty() && script[0] != '/') {
    if (const char* src = std::getenv("OPD_SOURCE_DIR")) script = std::string(src) + "/" + script;
  }
  const std::string cmd = cat(twin.python, " ", script, twin.args, " 2>&1");
  if (!twin.quiet) std::printf("\n%s: %s\n", twin.name.c_str(), cmd.c_str());
  std::fflush(stdout);
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return nullptr;
  std::string line, last_json;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p)) {
    line = buf;
    if (!twin.quiet) std::fputs(buf, stdout);
    if (!line.empty() && line[0] == '{') last_json = line;
  }
  const int rc = pclose(p);
  if ((twin.require_success && rc != 0) || last_json.empty()) {
    std::printf("%s failed (exit status %d)\n", twin.name.c_str(), rc);
    return nullptr;
  }
  try {
    return nlohmann::json::parse(last_json);
  } catch (const std::exception&) {
    return nullptr;
  }
}

}  // namespace opd::cli
