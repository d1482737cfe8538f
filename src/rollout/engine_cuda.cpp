// CUDA step runner of rollout/engine_cuda.h: io layout, pinned staging, decode buckets, graph
// capture and replay, error flags.
#include "rollout/engine_cuda.h"

#ifdef OPD_WITH_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>
#include <functional>
#include <map>

#include "core/cuda/allocator.h"
#include "core/cuda/stream.h"
#include "core/error.h"
#include "core/log.h"

namespace opd {

int64_t decode_bucket(int64_t batch) {
  static const int64_t kBuckets[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256};
  for (int64_t b : kBuckets)
    if (batch <= b) return b;
  return (batch + 63) / 64 * 64;
}

namespace {

constexpr unsigned kNoError = 0xffffffffu;

// Byte offsets of one step's io in the staging and device buffers: the inputs (uploaded), the
// two error flags (uploaded as "none", read back), the outputs (read back). Every field starts
// on 16 bytes. The layout depends only on (tokens, rows, width, draws), so a decode bucket's
// graph always finds its inputs at the same addresses.
struct Layout {
  size_t params = 0, ids = 0, pos = 0, slots = 0, cu = 0, lens = 0, last = 0, tables = 0,
         rows = 0, flags = 0, out_ids = 0, out_slp = 0, out_mlp = 0, end = 0;
  size_t upload_bytes() const { return flags + 2 * sizeof(unsigned); }
};
Layout make_layout(int64_t T, int64_t B, int64_t W, int64_t D) {
  Layout l;
  size_t at = 0;
  auto take = [&](int64_t count, size_t elem) {
    const size_t o = at;
    at = (at + static_cast<size_t>(count) * elem + 15) / 16 * 16;
    return o;
  };
  l.params = take(D, sizeof(cuda::SampleRowParams));
  l.ids = take(T, 4);
  l.pos = take(T, 4);
  l.slots = take(T, 4);
  l.cu = take(B + 1, 4);
  l.lens = take(B, 4);
  l.last = take(B, 4);
  l.tables = take(B * W, 4);
  l.rows = take(D, 4);
  l.flags = take(2, 4);
  l.out_ids = take(D, 4);
  l.out_slp = take(D, 4);
  l.out_mlp = take(D, 4);
  l.end = at;
  return l;
}

// What a captured graph holds besides the runner's fixed buffers: the rollout's cache layers and
// the bounds baked into kernel arguments. A graph is replayed only under the key it was
// captured with.
struct CaptureKey {
  std::vector<const void*> kv;  // k(l), v(l) of every layer
  int64_t num_blocks = 0, block_size = 0, table_width = 0, max_seq_len = 0;
  bool cluster_sampler = true;  // which sampling kernel the sampling graph launches
  bool operator==(const CaptureKey&) const = default;
};

CaptureKey capture_key(KvCache& cache, const CudaRunnerLimits& l) {
  CaptureKey k;
  for (int64_t i = 0; i < cache.num_layers(); ++i) {
    k.kv.push_back(cache.k(i).raw());
    k.kv.push_back(cache.v(i).raw());
  }
  k.num_blocks = cache.num_blocks();
  k.block_size = cache.block_size();
  k.table_width = l.table_width;
  k.max_seq_len = l.max_seq_len;
  k.cluster_sampler = l.cluster_sampler;
  return k;
}

struct Graph {
  cudaGraphExec_t forward = nullptr, sample = nullptr;
  int64_t generation = -1;  // PagedWorkspace::generation() at capture
  int64_t key = -1;         // CudaStepRunner::Impl::key_id at capture
  int64_t eager_runs = 0;
  bool failed = false;      // capture failed once: this bucket stays eager
  void reset() {
    if (forward) (void)cudaGraphExecDestroy(forward);
    if (sample) (void)cudaGraphExecDestroy(sample);
    forward = sample = nullptr;
  }
};

}  // namespace

struct CudaStepRunner::Impl {
  const PagedForward& forward;
  KvCache* cache_ = nullptr;  // the current rollout's (begin_rollout)
  CudaRunnerLimits limits;
  CaptureKey key;
  int64_t key_id = 0;  // bumped when key changes: graphs of an older id are re-captured
  cudaStream_t stream;
  int64_t vocab = 0, rows_cap = 0, tokens_cap = 0, draws_cap = 0;
  std::unique_ptr<PagedWorkspace> ws;
  Tensor io;      // device copy of the layout (i64 storage)
  Tensor logits;  // f32 [rows_cap, V]
  void* host = nullptr;  // pinned staging, io.nbytes()
  cuda::Event ev_start, ev_mid, ev_end;
  std::map<int64_t, Graph> graphs;  // by decode bucket
  CudaStepTimes times;

