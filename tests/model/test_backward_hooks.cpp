// The backward's GradsReady hook on the CPU reference (model/transformer.h; the ZeRO-2 overlap
// in train/trainer.cpp relies on it): order, finality and no effect on the result, without
// activation recompute and with each granularity. Checks in backward_hooks_check.h.
#include "model/backward_hooks_check.h"

namespace opd::test {
namespace {

Batch hooks_batch(int64_t vocab) {
  std::vector<std::vector<int32_t>> seqs = {{1, 5, 9, 3, 7, 2}, {4}, {8, 6, 1, 2, 3, 4, 5, 6, 7}};
  for (auto& s : seqs)
    for (auto& id : s) id = static_cast<int32_t>(id % vocab);
  return make_batch(seqs, vocab);
}

ModelWeights nonzero_grads(const ModelConfig& c) {
  ModelWeights g = zeros_weights(c, DType::F32);
  uint64_t seed = 700;
  g.for_each([&](const std::string&, Tensor& t) { t.copy_from(random_uniform(t.shape(), DType::F32, seed++)); });
  if (g.tied) g.lm_head = g.embed_tokens;
  return g;
}

TEST(BackwardHooks, CpuOrderFinalityAndSameResult) {
  for (Recompute rc : {Recompute::Off, Recompute::Elementwise, Recompute::PerLayer}) {
    for (const char* fixture : {"models/qwen3", "models/llama"}) {
      SCOPED_TRACE(std::string(fixture) + 
                   (rc == Recompute::Off           ? ""
                    : rc == Recompute::Elementwise ? " elementwise recompute"
                                                   : " layer recompute"));
      Transformer model = Transformer::load(fixture_path(fixture));
      model.set_recompute(rc);
      const ModelConfig& c = model.config();
      const Batch batch = hooks_batch(c.vocab_size);
      const Tensor dh = random_uniform({batch.num_tokens(), c.hidden_size}, DType::F32, 41);
      check_backward_hooks(model, batch, dh, [&] { return nonzero_grads(c); });
    }
  }
}

}  // namespace
}  // namespace opd::test
