// `opd bench attention [--json] [--fwd-only] [--iters N] [--warmup N]`: times the CUDA
// FlashAttention-2 kernels (Dao 2023; kernels/cuda/attention_*.cu) and, on Hopper, the
// FlashAttention-3-style wgmma forward (attention_fwd_wgmma.cu, each variant labeled
// fwd-wgmma<block_n><o|s|w|p> = synced overlap / synced serial / warp-specialized producer /
// producer + ping-pong; fwd-mma = the mma.sync kernel;
// fwd = what attention_forward
// picks by default) and the backward (bwd<q>/<k> = mma.sync dK/dV with q queries per step +
// mma.sync dQ with k keys per step; bwd-wgmma/<k> = the wgmma dK/dV kernel of
// attention_bwd_wgmma.cu + the same dQ kernel; bwd-wgmma-all = its wgmma dK/dV and dQ kernels,
// the default on sm_90a)
// on the BENCHMARKS.md attention shapes
// (causal, head_dim 128, bf16: 8 x 768 and 4 x 4096 tokens, 16 query heads, 8 and 16 kv heads)
// with CUDA events, median of N after warm-up. Reports TFLOP/s with causal FLOPs
// (forward 4 B H L^2 D / 2, backward 2.5x that, the convention SDPA numbers use) and the two
// floors: FLOPs at the measured 776 TFLOP/s bf16 GEMM rate and bytes at 4.15 TB/s.
// tools/bench_attention_torch.py times torch SDPA on the same shapes for the comparison.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "core/philox.h"
#include "core/tensor.h"
#ifdef OPD_WITH_CUDA
#include "core/cuda/stream.h"        // Event, device_description
#include "kernels/cuda/attention_wgmma.h"  // the wgmma forward, the kernel selection
#include "kernels/cuda/cuda_ops.h"   // AttentionPlan, attention_forward / attention_backward
#endif