  Impl(const PagedForward& f, KvCache& c, const CudaRunnerLimits& l, cudaStream_t s)
      : forward(f), limits(l), stream(s), vocab(f.model().config().vocab_size) {
    begin_rollout(c, l);
  }

  void begin_rollout(KvCache& c, const CudaRunnerLimits& l) {
    OPD_CHECK(l.scratch_block >= 0 && l.scratch_block < c.num_blocks() &&
                  c.ref_count(l.scratch_block) > 0,
              Internal, "CudaStepRunner: scratch block ", l.scratch_block, " is not held");
    OPD_CHECK(l.table_width >= 1 && l.max_seq_len >= 1, Internal, "CudaStepRunner: limits");
    // The io layout depends on the table width: a new width moves every field, so the buffers
    // are laid out again (and every graph dropped) by ensure().
    const bool width_changed = io.defined() && l.table_width != limits.table_width;
    cache_ = &c;
    limits = l;
    times = CudaStepTimes{};
    if (width_changed) {
      for (auto& [b, g] : graphs) g.reset();
      graphs.clear();
      io = Tensor();
    }
    ensure(std::max<int64_t>(1, l.max_tokens), std::max<int64_t>(1, l.max_rows),
           std::max<int64_t>(1, l.max_draws));
    CaptureKey k = capture_key(c, l);
    if (!(k == key)) {
      // A new max_seq_len changes the decode grid (and may grow the split workspace on the
      // first step): that bucket runs one eager step again before its capture.
      if (k.max_seq_len != key.max_seq_len)
        for (auto& [b, g] : graphs) g.eager_runs = 0;
      key = std::move(k);
      ++key_id;
    }
  }
  void end_rollout() { cache_ = nullptr; }
  ~Impl() {
    for (auto& [b, g] : graphs) g.reset();
    if (host) (void)cudaFreeHost(host);
  }

  // Buffers for a step of T tokens, B rows and D draws: allocated at the limits the engine
  // computed, grown (and every graph dropped: they hold the old addresses) if a step exceeds
  // them. Called between steps only (the previous step has been synchronized).
  void ensure(int64_t T, int64_t B, int64_t D) {
    if (io.defined() && T <= tokens_cap && B <= rows_cap && D <= draws_cap) return;
    OPD_CUDA_CHECK(cudaStreamSynchronize(stream));  // nothing queued may still use the old buffers
    for (auto& [b, g] : graphs) g.reset();
    graphs.clear();
    rows_cap = std::max(rows_cap, decode_bucket(B));
    tokens_cap = std::max({tokens_cap, T, rows_cap});
    draws_cap = std::max({draws_cap, D, rows_cap});
    if (!ws || ws->max_tokens() < tokens_cap)
      ws = std::make_unique<PagedWorkspace>(forward.model().config(), forward.model().dtype(),
                                            tokens_cap);
    const Layout big = make_layout(tokens_cap, rows_cap, limits.table_width, draws_cap);
    io = Tensor();
    logits = Tensor();
    io = Tensor::empty({static_cast<int64_t>((big.end + 7) / 8)}, DType::I64, Device::CUDA);
    logits = Tensor::empty({rows_cap, vocab}, DType::F32, Device::CUDA);
    if (host) (void)cudaFreeHost(host);
    host = nullptr;
    OPD_CUDA_CHECK(cudaHostAlloc(&host, io.nbytes(), cudaHostAllocDefault));
  }

