// Thread-count independence: every CPU op but linear (OpenBLAS runs its own threads) gives
// bit-identical f32 results with 1 and 3 worker threads (thread_pool.h promises it;
// embedding/rmsnorm backward split columns rather than rows to keep it).
#include <gtest/gtest.h>

#include <vector>

#include "core/thread_pool.h"
#include "kernel_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

// Runs every op once on fixed f32 inputs and returns all outputs.
std::vector<Tensor> run_all_ops() {
  const DType f = DType::F32;
  std::vector<Tensor> res;
  // Embedding with many repeated ids and a wide row.
  Tensor ids = random_ints({64}, 1, 0, 5);
  Tensor table = random_uniform({5, 300}, f, 2);
  Tensor emb = Tensor::poisoned({64, 300}, f), dtable = random_uniform({5, 300}, f, 3);
  ops::embedding_forward(ids, table, emb);
  ops::embedding_backward(ids, random_uniform({64, 300}, f, 4), dtable);
  res.insert(res.end(), {emb, dtable});
  // RMSNorm.
  Tensor x = random_uniform({37, 300}, f, 5), w = random_uniform({300}, f, 6);
  Tensor y = Tensor::poisoned({37, 300}, f), rstd = Tensor::poisoned({37}, f);
  Tensor dx = Tensor::poisoned({37, 300}, f), dw = random_uniform({300}, f, 7);
  ops::rmsnorm_forward(x, w, 1e-6, y, rstd);
  ops::rmsnorm_backward(random_uniform({37, 300}, f, 8), x, w, rstd, dx, dw);
  res.insert(res.end(), {y, rstd, dx, dw});
  // RoPE.
  Tensor xr = random_uniform({37, 3, 8}, f, 9);
  Tensor inv_freq = random_uniform({4}, f, 10, 0.001, 1);
  ops::rope_forward(xr, random_ints({37}, 11, 0, 5000), inv_freq);
  res.push_back(xr);
  // Attention: 3 sequences, GQA 2.
  Tensor cu = Tensor::from_vector<int32_t>({0, 11, 12, 30}, {4});
  Tensor q = random_uniform({30, 4, 8}, f, 12), k = random_uniform({30, 2, 8}, f, 13),
         v = random_uniform({30, 2, 8}, f, 14);
  Tensor out = Tensor::poisoned({30, 4, 8}, f), lse = Tensor::poisoned({30, 4}, f);
  Tensor dq = Tensor::poisoned(q.shape(), f), dk = Tensor::poisoned(k.shape(), f),
         dv = Tensor::poisoned(v.shape(), f);
  ops::attention_forward(q, k, v, cu, 0.35, out, lse);
  ops::attention_backward(random_uniform({30, 4, 8}, f, 15), q, k, v, out, lse, cu, 0.35, dq, dk, dv);
  res.insert(res.end(), {out, lse, dq, dk, dv});
  // SwiGLU and add over sizes above their parallel chunks.
  Tensor g = random_uniform({5, 9000}, f, 16, -5, 5), u = random_uniform({5, 9000}, f, 17);
  Tensor s = Tensor::poisoned({5, 9000}, f), dg = Tensor::poisoned({5, 9000}, f),
         du = Tensor::poisoned({5, 9000}, f), sum = Tensor::poisoned({5, 9000}, f);
  ops::swiglu_forward(g, u, s);
  ops::swiglu_backward(random_uniform({5, 9000}, f, 18), g, u, dg, du);
  ops::add(g, u, sum);
  res.insert(res.end(), {s, dg, du, sum});
  // Cross-entropy.
  Tensor logits = random_uniform({41, 50}, f, 19, -4, 4);
  Tensor targets = random_ints({41}, 20, 0, 50);
  targets.data<int32_t>()[7] = -100;
  Tensor losses = Tensor::poisoned({41}, f), lse_ce = Tensor::poisoned({41}, f),
         dlogits = Tensor::poisoned({41, 50}, f);
  ops::cross_entropy_forward(logits, targets, losses, lse_ce);
  ops::cross_entropy_backward(logits, targets, lse_ce, 0.1, dlogits);
  res.insert(res.end(), {losses, lse_ce, dlogits});
  return res;
}

TEST(Determinism, ResultsDoNotDependOnTheThreadCount) {
  set_num_threads(1);
  std::vector<Tensor> one = run_all_ops();
  set_num_threads(3);
  std::vector<Tensor> three = run_all_ops();
  set_num_threads(0);  // back to the default (OPD_NUM_THREADS or hardware concurrency)
  ASSERT_EQ(one.size(), three.size());
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_TRUE(close(one[i], one[i], 0, 0)) << "output " << i << " has NaN (unwritten?)";
    EXPECT_TRUE(same_bits(one[i], three[i])) << "output " << i;
  }
}

}  // namespace
}  // namespace opd::test
