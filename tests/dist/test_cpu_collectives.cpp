// The CPU communicator (dist/communicator.h) against a serial reference, 1..4 processes, f32 and
// bf16, sum and avg, odd sizes: all_reduce, reduce_scatter, all_gather (also in place) and
// broadcast. Inputs are seeded per rank, so every child can build the reference of all ranks;
// the backend sums in rank order in f32, as the reference does, so results match bitwise.
// Outputs start NaN-poisoned. Argument errors name the call.
#include <gtest/gtest.h>

#include <cstring>

#include "common/test_util.h"
#include "core/dtype.h"
#include "dist/communicator.h"
#include "dist_test_util.h"

namespace opd::dist {
namespace {

using test::expect;

// Rank r's input, representable in dt (bf16 inputs are rounded first).
Tensor input_of(int rank, int64_t n, DType dt, uint64_t salt) {
  Tensor f = test::random_uniform({n}, DType::F32, 1000 + 17 * rank + salt, -3, 3);
  return dt == DType::F32 ? f : f.to_dtype(DType::BF16);
}

float value(const Tensor& t, int64_t i) { return static_cast<float>(test::element(t, i)); }

// Bitwise equality of out with the f32 values ref (rounded to out's dtype).
std::string same(const Tensor& out, const std::vector<float>& ref, const std::string& what) {
  Tensor r = Tensor::from_vector(ref, {static_cast<int64_t>(ref.size())});
  if (out.dtype() == DType::BF16) r = r.to_dtype(DType::BF16);
  if (out.numel() != r.numel()) return what + ": size mismatch; ";
  if (std::memcmp(out.raw(), r.raw(), out.nbytes()) != 0) {
    for (int64_t i = 0; i < out.numel(); ++i)
      if (std::memcmp(static_cast<char*>(out.raw()) + i * dtype_size(out.dtype()),
                      static_cast<char*>(r.raw()) + i * dtype_size(out.dtype()),
                      dtype_size(out.dtype())) != 0)
        return cat(what, ": element ", i, " is ", value(out, i), ", reference ", value(r, i), "; ");
  }
  return "";
}

std::vector<float> reference_reduce(int world, int64_t n, DType dt, uint64_t salt, ReduceOp op) {
  std::vector<float> acc(n);
  for (int r = 0; r < world; ++r) {
    Tensor in = input_of(r, n, dt, salt);
    for (int64_t i = 0; i < n; ++i) acc[i] = r == 0 ? value(in, i) : acc[i] + value(in, i);
  }
  if (op == ReduceOp::Avg)
    for (float& a : acc) a = a / static_cast<float>(world);
  return acc;
}

TEST(CpuCollectives, MatchSerialReference) {
  for (int world = 1; world <= 4; ++world) {
    const int port = pick_free_port();
    auto out = test::run_ranks(world, [&](int rank) {
      auto comm = make_cpu_communicator(Store::connect(test::local_env(rank, world, port), 60));
      std::string err;
      for (DType dt : {DType::F32, DType::BF16}) {
        for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{1000}}) {
          for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
            const std::string tag = cat(dtype_name(dt), " n=", n, " ", reduce_op_name(op));
            // all_reduce, in place.
            Tensor t = input_of(rank, n, dt, 1);
            comm->all_reduce(t, op);
            err += same(t, reference_reduce(world, n, dt, 1, op), "all_reduce " + tag);
            // reduce_scatter: world*n in, this rank's n-block out.
            Tensor in = input_of(rank, n * world, dt, 2);
            Tensor rs = Tensor::poisoned({n}, dt);
            comm->reduce_scatter(in, rs, op);
            auto full = reference_reduce(world, n * world, dt, 2, op);
            err += same(rs, std::vector<float>(full.begin() + rank * n, full.begin() + (rank + 1) * n),
                        "reduce_scatter " + tag);
          }
          // all_gather out of place and in place.
          Tensor g_in = input_of(rank, n, dt, 3);
          Tensor g = Tensor::poisoned({n * world}, dt);
          comm->all_gather(g_in, g);
          std::vector<float> ref;
          for (int r = 0; r < world; ++r) {
            Tensor x = input_of(r, n, dt, 3);
            for (int64_t i = 0; i < n; ++i) ref.push_back(value(x, i));
          }
          err += same(g, ref, cat("all_gather ", dtype_name(dt), " n=", n));
          Tensor g2 = Tensor::poisoned({n * world}, dt);
          Tensor mine = g2.slice_rows(rank * n, (rank + 1) * n);
          mine.copy_from(g_in);
          comm->all_gather(mine, g2);
          err += same(g2, ref, cat("all_gather in place ", dtype_name(dt), " n=", n));
          // broadcast from the last rank.
          Tensor b = rank == world - 1 ? input_of(rank, n, dt, 4) : Tensor::poisoned({n}, dt);
          comm->broadcast(b, world - 1);
          Tensor src = input_of(world - 1, n, dt, 4);
          std::vector<float> bref;
          for (int64_t i = 0; i < n; ++i) bref.push_back(value(src, i));
          err += same(b, bref, cat("broadcast ", dtype_name(dt), " n=", n));
        }
      }
      comm->synchronize();
      return err;
    });
    EXPECT_TRUE(test::all_ok(out)) << "world " << world;
  }
}