  template <typename T>
  T* h(size_t off) { return reinterpret_cast<T*>(static_cast<char*>(host) + off); }
  template <typename T>
  T* d(size_t off) { return reinterpret_cast<T*>(static_cast<char*>(io.raw()) + off); }

  void sample(const Layout& L, int64_t draws, bool mapped) {
    cuda::sample_rows(logits.data<float>(), draws, vocab, d<cuda::SampleRowParams>(L.params),
                      d<int32_t>(L.out_ids), d<float>(L.out_slp), d<float>(L.out_mlp),
                      d<unsigned>(L.flags) + 1, stream, mapped ? d<int32_t>(L.rows) : nullptr,
                      limits.cluster_sampler ? 0 : -1);
  }

  // Captures body into a graph. `old` (an executable graph of the same bucket, or nullptr) is
  // updated in place when the new graph has its topology (cudaGraphExecUpdate: only kernel
  // arguments such as the cache addresses changed); otherwise it is destroyed and a new one
  // instantiated. `old` is consumed (set to nullptr) once it is returned or destroyed.
  cudaGraphExec_t capture(const std::function<void()>& body, cudaGraphExec_t& old) {
    cudaGraph_t g = nullptr;
    OPD_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      body();
    } catch (...) {
      (void)cudaStreamEndCapture(stream, &g);
      if (g) (void)cudaGraphDestroy(g);
      throw;
    }
    OPD_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    if (old) {
      cudaGraphExecUpdateResultInfo info{};
      if (cudaGraphExecUpdate(old, g, &info) == cudaSuccess) {
        (void)cudaGraphDestroy(g);
        times.graph_updates += 1;
        cudaGraphExec_t exec = old;
        old = nullptr;
        return exec;
      }
      (void)cudaGetLastError();  // the update was refused: instantiate anew
      (void)cudaGraphExecDestroy(old);
      old = nullptr;
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t st = cudaGraphInstantiate(&exec, g, 0);
    (void)cudaGraphDestroy(g);
    OPD_CUDA_CHECK(st);
    return exec;
  }