namespace opd::cli {
namespace {

struct BenchAttentionOptions {
  bool json = false;
  bool fwd_only = false;
  int iters = 30;
  int warmup = 5;
};

struct Shape4 {
  int64_t batch, len, hq, hkv, d;
};

constexpr double kGemmTflops = 776.0;  // BENCHMARKS.md: measured bf16 GEMM ceiling of the H200
constexpr double kCopyTBs = 4.15;      // BENCHMARKS.md: measured device copy rate (read + write)

#ifdef OPD_WITH_CUDA
// Uniform [-1, 1) bf16 values on the device (seeded Philox, generated on the host).
Tensor random_bf16_device(const opd::Shape& shape, uint64_t seed) {
  Tensor host = Tensor::empty(shape, DType::F32);
  float* p = host.data<float>();
  for (int64_t i = 0; i < host.numel(); ++i) {
    p[i] = 2.f * philox_uniform(seed, 0, static_cast<uint64_t>(i)) - 1.f;
  }
  return host.to_dtype(DType::BF16).to(Device::CUDA);
}

template <typename F>
double median_ms(int warmup, int iters, F&& run) {
  for (int i = 0; i < warmup; ++i) run();
  std::vector<double> ms;
  cuda::Event start, stop;
  for (int i = 0; i < iters; ++i) {
    start.record(nullptr);
    run();
    stop.record(nullptr);
    ms.push_back(stop.elapsed_ms_since(start));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void run_bench_attention(const BenchAttentionOptions& o) {
  OPD_CHECK(cuda::device_count() > 0, Unsupported, "opd bench attention needs a CUDA device");
  OPD_CHECK(o.iters >= 1 && o.warmup >= 0, InvalidArgument, "--iters must be >= 1");
  const std::vector<Shape4> shapes = {
      {8, 768, 16, 8, 128}, {8, 768, 16, 16, 128}, {4, 4096, 16, 8, 128}, {4, 4096, 16, 16, 128}};
  const std::vector<cuda::AttentionBwdTiles> variants = {{64, 64}, {64, 32}, {32, 64}, {32, 32}};
  const std::vector<cuda::AttentionWgmmaConfig> wg_variants = {
      {128, true},
      {128, false},
      {64, true},
      {64, false},
      {64, true, cuda::AttentionWgmmaSchedule::Producer},
      {128, true, cuda::AttentionWgmmaSchedule::Producer},
      {64, true, cuda::AttentionWgmmaSchedule::PingPong},
      {128, true, cuda::AttentionWgmmaSchedule::PingPong}};
  const bool wgmma = cuda::attention_wgmma_available();
  const char* fwd_default =
      cuda::attention_fwd_kernel_name(cuda::resolve_attention_fwd_kernel(DType::BF16, 128));
  nlohmann::json results = nlohmann::json::array();
  const std::string device = cuda::device_description(0);
  if (!o.json) {
    std::printf("opd bench attention: %s, causal bf16, median of %d after %d warm-up; fwd = %s "
                "kernel (OPD_ATTENTION_FWD / default), wgmma %s\n",
                device.c_str(), o.iters, o.warmup, fwd_default,
                wgmma ? "available" : "not available (no sm_90a)");
    std::printf("%-22s %14s %9s %9s %8s %10s %10s\n", "shape B x L, Hq/Hkv", "pass", "ms",
                "TFLOP/s", "of 776", "floor ms", "bytes floor");
  }
  for (const Shape4& s : shapes) {
    const int64_t n = s.batch * s.len;
    std::vector<int32_t> cu(static_cast<size_t>(s.batch + 1));
    for (int64_t b = 0; b <= s.batch; ++b) cu[b] = static_cast<int32_t>(b * s.len);
    cuda::AttentionPlan plan(cu.data(), s.batch, n, nullptr);  // built once, as the model does
    Tensor q = random_bf16_device({n, s.hq, s.d}, 1), k = random_bf16_device({n, s.hkv, s.d}, 2);
    Tensor v = random_bf16_device({n, s.hkv, s.d}, 3), dout = random_bf16_device({n, s.hq, s.d}, 4);
    Tensor out = Tensor::empty({n, s.hq, s.d}, DType::BF16, Device::CUDA);
    Tensor lse = Tensor::empty({n, s.hq}, DType::F32, Device::CUDA);
    Tensor dq = Tensor::empty({n, s.hq, s.d}, DType::BF16, Device::CUDA);
    Tensor dk = Tensor::empty({n, s.hkv, s.d}, DType::BF16, Device::CUDA);
    Tensor dv = Tensor::empty({n, s.hkv, s.d}, DType::BF16, Device::CUDA);
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.d));

    const double fwd_flop = 4.0 * s.batch * s.hq * double(s.len) * s.len * s.d / 2;
    const double bwd_flop = 2.5 * fwd_flop;
    const double q_bytes = double(n) * s.hq * s.d * 2, kv_bytes = double(n) * s.hkv * s.d * 2;
    const double lse_bytes = double(n) * s.hq * 4;
    const double fwd_bytes = 2 * q_bytes + 2 * kv_bytes + lse_bytes;  // q, k, v in; out, lse out
    // dout, q, out, k, v, lse in; dq, dk, dv out (D = rowsum(dout*out) scratch not counted).
    const double bwd_bytes = 4 * q_bytes + 4 * kv_bytes + lse_bytes;

    auto fwd = [&] {
      cuda::attention_forward(plan, q.raw(), k.raw(), v.raw(), s.hq, s.hkv, s.d, scale,
                              DType::BF16, out.raw(), lse.data<float>(), nullptr);
    };
    const double fwd_ms = median_ms(o.warmup, o.iters, fwd);
    struct Row {
      std::string pass;
      double ms;
    };
    std::vector<Row> rows = {{"fwd", fwd_ms}};
    {  // the mma.sync forward, forced (restores the process setting after)
      const cuda::AttentionFwdKernel saved = cuda::attention_fwd_kernel_setting();
      cuda::set_attention_fwd_kernel(cuda::AttentionFwdKernel::Mma);
      rows.push_back({"fwd-mma", median_ms(o.warmup, o.iters, fwd)});
      cuda::set_attention_fwd_kernel(saved);
    }
    double best_wg = 1e30;
    std::string best_wg_name;
    if (wgmma) {
      for (const auto& wv : wg_variants) {
        auto run = [&] {
          cuda::attention_forward_wgmma(plan, q.raw(), k.raw(), v.raw(), s.hq, s.hkv, scale,
                                        /*causal=*/true, out.raw(), lse.data<float>(), nullptr, wv);
        };
        // A variant that cannot run here (e.g. a launch refused for resources) is reported and
        // skipped instead of ending the bench: the other rows stay measurable.
        double ms = 0;
        try {
          ms = median_ms(o.warmup, o.iters, run);
        } catch (const Error& e) {
          std::fprintf(stderr, "opd bench attention: wgmma variant block_n %d skipped: %s\n",
                       wv.block_n, e.what());
          continue;
        }
        const char* kind = wv.schedule == cuda::AttentionWgmmaSchedule::PingPong   ? "p"
                           : wv.schedule == cuda::AttentionWgmmaSchedule::Producer ? "w"
                           : wv.overlap                                             ? "o"
                                                                                    : "s";
        const std::string name = cat("fwd-wgmma", wv.block_n, kind);
        rows.push_back({name, ms});
        if (ms < best_wg) best_wg = ms, best_wg_name = name;
      }
    }
    double best_bwd = 1e30, best_wg_bwd = 1e30;
    std::string best_name, best_wg_bwd_name;
    // Each row forces its dK/dV kernel (the process setting, OPD_ATTENTION_BWD, is restored).
    const cuda::AttentionBwdKernel saved_bwd = cuda::attention_bwd_kernel_setting();
    for (const auto& t : variants) {
      if (o.fwd_only) break;
      auto bwd = [&] {
        cuda::attention_backward(plan, dout.raw(), q.raw(), k.raw(), v.raw(), out.raw(),
                                 lse.data<float>(), s.hq, s.hkv, s.d, scale, DType::BF16,
                                 dq.raw(), dk.raw(), dv.raw(), nullptr, t);
      };
      cuda::set_attention_bwd_kernel(cuda::AttentionBwdKernel::Mma);
      const double ms = median_ms(o.warmup, o.iters, bwd);
      const std::string name = cat("bwd", t.dkdv_queries, "/", t.dq_keys);
      rows.push_back({name, ms});
      if (ms < best_bwd) best_bwd = ms, best_name = name;
      // The wgmma dK/dV kernel has one query step (64): one row per dQ key step.
      if (wgmma && t.dkdv_queries == 64) {
        cuda::set_attention_bwd_kernel(cuda::AttentionBwdKernel::Wgmma);
        double wms = 0;
        try {
          wms = median_ms(o.warmup, o.iters, bwd);
        } catch (const Error& e) {
          std::fprintf(stderr, "opd bench attention: wgmma backward skipped: %s\n", e.what());
          cuda::set_attention_bwd_kernel(saved_bwd);
          continue;
        }
        const std::string wname = cat("bwd-wgmma/", t.dq_keys);
        rows.push_back({wname, wms});
        if (wms < best_wg_bwd) best_wg_bwd = wms, best_wg_bwd_name = wname;
      }
      cuda::set_attention_bwd_kernel(saved_bwd);
    }
    if (wgmma && !o.fwd_only) {  // both wgmma kernels (their step sizes are fixed)
      auto bwd = [&] {
        cuda::attention_backward(plan, dout.raw(), q.raw(), k.raw(), v.raw(), out.raw(),
                                 lse.data<float>(), s.hq, s.hkv, s.d, scale, DType::BF16,
                                 dq.raw(), dk.raw(), dv.raw(), nullptr);
      };
      const std::pair<cuda::AttentionBwdKernel, const char*> variants[] = {
          {cuda::AttentionBwdKernel::WgmmaAll, "bwd-wgmma-all"}};
      for (const auto& [kernel, name] : variants) {
        cuda::set_attention_bwd_kernel(kernel);
        try {
          const double wms = median_ms(o.warmup, o.iters, bwd);
          rows.push_back({name, wms});
          if (wms < best_wg_bwd) best_wg_bwd = wms, best_wg_bwd_name = name;
        } catch (const Error& e) {
          std::fprintf(stderr, "opd bench attention: %s backward skipped: %s\n", name, e.what());
        }
      }
      cuda::set_attention_bwd_kernel(saved_bwd);
    }
    const std::string label = cat(s.batch, " x ", s.len, ", ", s.hq, "/", s.hkv);
    nlohmann::json j;
    j["batch"] = s.batch;
    j["seqlen"] = s.len;
    j["hq"] = s.hq;
    j["hkv"] = s.hkv;
    j["head_dim"] = s.d;
    j["fwd_flop"] = fwd_flop;
    j["bwd_flop"] = bwd_flop;
    j["fwd_bytes"] = fwd_bytes;
    j["bwd_bytes"] = bwd_bytes;
    for (const Row& r : rows) {
      const bool is_fwd = r.pass.rfind("fwd", 0) == 0;
      const double flop = is_fwd ? fwd_flop : bwd_flop, bytes = is_fwd ? fwd_bytes : bwd_bytes;
      const double tflops = flop / (r.ms * 1e-3) / 1e12;
      const double floor_ms = flop / (kGemmTflops * 1e12) * 1e3;
      const double bytes_ms = bytes / (kCopyTBs * 1e12) * 1e3;
      j[r.pass] = {{"ms", r.ms}, {"tflops", tflops}};
      if (!o.json) {
        std::printf("%-22s %14s %9.4f %9.1f %7.1f%% %10.4f %10.4f\n", label.c_str(),
                    r.pass.c_str(), r.ms, tflops, 100 * tflops / kGemmTflops, floor_ms, bytes_ms);
      }
    }
    j["fwd_kernel"] = fwd_default;
    if (!best_wg_name.empty()) {
      j["fwd_wgmma_best"] = {{"variant", best_wg_name}, {"ms", best_wg},
                             {"tflops", fwd_flop / (best_wg * 1e-3) / 1e12}};
    }
    if (!o.fwd_only) {
      j["bwd_best"] = {{"variant", best_name}, {"ms", best_bwd},
                       {"tflops", bwd_flop / (best_bwd * 1e-3) / 1e12}};
    }
    if (!best_wg_bwd_name.empty()) {
      j["bwd_wgmma_best"] = {{"variant", best_wg_bwd_name}, {"ms", best_wg_bwd},
                             {"tflops", bwd_flop / (best_wg_bwd * 1e-3) / 1e12}};
    }
    results.push_back(j);
  }
  if (o.json) {
    nlohmann::json top;
    top["bench"] = "attention";
    top["device"] = device;
    top["iters"] = o.iters;
    top["results"] = results;
    std::printf("%s\n", top.dump().c_str());
  } else {
    std::printf("summary (TFLOP/s; fwd = default kernel, wgmma = best wgmma variant, bwd = best "
                "mma.sync tile variant, bwd-wgmma = best with the wgmma dK/dV kernel, alone or with the "
                "wgmma dQ kernel):\n");
    for (const auto& j : results) {
      std::printf("  B %lld L %lld Hq %lld Hkv %lld: fwd %.1f (%s)  mma %.1f", static_cast<long long>(j["batch"]),
                  static_cast<long long>(j["seqlen"]), static_cast<long long>(j["hq"]),
                  static_cast<long long>(j["hkv"]), j["fwd"]["tflops"].get<double>(),
                  j["fwd_kernel"].get<std::string>().c_str(), j["fwd-mma"]["tflops"].get<double>());
      if (j.contains("fwd_wgmma_best")) {
        std::printf("  wgmma %.1f (%s)", j["fwd_wgmma_best"]["tflops"].get<double>(),
                    j["fwd_wgmma_best"]["variant"].get<std::string>().c_str());
      }
      if (j.contains("bwd_best")) {
        std::printf("  bwd %.1f (%s)", j["bwd_best"]["tflops"].get<double>(),
                    j["bwd_best"]["variant"].get<std::string>().c_str());
      }
      if (j.contains("bwd_wgmma_best")) {
        std::printf("  bwd-wgmma %.1f (%s)", j["bwd_wgmma_best"]["tflops"].get<double>(),
                    j["bwd_wgmma_best"]["variant"].get<std::string>().c_str());
      }
      std::printf("\n");
    }
  }
}
#endif

}  // namespace

void register_bench_attention(CLI::App& app) {
  CLI::App* bench = &bench_command(app);
  auto opts = std::make_shared<BenchAttentionOptions>();
  CLI::App* cmd = bench->add_subcommand(
      "attention",
      "CUDA causal GQA attention forward/backward TFLOP/s (FlashAttention-2 kernels; on Hopper "
      "also every wgmma forward variant and the wgmma backward kernels, labeled)");
  cmd->add_flag("--json", opts->json, "print one JSON object (default off)");
  cmd->add_flag("--fwd-only", opts->fwd_only, "time the forward kernels only (default off)");
  cmd->add_option("--iters", opts->iters, "timed repetitions (median reported; default 30)");
  cmd->add_option("--warmup", opts->warmup, "untimed repetitions first (default 5)");
  cmd->callback([opts] {
#ifdef OPD_WITH_CUDA
    run_bench_attention(*opts);
#else
    OPD_FAIL(Unsupported, "opd bench attention: this build has no CUDA backend");
#endif
  });
}

}  // namespace opd::cli