TEST(CpuCollectives, ArgumentErrorsNameTheCall) {
  const int port = pick_free_port();
  auto out = test::run_ranks(2, [&](int rank) {
    auto comm = make_cpu_communicator(Store::connect(test::local_env(rank, 2, port), 30));
    auto msg = [](const std::function<void()>& fn) -> std::string {
      try {
        fn();
      } catch (const Error& e) {
        return e.what();
      }
      return "(no error)";
    };
    Tensor a = Tensor::zeros({4}, DType::F32);
    Tensor b3 = Tensor::zeros({3}, DType::F32);
    Tensor i32 = Tensor::zeros({4}, DType::I32);
    Tensor bf = Tensor::zeros({2}, DType::BF16);
    std::string err;
    std::string m1 = msg([&] { comm->reduce_scatter(a, b3, ReduceOp::Sum); });
    err += expect(m1.find("reduce_scatter: in f32[4] cpu must hold world_size (2) x out") !=
                      std::string::npos, m1);
    std::string m2 = msg([&] { comm->all_gather(a, b3); });
    err += expect(m2.find("all_gather: out") != std::string::npos, m2);
    std::string m3 = msg([&] { comm->all_reduce(i32, ReduceOp::Sum); });
    err += expect(m3.find("must be f32 or bf16") != std::string::npos, m3);
    std::string m4 = msg([&] { comm->all_gather(bf, a); });  // dtype mismatch
    err += expect(m4.find("elements of one dtype") != std::string::npos, m4);
    std::string m5 = msg([&] { comm->broadcast(a, 2); });
    err += expect(m5.find("root 2 is outside [0, 2)") != std::string::npos, m5);
    // Nothing was exchanged by the refused calls: the ranks are still in step.
    comm->all_reduce(a, ReduceOp::Sum);
    return err;
  });
  EXPECT_TRUE(test::all_ok(out));
}

TEST(CpuCollectives, SizeMismatchBetweenRanksIsAnError) {
  const int port = pick_free_port();
  auto out = test::run_ranks(2, [&](int rank) {
    auto comm = make_cpu_communicator(Store::connect(test::local_env(rank, 2, port), 30));
    Tensor t = Tensor::zeros({rank == 0 ? 4 : 5}, DType::F32);
    try {
      comm->all_reduce(t, ReduceOp::Sum);
    } catch (const Error& e) {
      std::string m = e.what();
      return expect(m.find("collective mismatch") != std::string::npos &&
                        m.find("all_reduce f32[4] sum") != std::string::npos &&
                        m.find("all_reduce f32[5] sum") != std::string::npos,
                    m);
    }
    return std::string("no error");
  });
  EXPECT_TRUE(test::all_ok(out));
}

TEST(NcclCommunicator, UnavailableIsAClearError) {
  std::string why;
  if (nccl_available(&why)) GTEST_SKIP() << "NCCL and a GPU are available here";
  EXPECT_FALSE(why.empty());
  StoreServer server(0, 1);
  auto store = std::make_shared<Store>("127.0.0.1", server.port(), 0, 1, 5);
  try {
    make_nccl_communicator(store, 0, 5);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_TRUE(e.kind() == ErrorKind::Unsupported || e.kind() == ErrorKind::Cuda) << e.what();
  }
}

}  // namespace
}  // namespace opd::dist
