// CUDA SwiGLU and the elementwise add against the CPU reference: sizes that hit the vector
// and scalar paths, extreme gate values (sigmoid saturation), misaligned views, in-place use.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

class CudaElementwise : public ::testing::TestWithParam<int64_t> {};

TEST_P(CudaElementwise, SwigluMatchesCpu) {
  REQUIRE_GPU();
  const int64_t n = GetParam();
  for (DType dt : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_label(dt));
    Tensor g = rand_in({n}, dt, 1, -8, 8), u = rand_in({n}, dt, 2), dout = rand_in({n}, dt, 3);
    if (n > 2) {  // saturated sigmoid on both sides
      g.data<float>()[0] = 90.0f;
      g.data<float>()[1] = -90.0f;
    }
    Tensor out_ref = Tensor::poisoned({n}, DType::F32);
    ops::swiglu_forward(g, u, out_ref);
    Tensor dg_ref = Tensor::poisoned({n}, DType::F32), du_ref = Tensor::poisoned({n}, DType::F32);
    ops::swiglu_backward(dout, g, u, dg_ref, du_ref);

    Tensor gd = dev(g, dt), ud = dev(u, dt);
    Tensor outd = dev_poison({n}, dt);
    ops::swiglu_forward(gd, ud, outd);
    Tensor dgd = dev_poison({n}, dt), dud = dev_poison({n}, dt);
    ops::swiglu_backward(dev(dout, dt), gd, ud, dgd, dud);
    EXPECT_TRUE(close_as(host(outd), out_ref, dt)) << "out";
    EXPECT_TRUE(close_as(host(dgd), dg_ref, dt)) << "dgate";
    EXPECT_TRUE(close_as(host(dud), du_ref, dt)) << "dup";
  }
}

TEST_P(CudaElementwise, AddAndAddInplaceMatchCpu) {
  REQUIRE_GPU();
  const int64_t n = GetParam();
  for (DType dt : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_label(dt));
    Tensor a = rand_in({n}, dt, 4), b = rand_in({n}, dt, 5);
    Tensor ref = Tensor::poisoned({n}, DType::F32);
    ops::add(a, b, ref);
    Tensor outd = dev_poison({n}, dt);
    ops::add(dev(a, dt), dev(b, dt), outd);
    // One rounding of an exact f32 sum: bit-identical to rounding the CPU's f32 sum.
    EXPECT_TRUE(same_bits(host(outd), round_through(ref, dt)));
    Tensor acc = dev(a, dt);
    ops::add_inplace(acc, dev(b, dt));
    EXPECT_TRUE(same_bits(host(acc), round_through(ref, dt)));
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, CudaElementwise,
                         ::testing::Values(0, 1, 7, 255, 257, 1000, 4096, 6144 * 3072 + 3),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

TEST(CudaElementwiseViews, MisalignedViewsTakeTheScalarPath) {
  REQUIRE_GPU();
  const int64_t rows = 9, cols = 13;  // row views at 13 * 2 bytes: not 16-byte aligned
  Tensor g = rand_in({rows, cols}, DType::BF16, 6), u = rand_in({rows, cols}, DType::BF16, 7);
  Tensor ref = Tensor::poisoned({rows - 1, cols}, DType::F32);
  ops::swiglu_forward(g.slice_rows(1, rows), u.slice_rows(1, rows), ref);
  Tensor outd = dev_poison({rows, cols}, DType::BF16);
  Tensor o = outd.slice_rows(1, rows);
  ops::swiglu_forward(dev(g, DType::BF16).slice_rows(1, rows), dev(u, DType::BF16).slice_rows(1, rows), o);
  EXPECT_TRUE(close_as(host(o), ref, DType::BF16));
  EXPECT_TRUE(all_nan(host(outd.slice_rows(0, 1)))) << "row 0 untouched";
}

}  // namespace
}  // namespace opd::test
