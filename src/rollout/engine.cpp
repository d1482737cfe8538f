// Rollout engine: the scheduler loop of engine.h (continuous batching over a paged KV cache,
// prompt forks, preemption by recompute) driving PagedForward and the sampler.
#include "rollout/engine.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/log.h"
#include "core/text_io.h"
#include "core/thread_pool.h"
#include "model/kv_cache.h"
#include "model/paged_forward.h"
#include "rollout/engine_cuda.h"
#include "rollout/stop.h"

#ifdef OPD_WITH_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/allocator.h"  // StreamScope, device_allocator
#include "core/cuda/stream.h"     // Stream, OPD_CUDA_CHECK
#endif

namespace opd {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::Eos: return "eos";
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
  }
  return "?";
}

void EngineOptions::validate() const {
  OPD_CHECK(block_size >= 1 && block_size <= 4096, InvalidArgument,
            "block_size must be in [1, 4096], got ", block_size);
  OPD_CHECK(kv_cache_bytes >= 1, InvalidArgument, "kv_cache_bytes must be >= 1, got ",
            kv_cache_bytes);
  OPD_CHECK(max_step_tokens >= 1, InvalidArgument, "max_step_tokens must be >= 1, got ",
            max_step_tokens);
  OPD_CHECK(max_running >= 1, InvalidArgument, "max_running must be >= 1, got ", max_running);
}

RolloutEngine::RolloutEngine(const Transformer& model, EngineOptions options,
                             std::vector<int32_t> eos_ids, const Tokenizer* tokenizer)
    : model_(&model), options_(options), eos_ids_(std::move(eos_ids)), tokenizer_(tokenizer) {
  options_.validate();
  const int64_t V = model.config().vocab_size;
  for (int32_t id : eos_ids_)
    OPD_CHECK(id >= 0 && id < V, InvalidData, "EOS token id ", id,
              " is outside the vocabulary [0, ", V, ")");
}

// What keep_device_state keeps between generate() calls (CUDA models): the forward with its
// packed weights and the step runner with its buffers and graphs, and the weight addresses
// they were built for.
struct RolloutEngine::DeviceState {
  std::vector<const void*> weights;  // every model weight's address at construction
  bool fused = true;
  std::unique_ptr<PagedForward> forward;
#ifdef OPD_WITH_CUDA
  std::unique_ptr<CudaStepRunner> runner;  // after forward: destroyed first
#endif
};

RolloutEngine::~RolloutEngine() = default;
RolloutEngine::RolloutEngine(RolloutEngine&&) noexcept = default;
RolloutEngine& RolloutEngine::operator=(RolloutEngine&&) noexcept = default;

void RolloutEngine::release_device_state() { device_.reset(); }

int64_t RolloutEngine::num_blocks() const {
  const DType dtype = model_->weights().embed_tokens.dtype();
  return options_.kv_cache_bytes /
         KvCache::block_bytes(model_->config(), options_.block_size, dtype);
}

namespace {

// One sample being generated. tokens = prompt + generated; the first `computed` of them have
// their keys/values in the cache, in `blocks`.
struct Sequence {
  int64_t request = 0, sample = 0;
  std::vector<int32_t> tokens;
  int64_t prompt_len = 0;
  int64_t computed = 0;
  std::vector<int32_t> blocks;
  std::vector<int64_t> pending_forks;  // sample indices forked when the prompt is computed
  uint64_t stream_key = 0;
  SampleOutput out;
  std::optional<CompletionText> text;
  bool finished = false;
};

#ifdef OPD_WITH_CUDA
// The stream every rollout runs on (graph capture needs a non-default stream). One for the
// process and never destroyed, so the per-stream GEMM workspace and cached blocks are reused by
// the next rollout instead of piling up under fresh stream handles.
cudaStream_t rollout_stream() {
  static cuda::Stream* stream = new cuda::Stream();
  return stream->get();
}
#endif

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

[[maybe_unused]] std::vector<const void*> model_weight_addresses(const Transformer& model) {
  std::vector<const void*> out;
  model.weights().for_each([&](const std::string&, const Tensor& t) {
    out.push_back(t.defined() ? t.raw() : nullptr);
  });
  return out;
}

}  // namespace

