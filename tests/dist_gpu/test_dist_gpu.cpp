// NCCL communicator (dist/communicator.h) on 2+ GPUs against the CPU communicator over the same
// store: all_reduce (sum/avg), reduce_scatter, all_gather (also in place) and broadcast on f32
// and bf16 device buffers, on the default and on a side stream; the watchdog turning a peer
// that never joins a collective into an error; and a ZeRO-1 step and overlapped ZeRO-2
// micro-batches on NCCL equal to the same on the CPU backend. Run under the launcher, one process per GPU:
//   opd launch --nproc-per-node 2 -- build/tests/test_dist_gpu
// Without the launcher, with fewer than 2 GPUs or without NCCL every test skips.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>

#include "common/test_util.h"
#include "core/cuda/allocator.h"
#include "core/cuda/stream.h"
#include "dist/communicator.h"
#include "dist/rendezvous.h"
#include "dist/bucket_ready.h"
#include "dist/zero.h"
#include "kernels/ops.h"  // add_inplace (the asynchronous gradient writes of the ZeRO-2 test)

namespace opd::dist {
namespace {

// One store and one NCCL + CPU communicator pair per process, shared by the tests (every rank
// runs the same tests in the same order, so their collectives line up).
struct Job {
  DistEnv env;
  std::shared_ptr<Store> store;
  std::unique_ptr<Communicator> nccl, cpu;
  std::string skip;
};

Job& job() {
  static Job j = [] {
    Job j;
    try {
      j.env = dist_env_from_process();
    } catch (const Error& e) {
      j.skip = e.what();
      return j;
    }
    const int gpus = cuda::device_count();
    std::string why;
    if (j.env.world_size < 2) j.skip = "not launched with 2+ ranks (opd launch --nproc-per-node 2 -- ...)";
    else if (gpus < j.env.local_world_size) j.skip = cat(gpus, " GPU(s) for ", j.env.local_world_size, " local ranks");
    else if (!nccl_available(&why)) j.skip = why;
    // Every rank sees the same conditions on one node, so they all skip or none does.
    if (!j.skip.empty()) return j;
    OPD_CUDA_CHECK(cudaSetDevice(j.env.local_rank));
    j.store = Store::connect(j.env, 120);
    j.nccl = make_nccl_communicator(j.store, j.env.local_rank, 120);
    j.cpu = make_cpu_communicator(j.store);
    return j;
  }();
  return j;
}

#define REQUIRE_JOB()                                   \
  do {                                                  \
    if (!job().skip.empty()) GTEST_SKIP() << job().skip; \
  } while (0)

Tensor input_of(int rank, int64_t n, DType dt, uint64_t salt) {
  Tensor f = test::random_uniform({n}, DType::F32, 500 + 31 * rank + salt, -2, 2);
  return dt == DType::F32 ? f : f.to_dtype(DType::BF16);
}
Tensor host_f32(const Tensor& t) {
  Tensor h = t.to(Device::CPU);
  return h.dtype() == DType::F32 ? h : h.to_dtype(DType::F32);
}
// Two-rank sums are exact in either order; bf16 outputs get one rounding of slack, avg and
// larger worlds a reordered f32 sum.
::testing::AssertionResult matches(const Tensor& gpu, const Tensor& cpu_ref, DType dt) {
  return dt == DType::F32 ? test::close(host_f32(gpu), host_f32(cpu_ref), 1e-5, 1e-6, 1e-6)
                          : test::close(host_f32(gpu), host_f32(cpu_ref), 8e-3, 1e-2, 6e-3);
}

const std::vector<int64_t> kSizes = {1, 1000, (int64_t{1} << 20) + 3};

TEST(NcclCollectives, AllReduceMatchesCpu) {
  REQUIRE_JOB();
  Job& j = job();
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t n : kSizes)
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
        Tensor ref = input_of(j.env.rank, n, dt, 1);
        Tensor dev = ref.to(Device::CUDA);
        j.nccl->all_reduce(dev, op);
        j.nccl->synchronize();
        j.cpu->all_reduce(ref, op);
        EXPECT_TRUE(matches(dev, ref, dt)) << dtype_name(dt) << " n=" << n << " " << reduce_op_name(op);
      }
}

TEST(NcclCollectives, ReduceScatterMatchesCpu) {
  REQUIRE_JOB();
  Job& j = job();
  const int W = j.env.world_size;
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t n : kSizes)
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
        Tensor in = input_of(j.env.rank, n * W, dt, 2);
        Tensor out = Tensor::poisoned({n}, dt).to(Device::CUDA);
        j.nccl->reduce_scatter(in.to(Device::CUDA), out, op);
        j.nccl->synchronize();
        Tensor ref = Tensor::poisoned({n}, dt);
        j.cpu->reduce_scatter(in, ref, op);
        EXPECT_TRUE(matches(out, ref, dt)) << dtype_name(dt) << " n=" << n << " " << reduce_op_name(op);
      }
}

