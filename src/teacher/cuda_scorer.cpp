// CUDA teacher scorer (contract, memory and pipeline in teacher/cuda_scorer.h): the forward plan
// of teacher/score_plan.h run through the CUDA Transformer's forward_hidden, the scored rows
// gathered on the device, then the tiled top-K lm_head on the device; [rows x K] come back.
// Compiled in every build: it only uses Tensor-level ops, which throw Unsupported without CUDA.
#include "teacher/cuda_scorer.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/ops.h"  // gather_rows
#include "model/kv_cache.h"
#include "model/paged_forward.h"
#include "model/transformer.h"
#include "teacher/score_plan.h"
#include "teacher/topk_lm_head.h"  // topk_lm_head_device
#if defined(OPD_WITH_CUDA)
#include "core/cuda/allocator.h"    // current_stream
#include "kernels/cuda/cuda_ops.h"  // attention_has_fast_path
#endif

namespace opd {

namespace {

// Straight into the vector (one device-to-host copy; a host Tensor in between cost a second
// pass over W1's ~17 MB of top-K rows on the host).
template <typename T>
void host_copy(const Tensor& device_tensor, std::vector<T>& out) {
  OPD_CHECK(device_tensor.dtype() == dtype_of<T>() && device_tensor.device() == Device::CUDA,
            Internal, "CUDA scorer: ", device_tensor.describe(), " read back as ",
            dtype_name(dtype_of<T>()), " on the host");
  out.resize(static_cast<size_t>(device_tensor.numel()));
  if (out.empty()) return;
  device_hooks::cuda_memcpy(out.data(), Device::CPU, device_tensor.raw(), Device::CUDA,
                            device_tensor.nbytes());
}

}  // namespace

CudaScorer::CudaScorer(const std::string& model_dir, Options options) : opts_(options) {
  OPD_CHECK(device_hooks::cuda_compiled(), Unsupported,
            "CUDA scorer: this build of opd has no CUDA backend (use the CPU scorer)");
  OPD_CHECK(device_hooks::cuda_device_count() > 0, Unsupported,
            "CUDA scorer: no usable CUDA device here (use the CPU scorer, --device cpu)");
  OPD_CHECK(options.dtype == DType::BF16 || options.dtype == DType::F32, InvalidArgument,
            "CUDA scorer: dtype ", dtype_name(options.dtype), " (bf16 or f32)");
  const Transformer host = Transformer::load(model_dir);
  info_ = describe_teacher(model_dir, host.config());
  model_ = std::make_shared<const Transformer>(host.to(Device::CUDA, options.dtype));
  check_setup();
}

CudaScorer::CudaScorer(const std::string& model_dir) : CudaScorer(model_dir, Options{}) {}

CudaScorer::CudaScorer(std::shared_ptr<const Transformer> cuda_model, TeacherInfo info,
                       Options options)
    : opts_(options), model_(std::move(cuda_model)), info_(std::move(info)) {
  OPD_CHECK(model_ != nullptr, InvalidArgument, "CUDA scorer: no model");
  const ModelConfig& c = model_->config();
  if (info_.vocab_size == 0) info_.vocab_size = c.vocab_size;
  if (info_.max_model_len == 0) info_.max_model_len = c.max_position_embeddings;
  if (info_.eos_token_ids.empty()) info_.eos_token_ids = c.eos_token_ids;
  check_setup();
}

CudaScorer::~CudaScorer() = default;

void CudaScorer::check_setup() const {
  OPD_CHECK(opts_.max_batch_tokens > 0 && opts_.vocab_tile > 0 && opts_.row_chunk > 0 &&
                opts_.shared_prompt.block_size > 0,
            InvalidArgument, "CUDA scorer options: max_batch_tokens ", opts_.max_batch_tokens,
            ", vocab_tile ", opts_.vocab_tile, ", row_chunk ", opts_.row_chunk, " must be > 0");
  OPD_CHECK(model_->device() == Device::CUDA &&
                (model_->dtype() == DType::BF16 || model_->dtype() == DType::F32),
            InvalidArgument, "CUDA scorer: the model must have bf16 or f32 CUDA weights, has ",
            dtype_name(model_->dtype()), " on ",
            model_->device() == Device::CUDA ? "cuda" : "the cpu");
  OPD_CHECK(info_.vocab_size == model_->config().vocab_size, InvalidArgument,
            "CUDA scorer: teacher info says vocabulary ", info_.vocab_size, ", the model has ",
            model_->config().vocab_size);
}

SharedPromptOptions CudaScorer::shared_prompt_options() const {
  SharedPromptOptions s = opts_.shared_prompt;
#if defined(OPD_WITH_CUDA)
  if (opts_.context_prefill &&
      cuda::attention_has_fast_path(model_->dtype(), model_->config().head_dim)) {
    s.paged_attention_cost = opts_.context_attention_cost;
  }
#endif
  return s;
}

ScoreResponse CudaScorer::score(const ScoreRequest& req) {
  check_request_for(req, info_, opts_.limits);
  ScoreResponse out = response_skeleton(req, info_.vocab_size);
  const ScorePlan plan =
      plan_score_request(req, opts_.max_batch_tokens, model_->config(), shared_prompt_options());
  if (plan.rows == 0) return out;

  const std::lock_guard<std::mutex> lock(mutex_);
  const ModelConfig& c = model_->config();
  const int64_t H = c.hidden_size, V = c.vocab_size;
  // Gathered order: batch by batch (dense batches, then shared-prompt steps), take by take;
  // seq_row[s] = first gathered row of s.
  Tensor hidden = Tensor::empty({plan.rows, H}, model_->dtype(), Device::CUDA);
  std::vector<int64_t> seq_row(req.sequences.size(), -1);
  std::vector<int32_t> actual;
  actual.reserve(static_cast<size_t>(plan.rows));
  int64_t pos = 0;
  // The rows `takes` need from a forward's hidden states h [tokens, H] (device).
  auto gather = [&](const Tensor& h, const std::vector<ScorePlan::Take>& takes) {
    std::vector<int32_t> src;
    for (const ScorePlan::Take& t : takes) {
      seq_row[t.seq] = pos + static_cast<int64_t>(src.size());
      for (int64_t r = 0; r < t.rows; ++r) src.push_back(static_cast<int32_t>(t.src_row + r));
      actual.insert(actual.end(), plan.actual[t.seq].begin(), plan.actual[t.seq].end());
    }
    const int64_t m = static_cast<int64_t>(src.size());
    OPD_CHECK(pos + m <= plan.rows, Internal, "CUDA scorer: ", pos + m, " rows gathered, ",
              plan.rows, " planned");
    const Tensor rows = Tensor::from_vector(src, {m}).to(Device::CUDA);
    Tensor dst = hidden.slice_rows(pos, pos + m);
    ops::gather_rows(h, rows, dst);
    pos += m;
  };
  for (const ScorePlan::ForwardBatch& b : plan.batches)
    gather(model_->forward_hidden(make_batch(b.sequences, V)), b.takes);  // [tokens, H]
  if (!plan.shared.empty()) {  // shared prompts: K/V once, completions over it
    // Unfused layers: the fused path would copy packed q|k|v and gate|up weights per call.
    PagedForward paged(*model_, /*fused=*/false);
    paged.set_context_prefill(opts_.context_prefill);
    KvCache cache(c, plan.block_size, plan.cache_blocks, model_->dtype(), Device::CUDA);
    run_shared_prompts(plan, paged, cache, opts_.max_batch_tokens, gather);
  }
  OPD_CHECK(pos == plan.rows, Internal, "CUDA scorer: gathered ", pos, " rows, planned ",
            plan.rows);
  const Tensor actual_dev = Tensor::from_vector(actual, {plan.rows}).to(Device::CUDA);
#if defined(OPD_WITH_CUDA)
  model_->wait_for_weights(cuda::current_stream());  // the lm_head, if still in flight
#endif
  const TopKLmHeadDeviceResult d =
      topk_lm_head_device(hidden, model_->weights().lm_head, actual_dev, req.k,
                          req.temperature, req.with_ranks, opts_.vocab_tile, opts_.row_chunk);
  std::vector<int32_t> ids, ranks;
  std::vector<float> logprobs, actual_logprobs;
  host_copy(d.ids, ids);
  host_copy(d.logprobs, logprobs);
  host_copy(d.actual_logprobs, actual_logprobs);
  if (req.with_ranks) host_copy(d.actual_ranks, ranks);

  // Back to request order.
  const int64_t K = req.k, rows = plan.rows;
  out.ids.resize(static_cast<size_t>(rows * K));
  out.logprobs.resize(static_cast<size_t>(rows * K));
  out.actual_logprobs.resize(static_cast<size_t>(rows));
  if (req.with_ranks) out.actual_ranks.resize(static_cast<size_t>(rows));
  for (size_t s = 0; s < req.sequences.size(); ++s) {
    const int64_t dst0 = out.row_offsets[s], n = out.row_offsets[s + 1] - dst0;
    if (n == 0) continue;
    const int64_t src0 = seq_row[s];
    OPD_CHECK(src0 >= 0 && src0 + n <= rows, Internal, "CUDA scorer: sequence ", s,
              " was not gathered");
    std::copy_n(ids.begin() + src0 * K, n * K, out.ids.begin() + dst0 * K);
    std::copy_n(logprobs.begin() + src0 * K, n * K, out.logprobs.begin() + dst0 * K);
    std::copy_n(actual_logprobs.begin() + src0, n, out.actual_logprobs.begin() + dst0);
    if (req.with_ranks) std::copy_n(ranks.begin() + src0, n, out.actual_ranks.begin() + dst0);
  }
  return out;
}

}  // namespace opd