std::vector<RequestOutput> RolloutEngine::generate(const std::vector<GenerationRequest>& requests) {
  const auto t0 = std::chrono::steady_clock::now();
  const ModelConfig& cfg = model_->config();
  const int64_t V = cfg.vocab_size, bs = options_.block_size;
  const int64_t budget_blocks = this->num_blocks();
  const DType dtype = model_->weights().embed_tokens.dtype();
  const int64_t block_bytes = KvCache::block_bytes(cfg, bs, dtype);
  stats_ = EngineStats{};
  OPD_CHECK(budget_blocks >= 1, OutOfMemory, "kv_cache_bytes ", options_.kv_cache_bytes,
            " is less than one KV block (", block_bytes, " bytes = 2 x ", cfg.num_hidden_layers,
            " layers x ", bs, " tokens x ", cfg.num_key_value_heads, " kv heads x ", cfg.head_dim,
            " x ", dtype_size(dtype), " bytes)");

  // Validate everything before any work: ids against the vocabulary, options, and that every
  // sample fits the budget alone (K/V of prompt + max_new_tokens - 1 tokens: the last token
  // generated is never fed back).
  for (size_t r = 0; r < requests.size(); ++r) {
    const GenerationRequest& q = requests[r];
    OPD_CHECK(!q.prompt.empty(), InvalidArgument, "request ", r, ": the prompt is empty");
    for (size_t p = 0; p < q.prompt.size(); ++p) {
      if (q.prompt[p] < 0 || q.prompt[p] >= V)
        OPD_FAIL(InvalidData, "request ", r, ": prompt token id ", q.prompt[p], " at position ",
                 p, " is outside the vocabulary [0, ", V, ")");
    }
    for (int32_t id : q.stop_token_ids)
      OPD_CHECK(id >= 0 && id < V, InvalidData, "request ", r, ": stop token id ", id,
                " is outside the vocabulary [0, ", V, ")");
    try {
      q.sampling.validate();
    } catch (const Error& e) {
      OPD_FAIL(InvalidArgument, "request ", r, ": ", e.what());
    }
    OPD_CHECK(q.n >= 1 && q.n <= INT32_MAX, InvalidArgument, "request ", r, ": n must be >= 1, got ", q.n);
    OPD_CHECK(q.max_new_tokens >= 1, InvalidArgument, "request ", r,
              ": max_new_tokens must be >= 1, got ", q.max_new_tokens);
    OPD_CHECK(q.stop.empty() || tokenizer_, InvalidArgument, "request ", r,
              ": stop strings need a tokenizer (the model directory has no tokenizer.json)");
    const int64_t kv_tokens = static_cast<int64_t>(q.prompt.size()) + q.max_new_tokens - 1;
    OPD_CHECK(kv_tokens <= INT32_MAX, InvalidArgument, "request ", r, ": prompt + max_new_tokens = ",
              kv_tokens + 1, " exceeds 2^31");
    const int64_t need = (kv_tokens + bs - 1) / bs;
    OPD_CHECK(need <= budget_blocks, OutOfMemory, "request ", r, ": a sample of ", q.prompt.size(),
              " prompt tokens + max_new_tokens ", q.max_new_tokens, " needs K/V for ", kv_tokens,
              " tokens = ", need, " blocks of ", bs, " tokens (", need * block_bytes,
              " bytes), but kv_cache_bytes ", options_.kv_cache_bytes, " holds only ", budget_blocks,
              " blocks; raise the KV cache budget or lower max_new_tokens");
  }

  // The cache holds what the requests can use at most (every sample at full length, no block
  // shared), capped by the budget: a small rollout does not reserve the whole budget.
  int64_t most_blocks = 0;
  for (const GenerationRequest& q : requests)
    most_blocks += q.n * ((static_cast<int64_t>(q.prompt.size()) + q.max_new_tokens - 1 + bs - 1) / bs);
  const int64_t num_blocks = std::max<int64_t>(1, std::min(budget_blocks, most_blocks));
  stats_.num_blocks = num_blocks;
  const bool on_cuda = model_->device() == Device::CUDA;
  std::vector<RequestOutput> outputs(requests.size());
  GenerationProgress progress;
  for (const GenerationRequest& q : requests) progress.total_samples += q.n;
  auto t_teardown = std::chrono::steady_clock::now();
#ifdef OPD_WITH_CUDA
  std::optional<cuda::StreamScope> stream_scope;
  if (on_cuda) {
    // The weights may have just been written on another stream (an optimizer step).
    const auto t_sync = std::chrono::steady_clock::now();
    OPD_CUDA_CHECK(cudaDeviceSynchronize());
    stats_.sync_wait_seconds = seconds_since(t_sync);
    stream_scope.emplace(options_.cuda_stream ? static_cast<cudaStream_t>(options_.cuda_stream)
                                                : rollout_stream());
  }
#else
  OPD_CHECK(!on_cuda, Unsupported, "rollout: a CUDA model in a build without CUDA");
#endif
  {  // everything on the device lives in this scope; its blocks are released after it
  // CUDA: one block beyond the budget, held for the whole rollout: the padding rows of decode
  // buckets write there (rollout/engine_cuda.h).
  auto t_phase = std::chrono::steady_clock::now();
  KvCache cache(cfg, bs, num_blocks + (on_cuda ? 1 : 0), dtype, model_->weights().embed_tokens.device());
  [[maybe_unused]] const int32_t scratch_block = on_cuda ? cache.allocate() : -1;
  stats_.kv_alloc_seconds = seconds_since(t_phase);
  std::optional<PagedForward> local_forward;  // CPU models, and CUDA without a kept state
  const PagedForward* forward_ptr = nullptr;
#ifdef OPD_WITH_CUDA
  CudaStepRunner* runner = nullptr;
  // On every exit path: the runner forgets this call's cache (which dies right after); a
  // rollout that threw drops the kept device state (a capture or step may have stopped
  // half-way).
  struct EndRollout {
    CudaStepRunner** r;
    std::unique_ptr<DeviceState>* state;
    int exceptions;
    ~EndRollout() {
      if (*r) (*r)->end_rollout();
      if (std::uncaught_exceptions() > exceptions) state->reset();
    }
  } end_rollout{&runner, &device_, std::uncaught_exceptions()};
  if (on_cuda) {
    t_phase = std::chrono::steady_clock::now();
    std::vector<const void*> addresses = model_weight_addresses(*model_);
    const bool reuse = device_ && device_->fused == options_.cuda_fused &&
                       device_->weights == addresses;
    if (!reuse) {
      device_.reset();  // the runner's graphs hold the old buffers: drop them before new ones
      device_ = std::make_unique<DeviceState>();
      device_->weights = std::move(addresses);
      device_->fused = options_.cuda_fused;
      device_->forward = std::make_unique<PagedForward>(*model_, options_.cuda_fused);
    } else {
      device_->forward->refresh_packed(cuda::current_stream());
    }
    device_->forward->set_tuned_gemm(options_.cuda_tuned_gemm);
    device_->forward->set_pdl(options_.cuda_pdl);
    device_->forward->set_decode_linear(
        options_.cuda_decode_linear ? options_.cuda_decode_linear_gemms : 0u);
    device_->forward->set_fresh_prefill(options_.cuda_fresh_prefill);
    device_->forward->set_skip_stages(options_.cuda_skip_stages);
    device_->forward->set_context_prefill(options_.cuda_context_prefill);
    OPD_CUDA_CHECK(cudaStreamSynchronize(cuda::current_stream()));
    stats_.pack_seconds = seconds_since(t_phase);
    stats_.reused_device_state = reuse && device_->runner != nullptr;
    forward_ptr = device_->forward.get();

    // Bounds of one step: sequences <= max_step_tokens (each has a token) and <= the running
    // set, which admission keeps <= max(max_running, the largest n); draws <= the running set.
    t_phase = std::chrono::steady_clock::now();
    int64_t total_samples = 0, max_n = 1, max_kv = 1;
    for (const GenerationRequest& q : requests) {
      total_samples += q.n;
      max_n = std::max(max_n, q.n);
      max_kv = std::max<int64_t>(max_kv, static_cast<int64_t>(q.prompt.size()) + q.max_new_tokens - 1);
    }
    CudaRunnerLimits lim;
    lim.max_draws = std::max<int64_t>(1, std::min(total_samples, std::max(options_.max_running, max_n)));
    lim.max_rows = std::min(options_.max_step_tokens, lim.max_draws);
    lim.max_tokens = options_.max_step_tokens;
    lim.table_width = (max_kv + bs - 1) / bs;
    lim.max_seq_len = max_kv;
    lim.scratch_block = scratch_block;
    lim.use_graphs = options_.cuda_graphs;
    lim.cluster_sampler = options_.cuda_cluster_sampler;
    if (device_->runner)
      device_->runner->begin_rollout(cache, lim);
    else
      device_->runner = std::make_unique<CudaStepRunner>(*device_->forward, cache, lim,
                                                         cuda::current_stream());
    runner = device_->runner.get();
    stats_.runner_seconds = seconds_since(t_phase);
  }
#endif
  if (!forward_ptr) forward_ptr = &local_forward.emplace(*model_, options_.cuda_fused);
  const PagedForward& forward = *forward_ptr;
  double step_wall = 0;  // wall time inside the step calls (forward + sampling)
  std::vector<std::unique_ptr<Sequence>> all;  // owns every sequence
  std::deque<Sequence*> waiting;
  std::vector<Sequence*> running;  // admission order: oldest first

  auto make_text = [&](Sequence& s) {
    if (tokenizer_) s.text.emplace(*tokenizer_, requests[s.request].stop);
  };
  for (size_t r = 0; r < requests.size(); ++r) {
    const GenerationRequest& q = requests[r];
    outputs[r].samples.resize(static_cast<size_t>(q.n));
    auto s = std::make_unique<Sequence>();
    s->request = static_cast<int64_t>(r);
    s->tokens = q.prompt;
    s->prompt_len = static_cast<int64_t>(q.prompt.size());
    s->stream_key = q.stream_key ? *q.stream_key : prompt_stream_key(q.prompt);
    for (int64_t k = 1; k < q.n; ++k) s->pending_forks.push_back(k);
    make_text(*s);
    waiting.push_back(s.get());
    all.push_back(std::move(s));
  }

  // Blocks for positions [computed, end) of s, all or nothing: a shared block that will be
  // written (the partially filled one at `computed`) is copied first.
  auto reserve = [&](Sequence& s, int64_t end) -> bool {
    const size_t first = static_cast<size_t>(s.computed / bs);
    const bool cow = first < s.blocks.size() && cache.ref_count(s.blocks[first]) > 1;
    const int64_t fresh = (end + bs - 1) / bs - static_cast<int64_t>(s.blocks.size());
    if (cache.num_free() < std::max<int64_t>(fresh, 0) + (cow ? 1 : 0)) return false;
    if (cow) {
      const int32_t copy = cache.allocate();
      cache.copy_block(s.blocks[first], copy);
      cache.release(s.blocks[first]);
      s.blocks[first] = copy;
    }
    for (int64_t i = 0; i < fresh; ++i) s.blocks.push_back(cache.allocate());
    return true;
  };
  auto release_blocks = [&](Sequence& s) {
    for (int32_t b : s.blocks) cache.release(b);
    s.blocks.clear();
  };
  auto preempt = [&](Sequence* s) {
    release_blocks(*s);
    stats_.preemptions += 1;
    stats_.recomputed_tokens += s->computed;
    s->computed = 0;
    waiting.push_front(s);
  };

  while (!waiting.empty() || !running.empty()) {
    if (options_.should_cancel && options_.should_cancel())
      OPD_FAIL(Cancelled, "generation cancelled after ", stats_.steps, " steps");
    struct Scheduled {
      Sequence* seq;
      int64_t end;
    };
    std::vector<Scheduled> sched;
    int64_t budget = options_.max_step_tokens;
    bool preempted = false;
    // 1. Running sequences, oldest first; the youngest make room for older ones.
    for (size_t i = 0; i < running.size() && budget > 0;) {
      Sequence* s = running[i];
      const int64_t end = s->computed +
                          std::min<int64_t>(static_cast<int64_t>(s->tokens.size()) - s->computed, budget);
      bool ok = reserve(*s, end);
      while (!ok && running.back() != s) {
        preempt(running.back());
        running.pop_back();
        preempted = true;
        ok = reserve(*s, end);
      }
      if (!ok) {  // s is the youngest left: it waits for the older ones to finish
        OPD_CHECK(!sched.empty(), Internal, "request ", s->request, " sample ", s->sample,
                  " cannot get ", end, " token slots from ", num_blocks,
                  " blocks although it runs alone");
        preempt(s);
        running.pop_back();
        preempted = true;
        break;
      }
      sched.push_back({s, end});
      budget -= end - s->computed;
      ++i;
    }
    // 2. Admissions (none in a step that had to preempt: memory is short). The running set is
    //    counted with the forks its prompts will create, so it stays <= max_running (or one
    //    request's n when that alone is larger).
    int64_t running_samples = 0;
    for (const Sequence* s : running) running_samples += 1 + static_cast<int64_t>(s->pending_forks.size());
    while (!preempted && !waiting.empty() && budget > 0) {
      Sequence* s = waiting.front();
      const int64_t group = 1 + static_cast<int64_t>(s->pending_forks.size());
      if (!running.empty() && running_samples + group > options_.max_running) break;
      const int64_t end = s->computed +
                          std::min<int64_t>(static_cast<int64_t>(s->tokens.size()) - s->computed, budget);
      if (!reserve(*s, end)) break;
      waiting.pop_front();
      running.push_back(s);
      running_samples += group;
      sched.push_back({s, end});
      budget -= end - s->computed;
    }
    OPD_CHECK(!sched.empty(), Internal, "rollout scheduler made no progress with ", waiting.size(),
              " waiting and ", running.size(), " running sequences");

    // 3. One forward step over every scheduled chunk. The draws are known before it runs: each
    //    sequence whose tokens will all be computed, and a finished prompt's pending forks (they
    //    draw from its logits row; the children are created after the step).
    PagedStep step;
    struct Draw {
      Sequence* seq;     // nullptr: a fork of `parent`, created after the step
      Sequence* parent;
      int64_t row, sample, gen;
      SampledToken token;
    };
    std::vector<Draw> draws;
    bool decode_step = true;
    for (size_t j = 0; j < sched.size(); ++j) {
      const Scheduled& sc = sched[j];
      Sequence* s = sc.seq;
      const int64_t n = sc.end - s->computed, len = static_cast<int64_t>(s->tokens.size());
      step.add(std::span<const int32_t>(s->tokens).subspan(static_cast<size_t>(s->computed),
                                                          static_cast<size_t>(n)),
               s->computed, s->blocks);
      if (s->computed + n == len && len > s->prompt_len && n == 1) {
        stats_.decode_tokens += 1;
      } else {
        stats_.prefill_tokens += n;
        decode_step = false;
      }
      if (sc.end < len) continue;  // mid-prefill: no draw yet
      const int64_t gen = len - s->prompt_len, row = static_cast<int64_t>(j);
      draws.push_back({s, s, row, s->sample, gen, {}});
      for (int64_t k : s->pending_forks) draws.push_back({nullptr, s, row, k, gen, {}});
    }
    const auto t_step = std::chrono::steady_clock::now();
    if (on_cuda) {
#ifdef OPD_WITH_CUDA
      std::vector<CudaStepRunner::Draw> cd(draws.size());
      for (size_t i = 0; i < draws.size(); ++i) {
        const Draw& d = draws[i];
        const SamplingParams& sp = requests[static_cast<size_t>(d.parent->request)].sampling;
        cd[i].row = d.row;
        cd[i].params.temperature = sp.temperature;
        cd[i].params.top_p = sp.top_p;
        cd[i].params.min_p = sp.min_p;
        cd[i].params.top_k = sp.top_k;
        cd[i].params.seed = sp.seed;
        cd[i].params.stream_key = d.parent->stream_key;
        cd[i].params.sample_index = static_cast<uint32_t>(d.sample);
        cd[i].params.step = static_cast<uint32_t>(d.gen);
      }
      std::vector<SampledToken> got = runner->run(step, cd);
      for (size_t i = 0; i < draws.size(); ++i) draws[i].token = got[i];
#endif
    } else {
      Tensor logits = forward.step(step, cache);
      const double forward_s = seconds_since(t_step);
      const auto t_sample = std::chrono::steady_clock::now();
      const float* lg = logits.data<float>();
      parallel_for(static_cast<int64_t>(draws.size()), [&](int64_t begin, int64_t end) {
        std::vector<double> local;
        for (int64_t i = begin; i < end; ++i) {
          Draw& d = draws[static_cast<size_t>(i)];
          const GenerationRequest& q = requests[static_cast<size_t>(d.parent->request)];
          const double u = sampling_uniform(q.sampling.seed, d.parent->stream_key,
                                            static_cast<uint32_t>(d.sample),
                                            static_cast<uint32_t>(d.gen));
          d.token = sample_token(lg + d.row * V, V, q.sampling, u, local);
        }
      });
      if (decode_step) {
        stats_.decode_forward_seconds += forward_s;
        stats_.sample_seconds += seconds_since(t_sample);
        stats_.decode_steps += 1;
      } else {
        stats_.prefill_seconds += seconds_since(t_step);
      }
    }
    step_wall += seconds_since(t_step);
    stats_.steps += 1;
    stats_.max_batch = std::max<int64_t>(stats_.max_batch, static_cast<int64_t>(sched.size()));
    stats_.peak_blocks_used = std::max(stats_.peak_blocks_used, num_blocks - cache.num_free());

    // 4. Sequences that caught up take their draws; a finished prompt forks its other samples
    //    first (in the order of the draws, as the running set expects).
    for (const Scheduled& sc : sched) sc.seq->computed = sc.end;
    for (Draw& d : draws) {
      if (d.seq) continue;
      Sequence* s = d.parent;
      auto child = std::make_unique<Sequence>();
      child->request = s->request;
      child->sample = d.sample;
      child->tokens = s->tokens;
      child->prompt_len = s->prompt_len;
      child->computed = s->computed;
      child->blocks = s->blocks;
      for (int32_t b : child->blocks) cache.retain(b);
      child->stream_key = s->stream_key;
      make_text(*child);
      running.push_back(child.get());
      d.seq = child.get();
      all.push_back(std::move(child));
    }
    for (Draw& d : draws) d.parent->pending_forks.clear();
    for (Draw& d : draws) {
      Sequence& s = *d.seq;
      const GenerationRequest& q = requests[static_cast<size_t>(s.request)];
      const int32_t t = d.token.id;
      s.tokens.push_back(t);
      s.out.ids.push_back(t);
      s.out.sampling_logprobs.push_back(d.token.sampling_logprob);
      s.out.model_logprobs.push_back(d.token.model_logprob);
      const bool stop_string = s.text && s.text->push(t);
      if (!q.ignore_eos && std::find(eos_ids_.begin(), eos_ids_.end(), t) != eos_ids_.end()) {
        s.out.finish_reason = FinishReason::Eos;
        s.finished = true;
      } else if (std::find(q.stop_token_ids.begin(), q.stop_token_ids.end(), t) !=
                 q.stop_token_ids.end()) {
        s.out.finish_reason = FinishReason::Stop;
        s.finished = true;
      } else if (stop_string) {
        s.out.finish_reason = FinishReason::Stop;
        s.out.stop = *s.text->matched();
        s.finished = true;
      } else if (static_cast<int64_t>(s.out.ids.size()) >= q.max_new_tokens) {
        s.out.finish_reason = FinishReason::Length;
        s.finished = true;
      }
      if (s.finished) {
        if (s.text) {
          s.text->finish();
          s.out.text = s.text->text();
        }
        progress.finished_samples += 1;
        release_blocks(s);
        outputs[static_cast<size_t>(s.request)].samples[static_cast<size_t>(s.sample)] = std::move(s.out);
      }
    }
    std::erase_if(running, [](const Sequence* s) { return s->finished; });
    if (options_.on_progress) {
      progress.steps = stats_.steps;
      progress.generated_tokens += static_cast<int64_t>(draws.size());
      options_.on_progress(progress);
    }
  }
  OPD_CHECK(cache.num_free() == num_blocks, Internal, "rollout finished with ",
            num_blocks - cache.num_free(), " KV blocks still held");
#ifdef OPD_WITH_CUDA
  if (runner) {
    const CudaStepTimes& t = runner->times();
    stats_.prefill_seconds = t.prefill_ms * 1e-3;
    stats_.decode_forward_seconds = t.decode_forward_ms * 1e-3;
    stats_.sample_seconds = t.sample_ms * 1e-3;
    stats_.decode_steps = t.decode_steps;
    stats_.graph_steps = t.graph_steps;
    stats_.graph_captures = t.graph_captures;
    stats_.graph_updates = t.graph_updates;
    stats_.capture_seconds = t.capture_ms * 1e-3;
  }
#endif
  stats_.host_seconds = seconds_since(t0) - step_wall;
  t_teardown = std::chrono::steady_clock::now();
#ifdef OPD_WITH_CUDA
  if (runner) runner->end_rollout();
  runner = nullptr;
  if (on_cuda && !options_.keep_device_state) device_.reset();
#endif
  }  // the cache (and without keep_device_state the workspace and graphs) are gone
#ifdef OPD_WITH_CUDA
  // Give the cache's memory back to the device (not only to this stream's free list): the
  // training phase that follows allocates on another stream.
  if (on_cuda && options_.release_device_memory)
    cuda::device_allocator().release_stream(cuda::current_stream());
#endif
  stats_.teardown_seconds = seconds_since(t_teardown);
  stats_.seconds = seconds_since(t0);
  stats_.host_seconds += stats_.teardown_seconds;
  if (on_cuda)
    log_debug("rollout: ", stats_.seconds * 1e3, " ms: sync wait ", stats_.sync_wait_seconds * 1e3,
              " ms, kv alloc ", stats_.kv_alloc_seconds * 1e3, " ms, ",
              stats_.reused_device_state ? "refresh" : "pack", " ", stats_.pack_seconds * 1e3,
              " ms, runner ", stats_.runner_seconds * 1e3, " ms, ", stats_.graph_captures,
              " captures (", stats_.graph_updates, " in place) ", stats_.capture_seconds * 1e3,
              " ms, teardown ", stats_.teardown_seconds * 1e3, " ms; prefill ",
              stats_.prefill_seconds * 1e3, " ms, decode forward ",
              stats_.decode_forward_seconds * 1e3, " ms, sampling ", stats_.sample_seconds * 1e3,
              " ms over ", stats_.decode_steps, " decode steps (", stats_.graph_steps,
              " from graphs), ", stats_.steps, " steps");
  return outputs;
}

