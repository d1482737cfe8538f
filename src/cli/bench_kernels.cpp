// `opd bench kernels [--json] [--iters N] [--warmup N] [--filter S]`: times opd's CUDA kernels
// at the W1 student shapes (decode_linear.*: the 64-row GEMMs of a W1 decode step) (BENCHMARKS.md: Qwen3-0.6B, micro-batch 8 x 768 = 6144 tokens)
// against their ceilings: GEMMs in TFLOP/s against the measured bf16 GEMM rate (776 TFLOP/s)
// and against the plain cuBLAS call (cublasGemmEx) on the same operands; memory-bound ops in
// GB/s (fewest bytes: each input read once, each output written once) against the measured
// copy rate (4.15 TB/s). Each case: warm-up, then >= 20 timed runs with CUDA events, median;
// inputs rotate among several copies when one call's bytes fit twice in L2, so repeated runs do
// not measure the cache. tools/bench_kernels_torch.py times the PyTorch equivalents (same
// names, same shapes) and, given this command's JSON, prints both side by side.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "core/tensor.h"

#ifdef OPD_WITH_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/allocator.h"
#include "core/cuda/stream.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/decode_linear.h"
#include "kernels/cuda/persistent_probe.h"
#include "kernels/cuda/gemm.h"
#include "kernels/ops.h"
#include "rollout/sampler_cuda.h"
#include "teacher/topk_lm_head_cuda.h"
#include "train/optimizer.h"
#endif