TEST(NcclCollectives, AllGatherAndBroadcastAreExact) {
  REQUIRE_JOB();
  Job& j = job();
  const int W = j.env.world_size, R = j.env.rank;
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t n : kSizes) {
      Tensor in = input_of(R, n, dt, 3);
      Tensor out = Tensor::poisoned({n * W}, dt).to(Device::CUDA);
      j.nccl->all_gather(in.to(Device::CUDA), out);
      // In place: this rank's block of the output is the input.
      Tensor out2 = Tensor::poisoned({n * W}, dt).to(Device::CUDA);
      Tensor mine = out2.slice_rows(R * n, (R + 1) * n);
      mine.copy_from(in);
      j.nccl->all_gather(mine, out2);
      Tensor b = (R == W - 1 ? input_of(R, n, dt, 4) : Tensor::poisoned({n}, dt)).to(Device::CUDA);
      j.nccl->broadcast(b, W - 1);
      j.nccl->synchronize();
      Tensor ref = Tensor::poisoned({n * W}, dt);
      j.cpu->all_gather(in, ref);
      EXPECT_TRUE(test::close(host_f32(out), host_f32(ref), 0, 0)) << dtype_name(dt) << " n=" << n;
      EXPECT_TRUE(test::close(host_f32(out2), host_f32(ref), 0, 0)) << "in place " << n;
      EXPECT_TRUE(test::close(host_f32(b), host_f32(input_of(W - 1, n, dt, 4)), 0, 0)) << "bcast " << n;
    }
}

TEST(NcclCollectives, SideStream) {
  REQUIRE_JOB();
  Job& j = job();
  cuda::Stream side;
  Tensor ref = input_of(j.env.rank, 4099, DType::F32, 5);
  Tensor dev = ref.to(Device::CUDA);
  {
    cuda::StreamScope scope(side.get());
    j.nccl->all_reduce(dev, ReduceOp::Sum);
    j.nccl->synchronize();
  }
  j.cpu->all_reduce(ref, ReduceOp::Sum);
  EXPECT_TRUE(matches(dev, ref, DType::F32));
}

TEST(NcclCollectives, DeviceMismatchIsAnError) {
  REQUIRE_JOB();
  Tensor host = Tensor::zeros({4}, DType::F32);
  EXPECT_THROW(job().nccl->all_reduce(host, ReduceOp::Sum), Error);
}

TEST(NcclZero, Zero1StepMatchesCpuBackend) {
  REQUIRE_JOB();
  Job& j = job();
  const std::vector<Shape> shapes = {{1024, 67}, {4096}, {3, 5}, {77, 129}};
  ZeroConfig zc;
  zc.bucket_numel = 50000;
  ZeroOptimizer gpu(*j.nccl, shapes, zc);
  ZeroOptimizer cpu(*j.cpu, shapes, zc);
  std::vector<Tensor> w;
  for (size_t i = 0; i < shapes.size(); ++i) w.push_back(test::random_uniform(shapes[i], DType::F32, 90 + i));
  gpu.load_weights(w);
  cpu.load_weights(w);
  for (int step = 1; step <= 2; ++step) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      Tensor g = test::random_uniform(shapes[i], DType::F32, 1000 * step + 10 * j.env.rank + i, -0.1, 0.1);
      cpu.grad(i).copy_from(g);
      Tensor gd = gpu.grad(i);
      gd.copy_from(g);
    }
    StepReport a = gpu.step(1e-3, step == 2 ? 0.5 : 0);
    StepReport b = cpu.step(1e-3, step == 2 ? 0.5 : 0);
    EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-5 * b.grad_norm);
  }
  j.nccl->synchronize();
  auto sg = gpu.gather_state();
  auto sc = cpu.gather_state();
  for (size_t i = 0; i < shapes.size(); ++i) {
    EXPECT_TRUE(test::close(sg.master[i], sc.master[i], 1e-5, 1e-7)) << "master " << i;
    EXPECT_TRUE(test::close(host_f32(gpu.param(i)), host_f32(cpu.param(i)), 8e-3, 1e-6)) << "model " << i;
  }
}