std::vector<int32_t> generation_eos_ids(const std::string& model_dir, const ModelConfig& config,
                                        const Tokenizer* tokenizer) {
  std::vector<int32_t> ids;
  auto add = [&](int64_t id, const std::string& source) {
    OPD_CHECK(id >= 0 && id < config.vocab_size, InvalidData, source, ": eos_token_id ", id,
              " is outside the vocabulary [0, ", config.vocab_size, ")");
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(static_cast<int32_t>(id));
  };
  for (int64_t id : config.eos_token_ids) add(id, model_dir + "/config.json");
  const std::string gen_path = model_dir + "/generation_config.json";
  if (std::filesystem::exists(gen_path)) {
    const std::string text = read_text_file(gen_path, int64_t{64} << 20);
    check_json_depth(text, gen_path);
    nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    OPD_CHECK(!j.is_discarded() && j.is_object(), InvalidData, gen_path,
              ": not a JSON object");
    if (j.contains("eos_token_id") && !j["eos_token_id"].is_null()) {
      const auto& e = j["eos_token_id"];
      if (e.is_number_integer()) {
        add(e.get<int64_t>(), gen_path);
      } else if (e.is_array()) {
        for (const auto& x : e) {
          OPD_CHECK(x.is_number_integer(), InvalidData, gen_path,
                    ": eos_token_id entries must be integers, got ", x.dump());
          add(x.get<int64_t>(), gen_path);
        }
      } else {
        OPD_FAIL(InvalidData, gen_path, ": eos_token_id must be an integer or a list, got ",
                 e.dump());
      }
    }
  }
  // The tokenizer may come from elsewhere (--tokenizer): an EOS the model cannot emit is
  // harmless for generation, so it is reported, not fatal.
  if (tokenizer && tokenizer->eos_id()) {
    const int32_t id = *tokenizer->eos_id();
    if (id < config.vocab_size)
      add(id, tokenizer->path());
    else
      log_warn(tokenizer->path(), ": eos token id ", id, " is outside the model vocabulary [0, ",
               config.vocab_size, "); not used as a stop token");
  }
  return ids;
}

}  // namespace opd