namespace opd::cli {
namespace {

struct BenchOptions {
  bool json = false;
  int iters = 50;
  int warmup = 5;
  std::string filter;
};

#ifdef OPD_WITH_CUDA

constexpr double kGemmCeilingTflops = 776.0;  // BENCHMARKS.md, lent H200, PyTorch 2.11
constexpr double kCopyCeilingGBs = 4150.0;    // device-to-device copy, read + write counted

// W1 student (Qwen3-0.6B shape), one micro-batch.
constexpr int64_t kTokens = 8 * 768, kHidden = 1024, kInter = 3072, kVocab = 151936;
constexpr int64_t kHeads = 16, kKvHeads = 8, kHeadDim = 128, kLayers = 28;

struct Row {
  std::string name, shape;
  bool flops = false;  // work is FLOPs (else bytes)
  double work = 0;
  double ms = 0, ref_ms = 0;  // ref: plain cuBLAS for GEMMs
  int sets = 1;
};

// A case: `setup(sets)` allocates `sets` independent input/output groups; `run(s)` issues one
// call on group s; `ref(s)` (optional) the library call doing the same job.
struct Case {
  std::string name, shape;
  bool flops;
  double work;
  double bytes_per_set;  // device bytes one call touches (decides the rotation)
  std::function<void(int)> setup;
  std::function<void(int)> run;
  std::function<void(int)> ref;
  bool host_syncs = false;  // the op reads back an index check: no queue-ahead possible
};

cudaStream_t g_stream = nullptr;

Tensor dev_rand(const Shape& s, DType dt, uint64_t seed, float lo = -1, float hi = 1) {
  Tensor t = Tensor::empty(s, dt, Device::CUDA);
  cuda::fill_uniform(t.raw(), t.numel(), dt, seed, lo, hi, g_stream);
  return t;
}
Tensor dev_ints(const Shape& s, uint64_t seed, int32_t lo, int32_t hi) {
  Tensor t = Tensor::empty(s, DType::I32, Device::CUDA);
  cuda::fill_ints(t.data<int32_t>(), t.numel(), seed, lo, hi, g_stream);
  return t;
}

// Median of `iters` event-timed calls (ms), rotating over `sets` input groups.
double time_ms(const std::function<void(int)>& fn, int sets, int warmup, int iters, bool syncs) {
  for (int i = 0; i < warmup; ++i) fn(i % sets);
  OPD_CUDA_CHECK(cudaStreamSynchronize(g_stream));
  std::vector<cuda::Event> start(static_cast<size_t>(iters)), stop(static_cast<size_t>(iters));
  // Hold the stream so the whole loop is queued before the GPU starts (no launch gaps).
  if (!syncs) cuda::spin(2000.0 + 50.0 * iters, g_stream);
  for (int i = 0; i < iters; ++i) {
    start[i].record(g_stream);
    fn(i % sets);
    stop[i].record(g_stream);
  }
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) ms.push_back(stop[i].elapsed_ms_since(start[i]));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int rotation_sets(double bytes_per_set) {
  int l2 = 0, device = 0;
  OPD_CUDA_CHECK(cudaGetDevice(&device));
  OPD_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  if (bytes_per_set >= 2.0 * l2) return 1;
  return std::min(16, static_cast<int>(2.0 * l2 / std::max(bytes_per_set, 1.0)) + 1);
}

std::string shape3(int64_t a, int64_t b, int64_t c) { return cat(a, "x", b, "x", c); }

// The three GEMMs of a dense layer y = x W^T at (n, in, out), bf16 operands, f32 accumulation.
void add_linear_cases(std::vector<Case>& cases, const std::string& layer, int64_t n, int64_t in,
                      int64_t out) {
  struct Bufs {
    std::vector<Tensor> x, w, y, dy, dx, dw;
  };
  auto b = std::make_shared<Bufs>();
  const double flops = 2.0 * n * in * out;
  const double bytes = 2.0 * (n * in + in * out + n * out);
  auto setup = [b, n, in, out](int sets) {
    if (!b->x.empty()) return;
    for (int s = 0; s < sets; ++s) {
      b->x.push_back(dev_rand({n, in}, DType::BF16, 10 + s));
      b->w.push_back(dev_rand({out, in}, DType::BF16, 20 + s, -0.05f, 0.05f));
      b->y.push_back(Tensor::empty({n, out}, DType::BF16, Device::CUDA));
      b->dy.push_back(dev_rand({n, out}, DType::BF16, 30 + s));
      b->dx.push_back(Tensor::empty({n, in}, DType::BF16, Device::CUDA));
      b->dw.push_back(dev_rand({out, in}, DType::F32, 40 + s));
    }
  };
  const std::string shape = shape3(n, in, out);
  cases.push_back(
      {"gemm." + layer + ".fwd", shape, true, flops, bytes, setup,
       [b, n, in, out](int s) {
         cuda::linear_forward(b->x[s].raw(), b->w[s].raw(), nullptr, n, in, out, DType::BF16,
                              DType::BF16, b->y[s].raw(), g_stream);
       },
       [b, n, in, out](int s) {
         cuda::GemmArgs g;
         g.trans_a = true, g.m = out, g.n = n, g.k = in, g.a = b->w[s].raw(), g.lda = in;
         g.b = b->x[s].raw(), g.ldb = in, g.d = b->y[s].raw(), g.ldd = out;
         cuda::gemm_cublas_reference(g, g_stream);
       }});
  cases.push_back(
      {"gemm." + layer + ".bwd_input", shape, true, flops, bytes, setup,
       [b, n, in, out](int s) {
         cuda::linear_backward_input(b->dy[s].raw(), b->w[s].raw(), n, in, out, DType::BF16,
                                     DType::BF16, b->dx[s].raw(), g_stream);
       },
       [b, n, in, out](int s) {
         cuda::GemmArgs g;
         g.m = in, g.n = n, g.k = out, g.a = b->w[s].raw(), g.lda = in, g.b = b->dy[s].raw();
         g.ldb = out, g.d = b->dx[s].raw(), g.ldd = in;
         cuda::gemm_cublas_reference(g, g_stream);
       }});
  cases.push_back(
      {"gemm." + layer + ".bwd_weight", shape, true, flops, bytes, setup,
       [b, n, in, out](int s) {
         cuda::linear_backward_weight(b->dy[s].raw(), b->x[s].raw(), n, in, out, DType::BF16,
                                      DType::F32, b->dw[s].raw(), g_stream);
       },
       [b, n, in, out](int s) {
         cuda::GemmArgs g;
         g.trans_b = true, g.m = in, g.n = out, g.k = n, g.a = b->x[s].raw(), g.lda = in;
         g.b = b->dy[s].raw(), g.ldb = out, g.d = b->dw[s].raw(), g.ldd = in;
         g.d_dtype = DType::F32, g.beta = 1.0f;
         cuda::gemm_cublas_reference(g, g_stream);
       }});
}

// A memory-bound case over per-set tensors built by `make(s)`; `call(tensors)` runs it once.
using Tensors = std::vector<Tensor>;
void add_mem_case(std::vector<Case>& cases, const std::string& name, const std::string& shape,
                  double bytes, std::function<Tensors(int)> make,
                  std::function<void(Tensors&)> call, bool syncs = false) {
  auto sets = std::make_shared<std::vector<Tensors>>();
  cases.push_back({name, shape, false, bytes, bytes,
                   [sets, make](int n) {
                     if (sets->empty())
                       for (int s = 0; s < n; ++s) sets->push_back(make(s));
                   },
                   [sets, call](int s) { call((*sets)[s]); }, nullptr, syncs});
}

// The GEMMs of one W1 decode step (64 sequences: y[64, n] = x[64, k] W[n, k]^T, bf16), in GB/s
// of the fewest bytes (W + x + y) against the copy rate: opd's decode linear
// (kernels/cuda/decode_linear.h) where it has a plan for the shape, plain launches (no PDL
// overlap: what an isolated launch costs), against cuBLASLt (linear_forward, the heuristic's
// algorithm) as the library row; cuBLASLt alone where opd has no plan (the lm_head).
void add_decode_linear_case(std::vector<Case>& cases, const std::string& name, int64_t m,
                            int64_t n, int64_t k, DType out) {
  struct Bufs {
    Tensors x, w, y;
  };
  auto b = std::make_shared<Bufs>();
  const double bytes = 2.0 * n * k + 2.0 * m * k + static_cast<double>(dtype_size(out)) * m * n;
  cases.push_back(
      {name, cat(shape3(m, k, n), " bf16->", dtype_name(out)), false, bytes, bytes,
       [=](int sets) {
         if (!b->x.empty()) return;
         for (int s = 0; s < sets; ++s) {
           b->x.push_back(dev_rand({m, k}, DType::BF16, 1000 + s));
           b->w.push_back(dev_rand({n, k}, DType::BF16, 1100 + s, -0.05f, 0.05f));
           b->y.push_back(Tensor::empty({m, n}, out, Device::CUDA));
         }
       },
       [=](int s) {
         if (out == DType::BF16 && cuda::try_decode_linear(b->x[s].raw(), b->w[s].raw(), nullptr,
                                                           m, k, n, out, b->y[s].raw(), g_stream,
                                                           false))
           return;
         cuda::linear_forward(b->x[s].raw(), b->w[s].raw(), nullptr, m, k, n, DType::BF16, out,
                              b->y[s].raw(), g_stream);
       },
       [=](int s) {
         cuda::linear_forward(b->x[s].raw(), b->w[s].raw(), nullptr, m, k, n, DType::BF16, out,
                              b->y[s].raw(), g_stream);
       }});
}

// The persistent decode forward's skeleton (kernels/cuda/persistent_probe.h; docs/rollout.md has
// the measurements): a W1 decode step's per-layer weight bytes (q|k|v 8.4 MB, o 4.2, gate|up
// 12.6, down 6.3; 28 layers, 881 MB) streamed by one resident CTA per SM, phase by phase, in GB/s
// against the copy rate. Variants: the stream alone; a grid barrier after each of the 112
// phases with the ring kept full across phases (the design) or refilled only within a phase;
// the 112 barriers with no bytes; the barrier on the thread that issues the copies; one barrier
// per layer (with and without bytes); a producer warp that only requests pieces and never waits
// at a barrier (no barriers, per phase, per layer, 2 and 4 slots). The `timeline` rows run the
// producer-warp design once with per-CTA globaltimer stamps at every barrier and print on stderr
// where a barrier's time goes (arrivals' spread, last arrival -> release), with acquire polls,
// with relaxed polls + one fence, and with the last arriver releasing a separate flag word (also
// without bytes: flag_barriers_only). ms / 28 is the time per layer the persistent design would
// start from (the per-layer GEMMs: the decode_linear.* rows).
void add_persistent_probe_cases(std::vector<Case>& cases) {
  struct Bufs {
    Tensor w, sink, counter;
  };
  auto b = std::make_shared<Bufs>();
  const int64_t H = kHidden, I = kInter, qkv = (kHeads + 2 * kKvHeads) * kHeadDim;
  const int64_t phase[4] = {2 * qkv * H, 2 * H * kHeads * kHeadDim, 2 * 2 * I * H, 2 * H * I};
  const int64_t step_bytes = (phase[0] + phase[1] + phase[2] + phase[3]) * kLayers;
  struct Variant {
    const char* name;
    bool barrier, prefetch, bytes;
    int every = 1, thread = 32;
    bool producer = false;
    int slots = 6;
    bool relaxed = false, timeline = false, flag = false;
  };
  auto setup = [=](int) {
    if (b->w.defined()) return;
    b->w = dev_rand({step_bytes / 2}, DType::BF16, 4242);
    b->sink = Tensor::empty({1024}, DType::I32, Device::CUDA);
    b->counter = Tensor::empty({2}, DType::I32, Device::CUDA);
  };
  auto args = [=](const Variant& v) {
    cuda::PersistentProbeArgs a;
    a.weights = b->w.raw();
    for (int ph = 0; ph < 4; ++ph) a.phase_bytes[ph] = v.bytes ? phase[ph] : 0;
    a.layers = static_cast<int>(kLayers);
    a.barrier = v.barrier;
    a.prefetch = v.prefetch;
    a.barrier_every = v.every;
    a.barrier_thread = v.thread;
    a.producer_warp = v.producer;
    a.slots = v.slots;
    a.relaxed_poll = v.relaxed;
    a.flag_barrier = v.flag;
    a.counter = static_cast<unsigned*>(b->counter.raw());
    a.sink = static_cast<uint32_t*>(b->sink.raw());
    return a;
  };
  // One run with stamps (after two without), summarized on stderr.
  auto timeline = [=](const Variant& v) {
    const int sms = cuda::sm_count();
    const int64_t barriers = 4 * kLayers;
    Tensor tl = Tensor::empty({barriers * sms * 2}, DType::I64, Device::CUDA);
    cuda::PersistentProbeArgs a = args(v);
    for (int rep = 0; rep < 3; ++rep) {
      a.timeline = rep == 2 ? tl.raw() : nullptr;
      cuda::persistent_probe(a, g_stream);
    }
    OPD_CUDA_CHECK(cudaStreamSynchronize(g_stream));
    const Tensor h = tl.to(Device::CPU);
    const int64_t* t = h.data<int64_t>();
    double spread = 0, latency = 0, release = 0, cycle = 0;
    double work[4] = {0, 0, 0, 0};
    int64_t prev_release = -1;
    for (int64_t i = 0; i < barriers; ++i) {
      int64_t a0 = INT64_MAX, a1 = 0, r0 = INT64_MAX, r1 = 0;
      for (int c = 0; c < sms; ++c) {
        const int64_t* e = t + (i * sms + c) * 2;
        a0 = std::min(a0, e[0]);
        a1 = std::max(a1, e[0]);
        r0 = std::min(r0, e[1]);
        r1 = std::max(r1, e[1]);
      }
      spread += static_cast<double>(a1 - a0);
      latency += static_cast<double>(r0 - a1);
      release += static_cast<double>(r1 - r0);
      if (prev_release >= 0) {
        cycle += static_cast<double>(r1 - prev_release);
        work[i % 4] += static_cast<double>(a1 - prev_release);
      }
      prev_release = r1;
    }
    const double nb = static_cast<double>(barriers), per = nb / 4;
    std::fprintf(stderr,
                 "%s: per barrier (mean of %lld, ns): arrivals spread %.0f, last arrival -> first "
                 "release %.0f, first -> last release %.0f; release to release %.0f; last release "
                 "-> last arrival by phase q|k|v %.0f, o %.0f, gate|up %.0f, down %.0f\n",
                 v.name, static_cast<long long>(barriers), spread / nb, latency / nb, release / nb,
                 cycle / (nb - 1), work[0] / (per - 1), work[1] / per, work[2] / per, work[3] / per);
  };
  for (const Variant v :
       {Variant{"persistent_probe.timeline", true, true, true, 1, 32, true, 6, false, true},
        Variant{"persistent_probe.timeline_relaxed_poll", true, true, true, 1, 32, true, 6, true, true},
        Variant{"persistent_probe.timeline_flag", true, true, true, 1, 32, true, 6, false, true, true},
        Variant{"persistent_probe.flag_barriers_only", true, true, false, 1, 32, true, 6, false, false, true},
        Variant{"persistent_probe.stream", false, true, true},
        Variant{"persistent_probe.barrier_prefetch", true, true, true},
        Variant{"persistent_probe.barrier_no_prefetch", true, false, true},
        Variant{"persistent_probe.barriers_only", true, true, false},
        Variant{"persistent_probe.barrier_prefetch_thread0", true, true, true, 1, 0},
        Variant{"persistent_probe.barrier_per_layer", true, true, true, 4},
        Variant{"persistent_probe.barriers_per_layer_only", true, true, false, 4},
        Variant{"persistent_probe.producer_warp_stream", false, true, true, 1, 32, true},
        Variant{"persistent_probe.producer_warp_barrier", true, true, true, 1, 32, true},
        Variant{"persistent_probe.producer_warp_barrier_per_layer", true, true, true, 4, 32, true},
        Variant{"persistent_probe.producer_warp_barrier_slots2", true, true, true, 1, 32, true, 2},
        Variant{"persistent_probe.producer_warp_barrier_slots4", true, true, true, 1, 32, true, 4},
        Variant{"persistent_probe.producer_warp_stream_slots2", false, true, true, 1, 32, true, 2}}) {
    cases.push_back({v.name, cat(kLayers, " layers x 4 phases"), false,
                     v.bytes ? static_cast<double>(step_bytes) : 0.0, static_cast<double>(step_bytes),
                     [=](int sets) {
                       setup(sets);
                       if (v.timeline) timeline(v);
                       if (std::string(v.name) == "persistent_probe.stream")
                         std::fprintf(stderr, "persistent_probe: clusters of 2 / 4 / 8 / 16 CTAs (one per SM) resident at once: %d / %d / %d / %d\n",
                                      cuda::persistent_probe_max_clusters(2), cuda::persistent_probe_max_clusters(4),
                                      cuda::persistent_probe_max_clusters(8), cuda::persistent_probe_max_clusters(16));
                     },
                     [=](int) { cuda::persistent_probe(args(v), g_stream); }, nullptr});
  }
}

void add_decode_linear_cases(std::vector<Case>& cases) {
  const int64_t H = kHidden, I = kInter, V = kVocab, qkv = (kHeads + 2 * kKvHeads) * kHeadDim;
  const DType bf = DType::BF16;
  add_decode_linear_case(cases, "decode_linear.qkv_m64", 64, qkv, H, bf);
  add_decode_linear_case(cases, "decode_linear.o_m64", 64, H, kHeads * kHeadDim, bf);
  add_decode_linear_case(cases, "decode_linear.gate_up_m64", 64, 2 * I, H, bf);
  add_decode_linear_case(cases, "decode_linear.down_m64", 64, H, I, bf);
  add_decode_linear_case(cases, "decode_linear.lm_head_m64", 64, V, H, DType::F32);
  add_decode_linear_case(cases, "decode_linear.gate_up_m16", 16, 2 * I, H, bf);
  add_decode_linear_case(cases, "decode_linear.down_m1", 1, H, I, bf);
}

// Rollout and scoring kernels (issues 6 and 7) at the W1 shapes:
// - paged_attention.decode: 64 sequences, one query row each, 16 q / 8 kv heads, head_dim 128,
//   blocks of 16 (shuffled), contexts 256/512/768; bytes = the K/V read (the floor) + q + out.
// - sample: one draw per row of f32 logits [64, 151936] (T = 1 without filters, and with top-k 50
//   + top-p 0.9 + min-p 0.02); bytes = one read of the logits; the cluster kernel (default) and
//   the one-CTA-per-row kernel (`_one_cta`).
// - topk_lm_head: R = 4096 rows, H = 2048 (teacher), V = 151936, K = 64, bf16, in TFLOP/s of the
//   lm_head GEMM (2 R H V); the "vs cuBLAS" column is the same GEMM alone into a dense
//   [R, V] f32 buffer (what a dense scorer does before its softmax/top-k).
void add_generation_cases(std::vector<Case>& cases) {
  const DType bf = DType::BF16;
  // (context, grid bound max_seq_len, forced splits, name): the W1 contexts with the launch
  // heuristic's splits (max_q_len 1: the decode kernel), the grid sized as the rollout's graphs
  // size it (max_seq_len 767 at context 256 and 512), then a sweep of split counts at the
  // average W1 context (paged_splits.*: is the heuristic's choice the fastest?).
  std::vector<std::tuple<int64_t, int64_t, int, std::string>> configs;
  for (int64_t ctx : {256, 512, 768}) configs.emplace_back(ctx, ctx, 0, cat("paged_attention.decode_ctx", ctx));
  for (int64_t ctx : {256, 512})
    configs.emplace_back(ctx, 767, 0, cat("paged_attention.decode_ctx", ctx, "_bound767"));
  for (int sp : {1, 2, 3, 4, 6, 8, 12, 16})
    configs.emplace_back(512, 512, sp, cat("paged_splits.decode_ctx512_splits", sp));
  for (const auto& [ctx, bound, force, name] : configs) {
    const int64_t B = 64, hq = kHeads, hkv = kKvHeads, d = kHeadDim, bs = 16;
    const int64_t per_seq = (ctx + bs - 1) / bs, num_blocks = B * per_seq;
    const double kv_bytes = 2.0 * B * ctx * hkv * d * 2;
    const double bytes = kv_bytes + 2.0 * B * hq * d * 2;
    // One group per rotating set: q, caches, out, indices, workspace, and the call's arguments.
    struct Set {
      Tensors t;
      Tensor ws;
      cuda::PagedAttentionArgs a;
    };
    auto sets = std::make_shared<std::vector<Set>>();
    cases.push_back(
        {name, cat(B, "x", hq, "/", hkv, "x", d, " bs16"), false,
         bytes, bytes,
         [=](int n) {
           if (!sets->empty()) return;
           std::vector<int32_t> perm(static_cast<size_t>(num_blocks));
           for (int64_t i = 0; i < num_blocks; ++i) perm[i] = static_cast<int32_t>((i * 7919) % num_blocks);
           std::vector<int32_t> cu(B + 1), lens(B, static_cast<int32_t>(ctx));
           for (int64_t b = 0; b <= B; ++b) cu[b] = static_cast<int32_t>(b);
           for (int s = 0; s < n; ++s) {
             Set set;
             set.t = Tensors{dev_rand({B, hq, d}, bf, 900 + s), dev_rand({num_blocks, bs, hkv, d}, bf, 901 + s),
                             dev_rand({num_blocks, bs, hkv, d}, bf, 902 + s),
                             Tensor::empty({B, hq, d}, bf, Device::CUDA),
                             Tensor::from_vector(cu, {B + 1}).to(Device::CUDA),
                             Tensor::from_vector(lens, {B}).to(Device::CUDA),
                             Tensor::from_vector(perm, {B, per_seq}).to(Device::CUDA)};
             cuda::PagedAttentionArgs& a = set.a;
             a.q = set.t[0].raw();
             a.k_cache = set.t[1].raw();
             a.v_cache = set.t[2].raw();
             a.out = set.t[3].raw();
             a.cu_seqlens_q = set.t[4].data<int32_t>();
             a.seq_lens = set.t[5].data<int32_t>();
             a.block_tables = set.t[6].data<int32_t>();
             a.batch = B;
             a.total_q = B;
             a.hq = hq;
             a.hkv = hkv;
             a.head_dim = d;
             a.num_blocks = num_blocks;
             a.block_size = bs;
             a.max_blocks = per_seq;
             a.max_q_len = 1;
             a.max_seq_len = bound;
             a.scale = 1.0 / std::sqrt(static_cast<double>(d));
             a.dtype = bf;
             a.force_splits = force;
             const cuda::PagedAttentionLaunch l = cuda::paged_attention_launch(a);
             set.ws = Tensor::empty({static_cast<int64_t>(l.workspace_bytes / 4) + 1}, DType::I32,
                                    Device::CUDA);
             if (s == 0)
               std::fprintf(stderr,
                            "  paged_attention ctx %lld (grid bound %lld): %s kernel, %d splits of "
                            "%d positions, %d rows/CTA\n",
                            static_cast<long long>(ctx), static_cast<long long>(bound),
                            l.decode ? "decode" : "general", l.num_splits, l.split_tokens,
                            l.rows_per_cta);
             sets->push_back(std::move(set));
           }
         },
         [=](int s) { cuda::paged_attention((*sets)[s].a, (*sets)[s].ws.raw(), g_stream); }, nullptr});
  }
  // cluster 0: the default kernel (a row over a cluster of 8 CTAs at this V); -1: the one-CTA-per-
  // row kernel it replaced (rows "_one_cta"), timed in the same run.
  for (int cluster : {0, -1})
  for (int filtered = 0; filtered < 2; ++filtered) {
    const int64_t B = 64, V = kVocab;
    auto t = std::make_shared<Tensors>();
    auto params = std::make_shared<Tensor>();
    cases.push_back(
        {cat(filtered ? "sample.topk50_topp0.9_minp0.02" : "sample.t1", cluster < 0 ? "_one_cta" : ""),
         cat(B, "x", V, " f32"), false,
         4.0 * B * V, 4.0 * B * V,
         [=](int n) {
           if (!t->empty()) return;
           std::vector<cuda::SampleRowParams> rows(static_cast<size_t>(B));
           for (int64_t b = 0; b < B; ++b) {
             rows[b].seed = 7;
             rows[b].stream_key = static_cast<uint64_t>(b) * 0x9e3779b97f4a7c15ull;
             if (filtered) {
               rows[b].top_k = 50;
               rows[b].top_p = 0.9;
               rows[b].min_p = 0.02;
             }
           }
           *params = Tensor::empty({static_cast<int64_t>(rows.size() * sizeof(rows[0]))}, DType::I32, Device::CUDA);
           OPD_CUDA_CHECK(cudaMemcpy(params->raw(), rows.data(), rows.size() * sizeof(rows[0]),
                                     cudaMemcpyHostToDevice));
           // t[0]: outputs; t[1 + s]: the logits of rotating set s.
           *t = Tensors{Tensor::empty({3 * B + 1}, DType::I32, Device::CUDA)};
           for (int s = 0; s < n; ++s) t->push_back(dev_rand({B, V}, DType::F32, 910 + s, -8, 8));
         },
         [=](int s) {
           int32_t* out = (*t)[0].data<int32_t>();
           cuda::sample_rows((*t)[1 + s].data<float>(), B, V,
                             static_cast<const cuda::SampleRowParams*>(params->raw()), out,
                             reinterpret_cast<float*>(out + B), reinterpret_cast<float*>(out + 2 * B),
                             nullptr, g_stream, nullptr, cluster);
         },
         nullptr});
  }
  struct TopK {
    int64_t tile, chunk;
  };
  for (TopK cfg : {TopK{16384, 2048}, TopK{8192, 4096}}) {
    const int64_t R = 4096, H = 2048, V = kVocab, K = 64;
    auto t = std::make_shared<Tensors>();
    auto dense = std::make_shared<Tensor>();
    auto args = std::make_shared<cuda::TopKLmHeadCudaArgs>();
    const double flops = 2.0 * R * H * V;
    cases.push_back(
        {cat("topk_lm_head.k64_tile", cfg.tile, "_chunk", cfg.chunk), cat(R, "x", H, "x", V), true,
         flops, 2.0 * (R + V) * H,
         [=](int) {
           if (!t->empty()) return;
           const size_t ws = cuda::topk_lm_head_cuda_workspace_bytes(R, V, K, cfg.tile, cfg.chunk);
           *t = Tensors{dev_rand({R, H}, bf, 920), dev_rand({V, H}, bf, 921, -0.05f, 0.05f),
                        dev_ints({R}, 922, 0, static_cast<int32_t>(V)),
                        Tensor::empty({R, K}, DType::I32, Device::CUDA),
                        Tensor::empty({R, K}, DType::F32, Device::CUDA),
                        Tensor::empty({R}, DType::F32, Device::CUDA),
                        Tensor::empty({static_cast<int64_t>(ws / 4) + 1}, DType::I32, Device::CUDA)};
           cuda::TopKLmHeadCudaArgs& a = *args;
           a.hidden = (*t)[0].raw();
           a.lm_head = (*t)[1].raw();
           a.dtype = bf;
           a.rows = R;
           a.hidden_dim = H;
           a.vocab = V;
           a.actual = (*t)[2].data<int32_t>();
           a.k = K;
           a.vocab_tile = cfg.tile;
           a.row_chunk = cfg.chunk;
           a.ids = (*t)[3].data<int32_t>();
           a.logprobs = (*t)[4].data<float>();
           a.actual_logprobs = (*t)[5].data<float>();
           std::fprintf(stderr, "  topk_lm_head workspace %.1f MB (dense [R, V] f32: %.1f MB)\n",
                        ws / 1e6, 4.0 * R * V / 1e6);
         },
         [=](int) { cuda::topk_lm_head_cuda(*args, (*t)[6].raw(), g_stream); },
         [=](int) {
           if (!dense->defined()) *dense = Tensor::empty({R, V}, DType::F32, Device::CUDA);
           cuda::linear_forward((*t)[0].raw(), (*t)[1].raw(), nullptr, R, H, V, bf, DType::F32,
                                dense->raw(), g_stream);
         }});
  }
}

std::vector<Case> build_cases() {
  std::vector<Case> cases;
  const int64_t T = kTokens, H = kHidden, I = kInter, V = kVocab;
  const DType bf = DType::BF16;
  add_linear_cases(cases, "q_proj", T, H, kHeads * kHeadDim);
  add_linear_cases(cases, "kv_proj", T, H, kKvHeads * kHeadDim);
  add_linear_cases(cases, "o_proj", T, kHeads * kHeadDim, H);
  add_linear_cases(cases, "gate_up", T, H, I);
  add_linear_cases(cases, "down", T, I, H);
  add_linear_cases(cases, "lm_head", T, H, V);
  add_linear_cases(cases, "square8192", 8192, 8192, 8192);  // the ceiling's own shape

  const double th = static_cast<double>(T * H) * 2;  // bytes of one [T, H] bf16 tensor
  add_mem_case(
      cases, "rmsnorm_residual.fwd", shape3(T, H, 1), 4 * th + 2 * H,
      [=](int s) {
        return Tensors{dev_rand({T, H}, bf, 100 + s), dev_rand({T, H}, bf, 200 + s),
                       dev_rand({H}, bf, 300, 0.5f, 1.5f), Tensor::empty({T, H}, bf, Device::CUDA),
                       Tensor::empty({T, H}, bf, Device::CUDA),
                       Tensor::empty({T}, DType::F32, Device::CUDA)};
      },
      [=](Tensors& t) {
        cuda::rmsnorm_residual_forward(t[0].raw(), t[1].raw(), t[2].raw(), 1e-6, T, H, bf,
                                       t[3].raw(), t[4].raw(), t[5].data<float>(), g_stream);
      });
  add_mem_case(
      cases, "rmsnorm_residual.bwd", shape3(T, H, 1), 4 * th + 2 * H + 4 * H,
      [=](int s) {
        Tensors t{dev_rand({T, H}, bf, 110 + s), dev_rand({T, H}, bf, 210 + s),
                  dev_rand({H}, bf, 310, 0.5f, 1.5f), dev_rand({T}, DType::F32, 410, 0.5f, 2.0f),
                  dev_rand({T, H}, bf, 510 + s), Tensor::empty({T, H}, bf, Device::CUDA),
                  Tensor::zeros({H}, DType::F32, Device::CUDA)};
        return t;
      },
      [=](Tensors& t) {
        cuda::rmsnorm_residual_backward(t[0].raw(), t[1].raw(), t[2].raw(), t[3].data<float>(),
                                        t[4].raw(), T, H, bf, t[5].raw(), t[6].data<float>(),
                                        g_stream);
      });
  const int64_t qrows = T * kHeads;  // per-head q norm: [T * 16, 128]
  const double qb = static_cast<double>(qrows * kHeadDim) * 2;
  add_mem_case(
      cases, "rmsnorm_qk.fwd", shape3(qrows, kHeadDim, 1), 2 * qb,
      [=](int s) {
        return Tensors{dev_rand({qrows, kHeadDim}, bf, 120 + s), dev_rand({kHeadDim}, bf, 320),
                       Tensor::empty({qrows, kHeadDim}, bf, Device::CUDA),
                       Tensor::empty({qrows}, DType::F32, Device::CUDA)};
      },
      [=](Tensors& t) {
        cuda::rmsnorm_forward(t[0].raw(), t[1].raw(), 1e-6, qrows, kHeadDim, bf, t[2].raw(),
                              t[3].data<float>(), g_stream);
      });
  add_mem_case(
      cases, "rmsnorm_qk.bwd", shape3(qrows, kHeadDim, 1), 3 * qb,
      [=](int s) {
        return Tensors{dev_rand({qrows, kHeadDim}, bf, 130 + s), dev_rand({qrows, kHeadDim}, bf, 140 + s),
                       dev_rand({kHeadDim}, bf, 330), dev_rand({qrows}, DType::F32, 430, 0.5f, 2.0f),
                       Tensor::empty({qrows, kHeadDim}, bf, Device::CUDA),
                       Tensor::zeros({kHeadDim}, DType::F32, Device::CUDA)};
      },
      [=](Tensors& t) {
        cuda::rmsnorm_backward(t[0].raw(), t[1].raw(), t[2].raw(), t[3].data<float>(), qrows,
                               kHeadDim, bf, t[4].raw(), t[5].data<float>(), g_stream);
      });
  auto rope_make = [=](int s) {
    std::vector<float> f(static_cast<size_t>(kHeadDim / 2));
    for (size_t i = 0; i < f.size(); ++i)
      f[i] = static_cast<float>(std::pow(1e6, -2.0 * double(i) / double(kHeadDim)));
    return Tensors{dev_rand({T, kHeads, kHeadDim}, bf, 150 + s), dev_ints({T}, 151, 0, 768),
                   Tensor::from_vector(f, {kHeadDim / 2}).to(Device::CUDA)};
  };
  add_mem_case(cases, "rope.fwd", shape3(T, kHeads, kHeadDim), 2 * qb + 4.0 * T, rope_make,
               [=](Tensors& t) {
                 cuda::rope(t[0].raw(), t[1].data<int32_t>(), t[2].data<float>(), T, kHeads,
                            kHeadDim, bf, false, g_stream);
               });
  add_mem_case(cases, "rope.fwd.op_with_position_check", shape3(T, kHeads, kHeadDim),
               2 * qb + 4.0 * T, rope_make,
               [=](Tensors& t) { ops::rope_forward(t[0], t[1], t[2]); }, true);
  const double ti = static_cast<double>(T * I) * 2;
  add_mem_case(
      cases, "swiglu.fwd", shape3(T, I, 1), 3 * ti,
      [=](int s) {
        return Tensors{dev_rand({T, I}, bf, 160 + s, -4, 4), dev_rand({T, I}, bf, 170 + s),
                       Tensor::empty({T, I}, bf, Device::CUDA)};
      },
      [=](Tensors& t) { cuda::swiglu_forward(t[0].raw(), t[1].raw(), T * I, bf, t[2].raw(), g_stream); });
  add_mem_case(
      cases, "swiglu.bwd", shape3(T, I, 1), 5 * ti,
      [=](int s) {
        return Tensors{dev_rand({T, I}, bf, 180 + s), dev_rand({T, I}, bf, 190 + s, -4, 4),
                       dev_rand({T, I}, bf, 195 + s), Tensor::empty({T, I}, bf, Device::CUDA),
                       Tensor::empty({T, I}, bf, Device::CUDA)};
      },
      [=](Tensors& t) {
        cuda::swiglu_backward(t[0].raw(), t[1].raw(), t[2].raw(), T * I, bf, t[3].raw(),
                              t[4].raw(), g_stream);
      });
  add_mem_case(
      cases, "add", shape3(T, H, 1), 3 * th,
      [=](int s) {
        return Tensors{dev_rand({T, H}, bf, 600 + s), dev_rand({T, H}, bf, 610 + s),
                       Tensor::empty({T, H}, bf, Device::CUDA)};
      },
      [=](Tensors& t) { cuda::add(t[0].raw(), t[1].raw(), T * H, bf, t[2].raw(), g_stream); });
  // The embedding table is shared by all sets (it is the model's): only ids and outputs rotate.
  auto table = std::make_shared<Tensor>();
  auto emb_make = [=](int s) {
    if (!table->defined()) *table = dev_rand({V, H}, bf, 700);
    return Tensors{dev_ints({T}, 710 + s, 0, static_cast<int32_t>(V)), *table,
                   Tensor::empty({T, H}, bf, Device::CUDA), dev_rand({T, H}, bf, 720 + s),
                   Tensor::zeros({V, H}, DType::F32, Device::CUDA)};
  };
  add_mem_case(cases, "embedding.fwd", shape3(T, V, H), 2 * th + 4.0 * T, emb_make,
               [=](Tensors& t) {
                 cuda::embedding_forward(t[0].data<int32_t>(), t[1].raw(), T, V, H, bf,
                                         t[2].raw(), g_stream);
               });
  add_mem_case(cases, "embedding.fwd.op_with_id_check", shape3(T, V, H), 2 * th + 4.0 * T,
               emb_make, [=](Tensors& t) { ops::embedding_forward(t[0], t[1], t[2]); }, true);
  // Backward: read dout, read+write the touched f32 table rows (ids are ~all distinct).
  add_mem_case(cases, "embedding.bwd", shape3(T, V, H), th + 2.0 * T * H * 4 + 4.0 * T,
               emb_make, [=](Tensors& t) {
                 cuda::embedding_backward(t[0].data<int32_t>(), t[3].raw(), T, V, H, bf,
                                          t[4].data<float>(), g_stream);
               });
  const int64_t ce_rows = 1024;
  const double ce_bytes = static_cast<double>(ce_rows * V) * 2;
  auto ce_make = [=](int s) {
    return Tensors{dev_rand({ce_rows, V}, bf, 800 + s, -8, 8),
                   dev_ints({ce_rows}, 810 + s, 0, static_cast<int32_t>(V)),
                   Tensor::empty({ce_rows}, DType::F32, Device::CUDA),
                   Tensor::empty({ce_rows}, DType::F32, Device::CUDA),
                   Tensor::empty({ce_rows, V}, bf, Device::CUDA)};
  };
  add_mem_case(cases, "cross_entropy.fwd", shape3(ce_rows, V, 1), ce_bytes, ce_make,
               [=](Tensors& t) {
                 cuda::cross_entropy_forward(t[0].raw(), t[1].data<int32_t>(), ce_rows, V, bf,
                                             t[2].data<float>(), t[3].data<float>(), g_stream);
               });
  add_mem_case(cases, "cross_entropy.fwd.op_with_target_check", shape3(ce_rows, V, 1), ce_bytes,
               ce_make, [=](Tensors& t) { ops::cross_entropy_forward(t[0], t[1], t[2], t[3]); },
               true);
  add_mem_case(cases, "cross_entropy.bwd", shape3(ce_rows, V, 1), 2 * ce_bytes, ce_make,
               [=](Tensors& t) {
                 cuda::cross_entropy_backward(t[0].raw(), t[1].data<int32_t>(), t[3].data<float>(),
                                              ce_rows, V, 1.0 / ce_rows, bf, t[4].raw(), g_stream);
               });

  // AdamW over the W1 student's parameters (f32 master + bf16 copy, f32 m/v): per element
  // read p, g, m, v and write p, m, v (28 B) + the bf16 copy (2 B).
  auto params = std::make_shared<std::vector<OptimParam>>();
  auto opt = std::make_shared<std::unique_ptr<AdamW>>();
  std::vector<Shape> shapes = {{V, H}, {H}};
  for (int64_t l = 0; l < kLayers; ++l) {
    for (Shape s : {Shape{kHeads * kHeadDim, H}, Shape{kKvHeads * kHeadDim, H},
                    Shape{kKvHeads * kHeadDim, H}, Shape{H, kHeads * kHeadDim}, Shape{I, H},
                    Shape{I, H}, Shape{H, I}, Shape{H}, Shape{H}, Shape{kHeadDim}, Shape{kHeadDim}})
      shapes.push_back(s);
  }
  double numel = 0;
  for (const Shape& s : shapes) numel += static_cast<double>(shape_numel(s));
  auto adamw_setup = [=](int) {
    if (*opt) return;
    uint64_t seed = 900;
    for (const Shape& s : shapes) {
      params->push_back({dev_rand(s, DType::F32, seed++), dev_rand(s, DType::F32, seed++, -1e-3f, 1e-3f),
                         Tensor::empty(s, bf, Device::CUDA)});
    }
    *opt = std::make_unique<AdamW>(*params, AdamWConfig{0.9, 0.95, 1e-8, 0.1});
  };
  cases.push_back({"adamw.step", cat(static_cast<int64_t>(numel), " params"), false, 30.0 * numel,
                   30.0 * numel, adamw_setup, [=](int) { (*opt)->step(1e-5); }, nullptr});
  cases.push_back({"adamw.step_clipped", cat(static_cast<int64_t>(numel), " params"), false,
                   34.0 * numel, 34.0 * numel, adamw_setup,
                   [=](int) { (*opt)->step(1e-5, 1.0); }, nullptr, true});
  add_generation_cases(cases);
  add_decode_linear_cases(cases);
  add_persistent_probe_cases(cases);
  return cases;
}

void run_bench(const BenchOptions& o) {
  OPD_CHECK(cuda::device_count() > 0, Unsupported, "opd bench kernels needs a CUDA device");
  OPD_CHECK(o.iters >= 20, InvalidArgument, "--iters must be >= 20 (medians of fewer are noise)");
  cuda::Stream stream;
  g_stream = stream.get();
  cuda::StreamScope scope(g_stream);
  const std::string device = cuda::device_description(0);
  std::vector<Row> rows;
  for (Case& c : build_cases()) {
    if (!o.filter.empty() && c.name.find(o.filter) == std::string::npos) continue;
    Row r{c.name, c.shape, c.flops, c.work};
    r.sets = rotation_sets(c.bytes_per_set);
    c.setup(r.sets);
    r.ms = time_ms(c.run, r.sets, o.warmup, o.iters, c.host_syncs);
    if (c.ref) r.ref_ms = time_ms(c.ref, r.sets, o.warmup, o.iters, false);
    rows.push_back(r);
    if (!o.json) std::fprintf(stderr, "  %-40s %9.4f ms\n", r.name.c_str(), r.ms);
  }
  nlohmann::json results = nlohmann::json::array();
  std::printf("opd bench kernels on %s (median of %d, warm-up %d)\n", device.c_str(), o.iters,
              o.warmup);
  std::printf("%-40s %-22s %10s %12s %8s %12s\n", "kernel", "shape", "ms", "rate", "ceiling",
              "vs cuBLAS");
  for (const Row& r : rows) {
    const double rate = r.flops ? r.work / (r.ms * 1e-3) / 1e12 : r.work / (r.ms * 1e-3) / 1e9;
    const double frac = rate / (r.flops ? kGemmCeilingTflops : kCopyCeilingGBs);
    char ref[32] = "";
    if (r.ref_ms > 0) std::snprintf(ref, sizeof(ref), "%.2fx", r.ref_ms / r.ms);
    std::printf("%-40s %-22s %10.4f %8.1f %-3s %7.1f%% %12s\n", r.name.c_str(), r.shape.c_str(),
                r.ms, rate, r.flops ? "TF" : "GB", 100 * frac, ref);
    nlohmann::json j = {{"name", r.name}, {"shape", r.shape}, {"ms", r.ms},
                        {r.flops ? "tflops" : "gbps", rate}, {"ceiling_fraction", frac},
                        {"rotating_sets", r.sets}};
    if (r.ref_ms > 0) {
      j["cublas_ms"] = r.ref_ms;
      j["speedup_vs_cublas"] = r.ref_ms / r.ms;
    }
    results.push_back(j);
  }
  nlohmann::json out = {{"bench", "kernels"},
                        {"device", device},
                        {"iters", o.iters},
                        {"gemm_ceiling_tflops", kGemmCeilingTflops},
                        {"copy_ceiling_gbps", kCopyCeilingGBs},
                        {"results", results}};
  std::printf("%s\n", out.dump().c_str());
  g_stream = nullptr;
}

#else

void run_bench(const BenchOptions&) {
  OPD_FAIL(Unsupported, "opd bench kernels: this opd was built without CUDA");
}

#endif

}  // namespace

void register_bench_kernels(CLI::App& app) {
  CLI::App* bench = &bench_command(app);
  auto o = std::make_shared<BenchOptions>();
  CLI::App* k = bench->add_subcommand(
      "kernels", "CUDA kernels at the W1 student shapes vs the GEMM/copy ceilings and cuBLAS");
  k->add_flag("--json", o->json, "only the table and the JSON line (no progress on stderr)");
  k->add_option("--iters", o->iters, "timed runs per kernel (median; >= 20)");
  k->add_option("--warmup", o->warmup, "untimed runs first");
  k->add_option("--filter", o->filter, "only kernels whose name contains this");
  k->callback([o] { run_bench(*o); });
}

}  // namespace opd::cli
