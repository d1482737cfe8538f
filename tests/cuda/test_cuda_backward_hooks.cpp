// The backward's GradsReady hook on the CUDA model (model/transformer_cuda.cpp), f32 and bf16:
// reported in order, each group's gradients final once its kernels are queued (a synchronous
// copy at the hook sees the final bits), no effect on the result. Checks in
// tests/model/backward_hooks_check.h. Skipped without a GPU.
#include "cuda/cuda_test_util.h"
#include "model/backward_hooks_check.h"

namespace opd::test {
namespace {

TEST(CudaBackwardHooks, OrderFinalityAndSameResult) {
  REQUIRE_GPU();
  for (DType dt : {DType::F32, DType::BF16}) {
    for (Recompute rc : {Recompute::Off, Recompute::Elementwise, Recompute::PerLayer}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + 
                   (rc == Recompute::Off           ? ""
                    : rc == Recompute::Elementwise ? " elementwise recompute"
                                                   : " layer recompute"));
      Transformer loaded = Transformer::load(fixture_path("models/qwen3"));
      Transformer model = loaded.to(Device::CUDA, dt);
      model.set_recompute(rc);
      const ModelConfig& c = model.config();
      std::vector<std::vector<int32_t>> seqs = {{1, 5, 9, 3, 7, 2}, {4}, {8, 6, 1, 2, 3, 4, 5, 6, 7}};
      for (auto& s : seqs)
        for (auto& id : s) id = static_cast<int32_t>(id % c.vocab_size);
      const Batch hb = make_batch(seqs, c.vocab_size);
      const Batch batch{hb.ids.to(Device::CUDA), hb.cu_seqlens.to(Device::CUDA), hb.positions.to(Device::CUDA)};
      const Tensor dh = random_uniform({hb.num_tokens(), c.hidden_size}, DType::F32, 41).to(Device::CUDA);
      check_backward_hooks(model, batch, dh, [&] {
        ModelWeights g = zeros_weights(c, DType::F32, Device::CUDA);
        uint64_t seed = 700;
        g.for_each([&](const std::string&, Tensor& t) {
          t.copy_from(random_uniform(t.shape(), DType::F32, seed++).to(Device::CUDA));
        });
        if (g.tied) g.lm_head = g.embed_tokens;
        return g;
      });
    }
  }
}

}  // namespace
}  // namespace opd::test
