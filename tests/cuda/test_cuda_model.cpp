// Whole model on CUDA (f32) against the same model on the CPU: logits and the gradient of
// every parameter for the Qwen3, Qwen2 and Llama fixtures. Needs every op on CUDA; until the
// attention kernels land (another branch) the test skips with the Unsupported message.
// TODO(attention): once attention runs on CUDA this test runs as is; add a bf16 variant when the
// model keeps f32 statistics and master gradients for bf16 weights.
#include <gtest/gtest.h>

#include <map>

#include "cuda/cuda_test_util.h"
#include "model/safetensors.h"
#include "model/transformer.h"

namespace opd::test {
namespace {

class CudaModel : public ::testing::TestWithParam<const char*> {};

ModelWeights to_device(const ModelWeights& w) {
  ModelWeights d = w;
  d.for_each([](const std::string&, Tensor& t) {
    if (t.defined()) t = t.to(Device::CUDA);
  });
  if (d.tied) d.lm_head = d.embed_tokens;
  return d;
}

Batch batch_to_device(const Batch& b) {
  return Batch{b.ids.to(Device::CUDA), b.cu_seqlens.to(Device::CUDA), b.positions.to(Device::CUDA)};
}

TEST_P(CudaModel, LogitsAndGradientsMatchTheCpu) {
  REQUIRE_GPU();
  const std::string dir = fixture_path(std::string("models/") + GetParam());
  Transformer cpu_model = Transformer::load(dir);
  const ModelConfig& c = cpu_model.config();
  Transformer gpu_model(c, to_device(cpu_model.weights()));
  Batch batch = make_batch({{1, 5, 9, 3, 7, 2}, {4}, {8, 6, 1, 2, 3, 4, 5, 6, 7}}, c.vocab_size);

  ForwardCache gpu_cache;
  Tensor gpu_logits;
  try {
    gpu_logits = gpu_model.forward(batch_to_device(batch), &gpu_cache);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::Unsupported) GTEST_SKIP() << "not every op runs on CUDA yet: " << e.what();
    throw;
  }
  ForwardCache cpu_cache;
  Tensor cpu_logits = cpu_model.forward(batch, &cpu_cache);
  EXPECT_LE(compare(host(gpu_logits), cpu_logits).max_rel, 1e-4);

  Tensor dlogits = random_uniform(cpu_logits.shape(), DType::F32, 3);
  ModelWeights cpu_grads = zeros_weights(c), gpu_grads = to_device(zeros_weights(c));
  cpu_model.backward(batch, cpu_cache, dlogits, cpu_grads);
  gpu_model.backward(batch_to_device(batch), gpu_cache, dlogits.to(Device::CUDA), gpu_grads);
  std::map<std::string, Tensor> cpu_by_name;
  cpu_grads.for_each([&](const std::string& name, const Tensor& t) { cpu_by_name[name] = t; });
  int checked = 0;
  gpu_grads.for_each([&](const std::string& name, const Tensor& t) {
    if (!t.defined()) return;
    EXPECT_LE(compare(host(t), cpu_by_name.at(name)).max_rel, 1e-3) << name;
    ++checked;
  });
  EXPECT_GT(checked, 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaModel, ::testing::Values("qwen3", "qwen2", "llama"));

}  // namespace
}  // namespace opd::test