  std::vector<SampledToken> run(const PagedStep& step, const std::vector<Draw>& draws) {
    OPD_CHECK(cache_, Internal, "CudaStepRunner: a step outside a rollout (no begin_rollout)");
    KvCache& cache = *cache_;
    const PagedStepPlan p = plan_paged_step(step, vocab, cache, limits.table_width);
    const int64_t B = p.batch, T = p.tokens, D = static_cast<int64_t>(draws.size());
    bool decode = T == B && D == B;
    for (int64_t i = 0; decode && i < D; ++i) decode = draws[static_cast<size_t>(i)].row == i;
    for (const Draw& dr : draws)
      OPD_CHECK(dr.row >= 0 && dr.row < B, Internal, "CudaStepRunner: draw row ", dr.row,
                " outside the step's ", B, " sequences");
    // Decode steps: padded to the bucket, grid sized for the rollout's longest sequence.
    const int64_t Bn = decode ? decode_bucket(B) : B, Tn = decode ? Bn : T, Dn = decode ? Bn : D;
    const int64_t W = limits.table_width;
    OPD_CHECK(p.max_seq_len <= limits.max_seq_len, Internal, "CudaStepRunner: a sequence of ",
              p.max_seq_len, " tokens exceeds the rollout's longest, ", limits.max_seq_len);
    ensure(Tn, Bn, Dn);
    PagedWorkspace& ws = *this->ws;
    const Layout L = make_layout(Tn, Bn, W, Dn);

    // Staging: inputs, then the flags set to "none".
    cuda::SampleRowParams* params = h<cuda::SampleRowParams>(L.params);
    for (int64_t i = 0; i < Dn; ++i) {
      if (i < D) {
        params[i] = draws[static_cast<size_t>(i)].params;
      } else {
        params[i] = cuda::SampleRowParams{};
        params[i].temperature = 0.0;  // padding rows: greedy, ignored
      }
    }
    const int32_t scratch_slot = limits.scratch_block * static_cast<int32_t>(cache.block_size());
    int32_t* ids = h<int32_t>(L.ids);
    int32_t* pos = h<int32_t>(L.pos);
    int32_t* slots = h<int32_t>(L.slots);
    std::copy(step.ids.begin(), step.ids.end(), ids);
    std::copy(p.positions.begin(), p.positions.end(), pos);
    std::copy(p.slots.begin(), p.slots.end(), slots);
    for (int64_t t = T; t < Tn; ++t) {
      ids[t] = 0;
      pos[t] = 0;
      slots[t] = scratch_slot;
    }
    int32_t* cu = h<int32_t>(L.cu);
    int32_t* lens = h<int32_t>(L.lens);
    int32_t* tables = h<int32_t>(L.tables);
    std::copy(step.cu_seqlens.begin(), step.cu_seqlens.end(), cu);
    std::copy(p.seq_lens.begin(), p.seq_lens.end(), lens);
    std::copy(p.tables.begin(), p.tables.end(), tables);
    for (int64_t b = B; b < Bn; ++b) {
      cu[b + 1] = cu[b] + 1;
      lens[b] = 1;
      std::fill(tables + b * W, tables + (b + 1) * W, 0);
      tables[b * W] = limits.scratch_block;
    }
    std::copy(p.last_rows.begin(), p.last_rows.end(), h<int32_t>(L.last));
    int32_t* rows = h<int32_t>(L.rows);
    for (int64_t i = 0; i < D; ++i) rows[i] = static_cast<int32_t>(draws[static_cast<size_t>(i)].row);
    h<unsigned>(L.flags)[0] = h<unsigned>(L.flags)[1] = kNoError;

    PagedDeviceStep ds;
    ds.batch = Bn;
    ds.tokens = Tn;
    ds.width = W;
    ds.max_q_len = decode ? 1 : p.max_q_len;
    ds.max_seq_len = decode ? limits.max_seq_len : p.max_seq_len;
    ds.ids = d<int32_t>(L.ids);
    ds.positions = d<int32_t>(L.pos);
    ds.slots = d<int32_t>(L.slots);
    ds.cu_seqlens = d<int32_t>(L.cu);
    ds.seq_lens = d<int32_t>(L.lens);
    ds.block_tables = d<int32_t>(L.tables);
    ds.last_rows = decode ? nullptr : d<int32_t>(L.last);
    ds.error_flag = d<unsigned>(L.flags);
    // Prompts starting at position 0 attend on the tensor-core kernel (eager steps only: a
    // decode step, the only kind captured, has no such sequence).
    FreshPrefill fresh;
    if (!decode) {
      fresh = forward.plan_fresh_prefill(step.cu_seqlens.data(), p.seq_lens.data(), B, stream,
                                         p.tables.data(), p.width, cache.block_size());
      fresh.apply(ds);
    }

    ev_start.record(stream);
    OPD_CUDA_CHECK(cudaMemcpyAsync(io.raw(), host, L.upload_bytes(), cudaMemcpyHostToDevice, stream));
    auto run_forward = [&] { forward.step_device(ds, cache, ws, logits.data<float>(), stream); };
    auto run_sample = [&] {
      if (Dn > 0) sample(L, Dn, !decode);  // a step of prefill chunks only draws nothing
    };
    bool graphed = false;
    if (decode && limits.use_graphs) {
      Graph& g = graphs[Bn];
      // Stale: the workspace moved, or the cache / bounds changed since the capture.
      const bool stale = g.forward && (g.generation != ws.generation() || g.key != key_id);
      if ((!g.forward || stale) && !g.failed && g.eager_runs >= 1) {  // warm: GEMM plans, workspaces exist
        const int64_t gen = ws.generation();
        const auto t0 = std::chrono::steady_clock::now();
        cudaGraphExec_t old_forward = std::exchange(g.forward, nullptr);
        cudaGraphExec_t old_sample = std::exchange(g.sample, nullptr);
        try {
          g.forward = capture(run_forward, old_forward);
          g.sample = capture(run_sample, old_sample);
          OPD_CHECK(ws.generation() == gen, Internal,
                    "CudaStepRunner: the workspace moved during a capture");
          g.generation = gen;
          g.key = key_id;
          times.graph_captures += 1;
        } catch (const Error& e) {
          // A capture that fails (a library call that cannot be captured) leaves this bucket
          // eager: slower, same results. Nothing of the failed capture ran.
          (void)cudaGetLastError();
          if (old_forward) (void)cudaGraphExecDestroy(old_forward);
          if (old_sample) (void)cudaGraphExecDestroy(old_sample);
          g.reset();
          g.failed = true;
          log_warn("rollout: CUDA graph capture for decode batch ", Bn, " failed (", e.what(),
                   "); running it eagerly");
        }
        times.capture_ms += std::chrono::duration<double, std::milli>(
                                std::chrono::steady_clock::now() - t0).count();
      } else if (stale) {
        g.reset();  // not warm for the new bounds yet: eager until it is
      }
      if (g.forward) {
        OPD_CUDA_CHECK(cudaGraphLaunch(g.forward, stream));
        ev_mid.record(stream);
        OPD_CUDA_CHECK(cudaGraphLaunch(g.sample, stream));
        graphed = true;
        times.graph_steps += 1;
      } else {
        g.eager_runs += 1;
      }
    }
    if (!graphed) {
      run_forward();
      ev_mid.record(stream);
      run_sample();
    }
    OPD_CUDA_CHECK(cudaMemcpyAsync(h<char>(L.flags), d<char>(L.flags), L.end - L.flags,
                                   cudaMemcpyDeviceToHost, stream));
    ev_end.record(stream);
    OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (decode) {
      times.decode_steps += 1;
      times.decode_forward_ms += ev_mid.elapsed_ms_since(ev_start);
      times.sample_ms += ev_end.elapsed_ms_since(ev_mid);
    } else {
      times.prefill_ms += ev_end.elapsed_ms_since(ev_start);
    }

    const unsigned fwd_flag = h<unsigned>(L.flags)[0], smp_flag = h<unsigned>(L.flags)[1];
    OPD_CHECK(fwd_flag == kNoError, Internal, "rollout step: the paged kernels rejected row or "
              "sequence ", fwd_flag, " although the host validated every index");
    if (smp_flag != kNoError) {
      // A non-finite logit: the CPU sampler on that row gives the CPU path's exact error.
      const int64_t row = smp_flag < static_cast<unsigned>(D) ? draws[smp_flag].row : 0;
      std::vector<float> z(static_cast<size_t>(vocab));
      OPD_CUDA_CHECK(cudaMemcpyAsync(z.data(), logits.data<float>() + row * vocab,
                                     z.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
      OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
      std::vector<double> scratch;
      sampling_distribution(z.data(), vocab, SamplingParams{}, scratch);
      OPD_FAIL(InvalidData, "sampling: the GPU sampler reported a non-finite logit in row ", row);
    }
    std::vector<SampledToken> out(static_cast<size_t>(D));
    const int32_t* oid = h<int32_t>(L.out_ids);
    const float* oslp = h<float>(L.out_slp);
    const float* omlp = h<float>(L.out_mlp);
    for (int64_t i = 0; i < D; ++i) {
      OPD_CHECK(oid[i] >= 0 && oid[i] < vocab, Internal, "rollout step: the GPU sampler returned id ",
                oid[i], " for draw ", i, " (vocabulary ", vocab, ")");
      out[static_cast<size_t>(i)] = SampledToken{oid[i], oslp[i], omlp[i]};
    }
    return out;
  }
};

CudaStepRunner::CudaStepRunner(const PagedForward& forward, KvCache& cache,
                               const CudaRunnerLimits& limits, cudaStream_t stream)
    : impl_(std::make_unique<Impl>(forward, cache, limits, stream)) {}
CudaStepRunner::~CudaStepRunner() = default;

void CudaStepRunner::begin_rollout(KvCache& cache, const CudaRunnerLimits& limits) {
  impl_->begin_rollout(cache, limits);
}
void CudaStepRunner::end_rollout() { impl_->end_rollout(); }

std::vector<SampledToken> CudaStepRunner::run(const PagedStep& step, const std::vector<Draw>& draws) {
  return impl_->run(step, draws);
}
const CudaStepTimes& CudaStepRunner::times() const { return impl_->times; }

}  // namespace opd

#endif  // OPD_WITH_CUDA
