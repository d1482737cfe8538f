// `opd bench dist`: the collectives of data-parallel training, timed on the job's ranks (run it
// under `opd launch --nproc-per-node N`): all_reduce, reduce_scatter and all_gather of bf16 and
// f32 buffers at the sizes a W2 step moves (Qwen3-0.6B: 0.60e9 parameters = 1.2 GB bf16 model
// all-gather, 2.4 GB f32 gradient reduce-scatter), and one ZeRO-1 step (reduce-scatter + AdamW on
// the shard + all-gather) on --params-m million parameters. Times are the median over --iters
// after --warmup, synchronized on every rank; bandwidth as nccl-tests defines it:
// algbw = bytes / time, busbw = algbw x 2(n-1)/n (all_reduce) or (n-1)/n (reduce_scatter,
// all_gather), bytes = the full (world-sized) buffer. Rank 0 prints a table (or JSON lines).
// Backend nccl (device buffers) or cpu (host buffers over the TCP store; for a dry run here).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "core/tensor.h"
#include "dist/communicator.h"
#include "dist/rendezvous.h"
#include "dist/zero.h"

namespace opd::cli {
namespace {

struct BenchDistOptions {
  std::string backend = "nccl";
  std::vector<double> mib{64, 1144, 2288};  // 1144 MiB = 0.6e9 bf16, 2288 MiB = 0.6e9 f32
  double params_m = 600;
  int warmup = 3;
  int iters = 10;
  bool json = false;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void run_bench_dist(const BenchDistOptions& o) {
  OPD_CHECK(o.backend == "nccl" || o.backend == "cpu", InvalidArgument,
            "--backend must be nccl or cpu, got '", o.backend, "'");
  OPD_CHECK(o.iters >= 1 && o.warmup >= 0, InvalidArgument, "--iters must be >= 1, --warmup >= 0");
  const dist::DistEnv env = dist::dist_env_from_process();
  const double timeout = dist::dist_timeout_seconds(
      [](const char* n) { return static_cast<const char*>(std::getenv(n)); });
  auto store = dist::Store::connect(env, timeout);
  std::unique_ptr<dist::Communicator> comm;
  Device dev = Device::CPU;
  if (o.backend == "nccl") {
    comm = dist::make_nccl_communicator(store, env.local_rank, timeout);
    dev = Device::CUDA;
  } else {
    comm = dist::make_cpu_communicator(store);
  }
  const int W = comm->world_size();
  auto timed = [&](const std::function<void()>& fn) {
    std::vector<double> ms;
    for (int i = 0; i < o.warmup + o.iters; ++i) {
      comm->synchronize();
      store->barrier("bench");
      auto t0 = std::chrono::steady_clock::now();
      fn();
      comm->synchronize();
      double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      // The slowest rank's time is the collective's time.
      t = store->all_reduce({t}, dist::HostReduce::Max, "bench time")[0];
      if (i >= o.warmup) ms.push_back(t);
    }
    return median(ms);
  };
  auto report = [&](const std::string& op, DType dt, double bytes, double ms, double factor) {
    if (env.rank != 0) return;
    const double algbw = bytes / (ms * 1e-3) / 1e9;
    nlohmann::json j{{"bench", "dist"}, {"backend", o.backend}, {"world", W}, {"op", op},
                     {"dtype", std::string(dtype_name(dt))}, {"bytes", bytes}, {"ms", ms},
                     {"algbw_GBps", algbw}, {"busbw_GBps", algbw * factor}};
    if (o.json) std::printf("%s\n", j.dump().c_str());
    else
      std::printf("%-15s %-5s %10.1f MiB %10.3f ms  algbw %8.1f GB/s  busbw %8.1f GB/s\n",
                  op.c_str(), std::string(dtype_name(dt)).c_str(), bytes / (1 << 20), ms, algbw,
                  algbw * factor);
    std::fflush(stdout);
  };
  if (env.rank == 0 && !o.json)
    std::printf("opd bench dist: %s, %d ranks, median of %d after %d warm-up\n", o.backend.c_str(), W,
                o.iters, o.warmup);
  for (double mib : o.mib) {
    for (DType dt : {DType::BF16, DType::F32}) {
      const int64_t n = static_cast<int64_t>(mib * (1 << 20)) / dtype_size(dt) / W * W;
      OPD_CHECK(n >= W, InvalidArgument, "--mib ", mib, " is too small");
      Tensor buf = Tensor::zeros({n}, dt, dev);
      Tensor shard = Tensor::zeros({n / W}, dt, dev);
      const double bytes = static_cast<double>(n) * dtype_size(dt);
      report("all_reduce", dt, bytes, timed([&] { comm->all_reduce(buf, dist::ReduceOp::Sum); }),
             2.0 * (W - 1) / W);
      report("reduce_scatter", dt, bytes,
             timed([&] { comm->reduce_scatter(buf, shard, dist::ReduceOp::Sum); }), 1.0 * (W - 1) / W);
      report("all_gather", dt, bytes, timed([&] { comm->all_gather(shard, buf); }), 1.0 * (W - 1) / W);
    }
  }
  if (o.params_m > 0) {
    // Tensors of 4M elements, like the larger matrices of a 0.6B model.
    const int64_t total = static_cast<int64_t>(o.params_m * 1e6);
    std::vector<Shape> shapes;
    for (int64_t left = total; left > 0; left -= 4 << 20) shapes.push_back({std::min<int64_t>(left, 4 << 20)});
    dist::ZeroConfig zc;
    dist::ZeroOptimizer zo(*comm, shapes, zc);
    const double ms = timed([&] { zo.step(1e-5, 1.0); });
    if (env.rank == 0) {
      nlohmann::json j{{"bench", "dist"}, {"backend", o.backend}, {"world", W}, {"op", "zero1_step"},
                       {"params", total}, {"ms", ms}};
      if (o.json) std::printf("%s\n", j.dump().c_str());
      else std::printf("zero1 step      %.0fM params (reduce-scatter f32 grads, clip, AdamW on 1/%d, all-gather bf16): %.3f ms\n",
                       o.params_m, W, ms);
    }
  }
  store->barrier("bench done");
}

}  // namespace

void register_bench_dist(CLI::App& bench) {
  auto o = std::make_shared<BenchDistOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "dist", "Collective bandwidth and one ZeRO-1 step on the job's ranks (run under opd launch)");
  cmd->add_option("--backend", o->backend, "nccl | cpu")->capture_default_str();
  cmd->add_option("--mib", o->mib, "buffer sizes in MiB (full buffer per collective)")
      ->capture_default_str();
  cmd->add_option("--params-m", o->params_m,
                  "millions of parameters for the ZeRO-1 step (0: skip it)")->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "untimed iterations")->capture_default_str();
  cmd->add_option("--iters", o->iters, "timed iterations (median reported)")->capture_default_str();
  cmd->add_flag("--json", o->json, "print only JSON lines");
  cmd->callback([o] { run_bench_dist(*o); });
}

}  // namespace opd::cli