// ZeRO-2 overlap on NCCL: the "backward" writes each parameter's gradient with an asynchronous
// kernel on a compute stream of its own and buckets are reduced (on the optimizer's
// communication stream) as soon as their parameters are done, in backward order, over three
// micro-batches; the result equals the CPU backend reducing everything after each micro-batch.
// A missing event in either direction (a reduction reading a gradient not yet written, or the
// next micro-batch accumulating into a bucket not yet cleared) shows up as a mismatch.
TEST(NcclZero, Zero2OverlappedBucketsMatchCpuBackend) {
  REQUIRE_JOB();
  Job& j = job();
  const std::vector<Shape> shapes = {{1024, 67}, {4096}, {3, 5}, {77, 129}, {20000}, {512, 33}};
  ZeroConfig zc;
  zc.stage = ZeroStage::Two;
  zc.bucket_numel = 50000;
  zc.model_dtype = DType::F32;
  ZeroOptimizer gpu(*j.nccl, shapes, zc);
  ZeroOptimizer cpu(*j.cpu, shapes, zc);
  std::vector<Tensor> w;
  for (size_t i = 0; i < shapes.size(); ++i) w.push_back(test::random_uniform(shapes[i], DType::F32, 190 + i));
  gpu.load_weights(w);
  cpu.load_weights(w);
  std::vector<int> group_of;  // one group per parameter, finished last to first
  for (size_t i = 0; i < shapes.size(); ++i) group_of.push_back(static_cast<int>(i));
  BucketReadiness ready(gpu.layout(), group_of, static_cast<int>(shapes.size()));
  ASSERT_GT(gpu.layout().buckets.size(), 2u);
  cuda::Stream compute;
  cuda::StreamScope on_compute(compute.get());
  for (int step = 1; step <= 2; ++step) {
    for (int m = 0; m < 3; ++m) {
      gpu.wait_reductions();  // the next write into the local gradients follows the reductions
      ready.reset();
      for (int i = static_cast<int>(shapes.size()) - 1; i >= 0; --i) {
        Tensor g = test::random_uniform(shapes[i], DType::F32, 7000 + 1000 * step + 100 * m + 10 * j.env.rank + i,
                                        -0.1, 0.1);
        cpu.grad(i).copy_from(g);
        Tensor gd = g.to(Device::CUDA);
        Tensor acc = gpu.grad(i);
        ops::add_inplace(acc, gd);  // asynchronous on the compute stream
        for (int b : ready.finish(i)) gpu.reduce_bucket(b);
      }
      for (int b : ready.remaining()) gpu.reduce_bucket(b);
      cpu.reduce_all();
    }
    gpu.step(1e-3, 0);
    cpu.step(1e-3, 0);
  }
  j.nccl->synchronize();
  auto sg = gpu.gather_state();
  auto sc = cpu.gather_state();
  for (size_t i = 0; i < shapes.size(); ++i) {
    EXPECT_TRUE(test::close(sg.master[i], sc.master[i], 1e-5, 1e-7)) << "master " << i;
    EXPECT_TRUE(test::close(sg.exp_avg[i], sc.exp_avg[i], 1e-5, 1e-9)) << "exp_avg " << i;
    EXPECT_TRUE(test::close(host_f32(gpu.param(i)), host_f32(cpu.param(i)), 1e-5, 1e-7)) << "model " << i;
  }
}

// Keep this last: it aborts a communicator of its own (the shared one stays healthy).
TEST(NcclWatchdog, MissingPeerBecomesAnError) {
  REQUIRE_JOB();
  Job& j = job();
  {
    auto comm = make_nccl_communicator(j.store, j.env.local_rank, 5.0);
    Tensor t = Tensor::zeros({1 << 20}, DType::F32, Device::CUDA);
    if (j.env.rank == 0) {
      // Rank 0 enters an all-reduce that no other rank joins. The error may surface in the call
      // itself (NCCL can block while enqueuing the first collective of a communicator: seen on
      // the H200 pair, 2026-11-30) or at the synchronize; either way within the timeout.
      try {
        comm->all_reduce(t, ReduceOp::Sum);
        comm->synchronize();
        ADD_FAILURE() << "no error from a collective nobody else joined";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::Cuda);
        EXPECT_NE(std::string(e.what()).find("did not finish within 5 s on rank 0"), std::string::npos) << e.what();
      }
      // Aborted for good: later calls fail at once.
      EXPECT_THROW(comm->all_reduce(t, ReduceOp::Sum), Error);
    }
    j.store->barrier("watchdog test done");
  }  // each rank's communicator is torn down (or was aborted) within the timeout
  j.store->barrier("watchdog teardown done");
}

}  // namespace
}  // namespace opd::dist
