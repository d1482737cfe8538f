// `opd bench loss`: the CUDA fused lm_head + distillation loss, forward + backward, at the W1
// shapes of BENCHMARKS.md (vocab 151,936, hidden 1,024, K = 64, topk+tail, beta 0.5, T 1, bf16;
// N = 8 x 512 = 4,096 and 8,192 completion rows) against the lm_head GEMMs alone in the same
// run (cuBLAS, same shapes and types: Z = H W^T, dH = dZ W, dW += dZ^T H, 3 x 2 N V H FLOP):
// median of >= 20 event-timed calls after warm-up, peak extra device memory (memory_stats), the
// ratio fused / GEMMs (goal <= 1.3), one JSON line per configuration. The dense PyTorch
// implementation on the same shapes is tools/bench_loss_torch.py (docs/loss.md, "CUDA").
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/bench_util.h"  // median
#include "cli/commands.h"
#include "core/error.h"
#include "core/tensor.h"
#include "loss/fused_loss.h"
#include "loss/loss_config.h"
#include "loss/teacher_payload.h"

#if defined(OPD_WITH_CUDA)
#include "core/cuda/stream.h"
#include "loss/fused_loss_cuda.h"
#endif

namespace opd::cli {
namespace {

struct BenchLossOptions {
  std::vector<int64_t> rows{4096, 8192};
  int64_t vocab = 151936;
  int64_t hidden = 1024;
  int64_t k = 64;
  std::string mode = "topk+tail";
  double beta = 0.5;
  double temperature = 1.0;
  int64_t vocab_tile = 4096;
  int64_t row_chunk = 0;
  std::string tile_dtype = "both";  // f32 | bf16 | both
  int warmup = 3;
  int iters = 20;
  bool json = false;
};

#if defined(OPD_WITH_CUDA)

// Deterministic bf16/f32/i32 host fills (xorshift; the 155M-element lm_head in about a second).
Tensor hashed(const Shape& shape, DType dt, uint64_t seed, double lo, double hi) {
  Tensor t = Tensor::empty(shape, dt);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < t.numel(); ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const double u = (x >> 11) * (1.0 / 9007199254740992.0);
    const float v = static_cast<float>(lo + (hi - lo) * u);
    if (dt == DType::BF16) reinterpret_cast<uint16_t*>(t.raw())[i] = float_to_bf16(v);
    else t.data<float>()[i] = v;
  }
  return t;
}

// Median ms of `iters` runs of fn (events on the legacy default stream, after `warmup` runs).
template <typename Fn>
double time_ms(int warmup, int iters, Fn&& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  OPD_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> ms;
  cuda::Event start, stop;
  for (int i = 0; i < iters; ++i) {
    start.record(nullptr);
    fn();
    stop.record(nullptr);
    ms.push_back(stop.elapsed_ms_since(start));
  }
  return median(ms);
}

void gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
          const void* a, cudaDataType_t at, int lda, const void* b, int ldb, float beta, void* c,
          cudaDataType_t ct, int ldc) {
  const float alpha = 1.f;
  OPD_CUBLAS_CHECK(cublasGemmEx(h, ta, tb, m, n, k, &alpha, a, at, lda, b, at, ldb, &beta, c, ct,
                                ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void run_bench_loss(const BenchLossOptions& o) {
  OPD_CHECK(cuda::device_count() > 0, Unsupported, "opd bench loss needs a CUDA device");
  OPD_CHECK(o.iters >= 1 && o.warmup >= 0, InvalidArgument, "bench loss: iters >= 1, warmup >= 0");
  OPD_CHECK(!o.rows.empty(), InvalidArgument, "bench loss: --rows is empty");
  const int64_t v = o.vocab, h = o.hidden, k = o.k;
  const int64_t n_max = *std::max_element(o.rows.begin(), o.rows.end());
  LossConfig cfg;
  cfg.mode = parse_support_mode(o.mode);
  cfg.beta = o.beta;
  cfg.temperature = o.temperature;
  cfg.vocab_tile = o.vocab_tile;
  check_loss_config(cfg);
  std::vector<DType> tile_dtypes;
  if (o.tile_dtype == "f32" || o.tile_dtype == "both") tile_dtypes.push_back(DType::F32);
  if (o.tile_dtype == "bf16" || o.tile_dtype == "both") tile_dtypes.push_back(DType::BF16);
  OPD_CHECK(!tile_dtypes.empty(), InvalidArgument, "bench loss: --tile-dtype must be f32, bf16 or both");
  OPD_CHECK(cfg.mode != SupportMode::Full, Unsupported,
            "bench loss: full mode needs a teacher lm_head; benchmark topk, topk+tail or sampled");

  const std::string device = cuda::device_description(0);
  if (!o.json) {
    std::printf("opd bench loss on %s\n", device.c_str());
    std::printf("vocab %lld, hidden %lld, K %lld, %s, beta %g, T %g, bf16 inputs, f32 grads, "
                "tile %lld\n", (long long)v, (long long)h, (long long)k, o.mode.c_str(), o.beta,
                o.temperature, (long long)o.vocab_tile);
  }

  // Inputs (W1-like: hidden ~ unit scale after the final norm, lm_head ~ N(0, 0.02) scale).
  Tensor hidden = hashed({n_max, h}, DType::BF16, 1, -1.7, 1.7).to(Device::CUDA);
  Tensor lm_head = hashed({v, h}, DType::BF16, 2, -0.0346, 0.0346).to(Device::CUDA);
  Tensor ids = Tensor::empty({n_max, k}, DType::I32);
  Tensor lp = Tensor::empty({n_max, k}, DType::F32);
  Tensor actual = Tensor::empty({n_max}, DType::F32);
  Tensor valid = Tensor::empty({n_max}, DType::I32);
  Tensor targets = Tensor::empty({n_max}, DType::I32);
  Tensor weights = Tensor::empty({n_max}, DType::F32);
  for (int64_t r = 0; r < n_max; ++r) {
    for (int64_t j = 0; j < k; ++j) {  // K distinct ids per row (j * 2371 < V for K <= 64)
      ids.data<int32_t>()[r * k + j] = static_cast<int32_t>((r * 7919 + j * 2371) % v);
      lp.data<float>()[r * k + j] = static_cast<float>(-3.0 - 0.06 * j - 0.001 * (r % 17));  // top-K mass ~0.84
    }
    actual.data<float>()[r] = -2.0f;
    valid.data<int32_t>()[r] = 1;
    targets.data<int32_t>()[r] = static_cast<int32_t>((r * 7919) % v);  // = the first teacher id
    weights.data<float>()[r] = 1.0f;
  }
  TeacherTopK t_host;
  t_host.rows = n_max;
  t_host.k = k;
  t_host.ids = ids;
  t_host.logprobs = lp;
  t_host.actual_logprobs = actual;
  t_host.valid = valid;
  const TeacherTopK teacher = cuda::teacher_to_device(t_host);
  const Tensor targets_d = targets.to(Device::CUDA), weights_d = weights.to(Device::CUDA);
  Tensor d_lm_head = Tensor::zeros({v, h}, DType::F32, Device::CUDA);
  cuda::CublasHandle blas;

  for (int64_t n : o.rows) {
    OPD_CHECK(n >= 1 && n <= n_max, InvalidArgument, "bench loss: rows ", n);
    TeacherTopK t;
    t.rows = n;
    t.k = k;
    t.ids = teacher.ids.slice_rows(0, n);
    t.logprobs = teacher.logprobs.slice_rows(0, n);
    t.actual_logprobs = teacher.actual_logprobs.slice_rows(0, n);
    t.valid = teacher.valid.slice_rows(0, n);
    FusedLossArgs a;
    a.hidden = hidden.slice_rows(0, n);
    a.lm_head = lm_head;
    a.targets = targets_d.slice_rows(0, n);
    a.weights = weights_d.slice_rows(0, n);
    a.teacher = &t;
    a.n_total = static_cast<double>(n);
    Tensor d_hidden = Tensor::empty({n, h}, DType::F32, Device::CUDA);

    // The lm_head GEMMs alone, as a dense implementation does them: bf16 logits [N, V]
    // (2 N V bytes), dH = dZ W into f32, dW += dZ^T H into the f32 master gradient.
    double gemm_fwd = 0, gemm_dh = 0, gemm_dw = 0;
    {
      Tensor z = Tensor::empty({n, v}, DType::BF16, Device::CUDA);
      const int ni = static_cast<int>(n), vi = static_cast<int>(v), hi = static_cast<int>(h);
      auto fwd = [&] {
        gemm(blas.get(), CUBLAS_OP_T, CUBLAS_OP_N, vi, ni, hi, lm_head.raw(), CUDA_R_16BF, hi,
             a.hidden.raw(), hi, 0.f, z.raw(), CUDA_R_16BF, vi);
      };
      gemm_fwd = time_ms(o.warmup, o.iters, fwd);
      // z now holds real logits: use them as dZ (values do not change the GEMM's speed much,
      // but zeros would: METHOD.md).
      gemm_dh = time_ms(o.warmup, o.iters, [&] {
        gemm(blas.get(), CUBLAS_OP_N, CUBLAS_OP_N, hi, ni, vi, lm_head.raw(), CUDA_R_16BF, hi,
             z.raw(), vi, 0.f, d_hidden.raw(), CUDA_R_32F, hi);
      });
      gemm_dw = time_ms(o.warmup, o.iters, [&] {
        gemm(blas.get(), CUBLAS_OP_N, CUBLAS_OP_T, hi, vi, ni, a.hidden.raw(), CUDA_R_16BF, hi,
             z.raw(), vi, 1.f, d_lm_head.raw(), CUDA_R_32F, hi);
      });
    }
    const double gemms = gemm_fwd + gemm_dh + gemm_dw;
    const double flop_gemm = 2.0 * static_cast<double>(n) * v * h;

    for (DType td : tile_dtypes) {
      cuda::CudaLossOptions opt;
      opt.tile_dtype = td;
      opt.row_chunk = o.row_chunk;
      cuda::CudaLossTimings tm;
      std::vector<double> prep, fwd, bwd;
      LossResult res;
      auto call = [&] {
        opt.timings = &tm;
        res = cuda::fused_lm_head_loss_cuda(cfg, a, &d_hidden, &d_lm_head, opt);
        prep.push_back(tm.prepare_ms);
        fwd.push_back(tm.forward_ms);
        bwd.push_back(tm.backward_ms);
      };
      const double fused = time_ms(o.warmup, o.iters, call);
      prep.erase(prep.begin(), prep.begin() + o.warmup);
      fwd.erase(fwd.begin(), fwd.begin() + o.warmup);
      bwd.erase(bwd.begin(), bwd.begin() + o.warmup);
      OPD_CUDA_CHECK(cudaDeviceSynchronize());
      reset_peak_memory(Device::CUDA);
      const int64_t before = memory_stats(Device::CUDA).in_use;
      opt.timings = nullptr;
      res = cuda::fused_lm_head_loss_cuda(cfg, a, &d_hidden, &d_lm_head, opt);
      const int64_t extra = memory_stats(Device::CUDA).peak - before;
      const int64_t formula = cuda::fused_loss_cuda_scratch_bytes(n, v, k, cfg, DType::BF16,
                                                                  DType::F32, opt);
      const double ratio = fused / gemms;
      nlohmann::json j;
      j["bench"] = "loss";
      j["device"] = device;
      j["rows"] = n;
      j["vocab"] = v;
      j["hidden"] = h;
      j["k"] = k;
      j["mode"] = o.mode;
      j["beta"] = o.beta;
      j["temperature"] = o.temperature;
      j["dtype"] = "bf16";
      j["tile_dtype"] = std::string(dtype_name(td));
      j["vocab_tile"] = o.vocab_tile;
      j["fused_ms"] = fused;
      j["fused_prepare_ms"] = median(prep);
      j["fused_forward_ms"] = median(fwd);
      j["fused_backward_ms"] = median(bwd);
      j["gemm_forward_ms"] = gemm_fwd;
      j["gemm_dhidden_ms"] = gemm_dh;
      j["gemm_dweight_ms"] = gemm_dw;
      j["gemms_ms"] = gemms;
      j["ratio_fused_over_gemms"] = ratio;
      j["goal_ratio"] = 1.3;
      j["gemm_tflops"] = 3 * flop_gemm / (gemms * 1e-3) / 1e12;
      j["fused_tflops_4gemm_equiv"] = 4 * flop_gemm / (fused * 1e-3) / 1e12;
      j["extra_peak_bytes"] = extra;
      j["scratch_formula_bytes"] = formula;
      j["dense_logits_bf16_bytes"] = 2 * n * v;
      j["loss"] = res.loss;
      j["iters"] = o.iters;
      if (!o.json) {
        std::printf("\nN=%lld tile %s\n", (long long)n, std::string(dtype_name(td)).c_str());
        std::printf("  lm_head GEMMs alone   fwd %.3f + dH %.3f + dW %.3f = %.3f ms (%.0f TFLOP/s)\n",
                    gemm_fwd, gemm_dh, gemm_dw, gemms, 3 * flop_gemm / (gemms * 1e-3) / 1e12);
        std::printf("  fused loss fwd+bwd    %.3f ms (prepare %.3f, forward %.3f, backward %.3f)\n",
                    fused, median(prep), median(fwd), median(bwd));
        std::printf("  ratio fused / GEMMs   %.3f (goal <= 1.3; the recompute alone makes 4/3)\n", ratio);
        std::printf("  peak extra memory     %.2f MiB (formula %.2f MiB; dense bf16 logits %.0f MiB)\n",
                    extra / 1048576.0, formula / 1048576.0, 2.0 * n * v / 1048576.0);
        std::printf("  loss                  %.6g\n", res.loss);
      }
      std::printf("%s\n", j.dump().c_str());
    }
  }
}

#else

void run_bench_loss(const BenchLossOptions&) {
  OPD_FAIL(Unsupported, "opd bench loss needs the CUDA backend (this build has none)");
}

#endif

}  // namespace

void register_bench_loss(CLI::App& bench) {
  auto o = std::make_shared<BenchLossOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "loss", "Fused lm_head + distillation loss (CUDA) vs the lm_head GEMMs alone, W1 shapes");
  cmd->add_option("--rows", o->rows, "completion rows N (several allowed)")->capture_default_str();
  cmd->add_option("--vocab", o->vocab, "vocabulary V")->capture_default_str();
  cmd->add_option("--hidden", o->hidden, "hidden size H")->capture_default_str();
  cmd->add_option("--k", o->k, "teacher top-K")->capture_default_str();
  cmd->add_option("--mode", o->mode, "support mode: topk, topk+tail, sampled")->capture_default_str();
  cmd->add_option("--beta", o->beta, "JSD beta")->capture_default_str();
  cmd->add_option("--temperature", o->temperature, "distillation temperature")->capture_default_str();
  cmd->add_option("--vocab-tile", o->vocab_tile, "vocabulary tile width")->capture_default_str();
  cmd->add_option("--row-chunk", o->row_chunk, "rows per tile GEMM (0 = from the budget)")
      ->capture_default_str();
  cmd->add_option("--tile-dtype", o->tile_dtype, "logit tile storage: f32, bf16 or both")
      ->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "untimed calls first")->capture_default_str();
  cmd->add_option("--iters", o->iters, "timed calls (median reported)")->capture_default_str();
  cmd->add_flag("--json", o->json, "print only the JSON lines");
  cmd->callback([o] { run_bench_loss(*o); });
}

}  // namespace opd::cli
