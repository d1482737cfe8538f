// CPU teacher scorer (scorer.h): request checks and the forward plan shared with the CUDA scorer
// (teacher/score_plan.h: dedupe of prefix-contained sequences, packed batches), forwards to the
// final hidden states, then the tiled lm_head top-K pass (topk_lm_head.h); make_local_scorer.
#include "teacher/scorer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/thread_pool.h"
#include "model/kv_cache.h"
#include "model/paged_forward.h"
#include "model/transformer.h"
#include "teacher/cuda_scorer.h"
#include "teacher/score_plan.h"
#include "teacher/topk_lm_head.h"

namespace opd {

int64_t ScoreRequest::num_rows() const {
  int64_t rows = 0;
  for (const auto& s : sequences) rows += std::max<int64_t>(0, s.end - s.begin);
  return rows;
}

void check_score_request(const ScoreRequest& req, int64_t vocab, const ScoreLimits& lim) {
  const int64_t n = static_cast<int64_t>(req.sequences.size());
  OPD_CHECK(n <= lim.max_sequences, InvalidArgument, "score request: ", n,
            " sequences exceed the limit of ", lim.max_sequences);
  OPD_CHECK(req.k >= 0 && req.k <= vocab && req.k <= lim.max_k, InvalidArgument,
            "score request: k = ", req.k, " is outside [0, min(vocabulary ", vocab, ", limit ",
            lim.max_k, ")]");
  OPD_CHECK(std::isfinite(req.temperature) && req.temperature > 0, InvalidArgument,
            "score request: temperature ", req.temperature, " must be finite and > 0");
  int64_t tokens = 0, rows = 0;
  for (int64_t s = 0; s < n; ++s) {
    const ScoreSequence& q = req.sequences[static_cast<size_t>(s)];
    const int64_t len = static_cast<int64_t>(q.ids.size());
    tokens += len;
    OPD_CHECK(tokens <= lim.max_tokens, InvalidArgument, "score request: sequence ", s,
              " brings the token count to ", tokens, ", over the limit of ", lim.max_tokens);
    OPD_CHECK(q.begin >= 1 && q.begin <= q.end && q.end <= len, InvalidArgument,
              "score request: sequence ", s, ": scored positions [", q.begin, ", ", q.end,
              ") must satisfy 1 <= begin <= end <= length ", len,
              " (position 0 has no context to be predicted from)");
    for (int64_t p = 0; p < len; ++p) {
      const int32_t id = q.ids[static_cast<size_t>(p)];
      OPD_CHECK(id >= 0 && id < vocab, InvalidArgument, "score request: sequence ", s,
                ", position ", p, ": token id ", id, " is outside the vocabulary [0, ", vocab,
                ")");
    }
    rows += q.end - q.begin;
  }
  OPD_CHECK(rows * std::max<int64_t>(req.k, 1) <= lim.max_output_entries, InvalidArgument,
            "score request: ", rows, " scored positions x k = ", req.k, " exceed the limit of ",
            lim.max_output_entries, " output entries");
}

void check_response_matches(const ScoreResponse& r, const ScoreRequest& q) {
  const size_t n = q.sequences.size();
  OPD_CHECK(r.seq_begin.size() == n && r.row_offsets.size() == n + 1, InvalidData,
            "teacher response: ", r.seq_begin.size(), " sequences (", r.row_offsets.size(),
            " row offsets) for a request of ", n);
  OPD_CHECK(r.k == q.k, InvalidData, "teacher response: k = ", r.k, ", requested ", q.k);
  OPD_CHECK(r.row_offsets[0] == 0, InvalidData, "teacher response: row_offsets[0] = ",
            r.row_offsets[0]);
  for (size_t s = 0; s < n; ++s) {
    const auto& sq = q.sequences[s];
    OPD_CHECK(r.seq_begin[s] == sq.begin, InvalidData, "teacher response: sequence ", s,
              " starts at position ", r.seq_begin[s], ", requested ", sq.begin);
    OPD_CHECK(r.row_offsets[s + 1] - r.row_offsets[s] == sq.end - sq.begin, InvalidData,
              "teacher response: sequence ", s, " has ", r.row_offsets[s + 1] - r.row_offsets[s],
              " rows, requested ", sq.end - sq.begin);
  }
  const int64_t rows = r.row_offsets.back();
  OPD_CHECK(static_cast<int64_t>(r.ids.size()) == rows * r.k &&
                static_cast<int64_t>(r.logprobs.size()) == rows * r.k &&
                static_cast<int64_t>(r.actual_logprobs.size()) == rows,
            InvalidData, "teacher response: ", r.ids.size(), " ids, ", r.logprobs.size(),
            " logprobs, ", r.actual_logprobs.size(), " actual logprobs for ", rows,
            " rows x k = ", r.k);
}

TeacherPayload to_teacher_payload(const ScoreResponse& r) {
  TeacherPayload p;
  p.k = r.k;
  p.teacher_vocab = r.vocab_size;
  p.temperature = r.temperature;
  p.seq_first_position = r.seq_begin;
  p.seq_row_offsets = r.row_offsets;
  const int64_t rows = r.num_rows();
  p.entry_offsets.resize(static_cast<size_t>(rows + 1));
  for (int64_t i = 0; i <= rows; ++i) p.entry_offsets[static_cast<size_t>(i)] = i * r.k;
  // Widened in parallel (W1: 2.1M entries, ~5-13 ms in one pass).
  p.ids.resize(r.ids.size());
  p.logprobs.resize(r.logprobs.size());
  parallel_for(static_cast<int64_t>(r.ids.size()), [&](int64_t i0, int64_t i1) {
    std::copy(r.ids.begin() + i0, r.ids.begin() + i1, p.ids.begin() + i0);
  }, int64_t{1} << 16);
  parallel_for(static_cast<int64_t>(r.logprobs.size()), [&](int64_t i0, int64_t i1) {
    std::copy(r.logprobs.begin() + i0, r.logprobs.begin() + i1, p.logprobs.begin() + i0);
  }, int64_t{1} << 16);
  p.actual_logprobs.assign(r.actual_logprobs.begin(), r.actual_logprobs.end());
  return p;
}

int64_t sort_response_rows(ScoreResponse& r) {
  const int64_t k = r.k, rows = r.num_rows();
  if (k < 2 || static_cast<int64_t>(r.ids.size()) < rows * k ||
      static_cast<int64_t>(r.logprobs.size()) < rows * k)
    return 0;
  std::atomic<int64_t> reordered{0};
  parallel_for(rows, [&](int64_t r0, int64_t r1) {
    std::vector<std::pair<float, int32_t>> row;
    int64_t n = 0;
    for (int64_t i = r0; i < r1; ++i) {
      int32_t* ids = r.ids.data() + i * k;
      float* lp = r.logprobs.data() + i * k;
      auto before = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
        return canonical_entry_before(a.first, a.second, b.first, b.second);
      };
      row.clear();
      bool nan = false;
      for (int64_t j = 0; j < k; ++j) {
        nan = nan || std::isnan(lp[j]);
        row.emplace_back(lp[j], ids[j]);
      }
      // NaN breaks the ordering's strict weak order (std::sort's precondition).
      if (nan || std::is_sorted(row.begin(), row.end(), before)) continue;
      std::sort(row.begin(), row.end(), before);
      for (int64_t j = 0; j < k; ++j) {
        lp[j] = row[static_cast<size_t>(j)].first;
        ids[j] = row[static_cast<size_t>(j)].second;
      }
      ++n;
    }
    reordered += n;
  }, 1024);
  return reordered.load();
}

std::vector<NextToken> Scorer::next_tokens(const NextTokenRequest&) {
  OPD_FAIL(Unsupported, "this teacher backend does not generate tokens");
}

CompletionLayout completion_layout(const ScoreRequest& q) {
  CompletionLayout l;
  for (const auto& s : q.sequences) {
    l.first_position.push_back(s.begin);
    l.length.push_back(s.end - s.begin);
  }
  return l;
}

// ---------------------------------------------------------------------------------------------

namespace {

// The transformer trunk: the same weights with the lm_head replaced by the H x H identity, so
// Transformer::forward returns the final (normed) hidden states [T, H] instead of [T, V] logits
// (h I^T = h exactly: every product with 0 adds an exact zero). It costs T x H x H extra
// FLOPs (H / V of the lm_head's work) until model/ exposes a hidden-states forward.
Transformer make_trunk(const Transformer& model) {
  ModelConfig c = model.config();
  const int64_t H = c.hidden_size;
  c.vocab_size = H;
  c.tie_word_embeddings = false;
  ModelWeights w = model.weights();  // tensors share storage: no copy of the weights
  w.tied = false;
  w.lm_head = Tensor::zeros({H, H}, DType::F32);
  float* eye = w.lm_head.data<float>();
  for (int64_t i = 0; i < H; ++i) eye[i * H + i] = 1.0f;
  return Transformer(std::move(c), std::move(w));
}

}  // namespace

struct CpuScorer::Impl {
  Impl(const std::string& dir, Options o)
      : opts(o), model(Transformer::load(dir)), trunk(make_trunk(model)) {
    OPD_CHECK(opts.max_batch_tokens > 0 && opts.vocab_tile > 0 && opts.row_chunk > 0 &&
                  opts.shared_prompt.block_size > 0,
              InvalidArgument, "scorer options: max_batch_tokens ", opts.max_batch_tokens,
              ", vocab_tile ", opts.vocab_tile, ", row_chunk ", opts.row_chunk, " must be > 0");
    info = describe_teacher(dir, model.config());
  }

  // Final hidden states of the plan's takes, sequence s at rows [out_row[s], out_row[s+1])
  // (the forward plan, dedupe and packing: teacher/score_plan.h).
  Tensor hidden_rows(const ScorePlan& plan, const std::vector<int64_t>& out_row) const {
    const int64_t H = model.config().hidden_size, V = model.config().vocab_size;
    Tensor hidden = Tensor::empty({out_row.back(), H}, DType::F32);
    for (const ScorePlan::ForwardBatch& b : plan.batches) {
      Tensor h = trunk.forward(make_batch(b.sequences, V));  // [tokens, H]
      for (const ScorePlan::Take& t : b.takes) {
        std::memcpy(hidden.data<float>() + out_row[t.seq] * H, h.data<float>() + t.src_row * H,
                    static_cast<size_t>(t.rows * H) * sizeof(float));
      }
    }
    if (!plan.shared.empty()) {  // shared prompts: K/V once, completions over it
      const PagedForward paged(model, /*fused=*/false);
      KvCache cache(model.config(), plan.block_size, plan.cache_blocks);
      run_shared_prompts(plan, paged, cache, opts.max_batch_tokens,
                         [&](const Tensor& h, const std::vector<ScorePlan::Take>& takes) {
                           for (const ScorePlan::Take& t : takes)
                             std::memcpy(hidden.data<float>() + out_row[t.seq] * H,
                                         h.data<float>() + t.src_row * H,
                                         static_cast<size_t>(t.rows * H) * sizeof(float));
                         });
    }
    return hidden;
  }

  TopKLmHeadArgs lm_args(Tensor hidden, int64_t k, double temperature) const {
    TopKLmHeadArgs a;
    a.hidden = std::move(hidden);
    a.lm_head = model.weights().lm_head;
    a.k = k;
    a.temperature = temperature;
    a.vocab_tile = opts.vocab_tile;
    a.row_chunk = opts.row_chunk;
    return a;
  }

  Options opts;
  Transformer model;
  Transformer trunk;
  TeacherInfo info;
};

CpuScorer::CpuScorer(const std::string& model_dir, Options options)
    : impl_(std::make_unique<Impl>(model_dir, options)) {}
CpuScorer::CpuScorer(const std::string& model_dir) : CpuScorer(model_dir, Options{}) {}
CpuScorer::~CpuScorer() = default;

const TeacherInfo& CpuScorer::info() const { return impl_->info; }
const CpuScorer::Options& CpuScorer::options() const { return impl_->opts; }
const Transformer& CpuScorer::model() const { return impl_->model; }

int64_t CpuScorer::lm_head_scratch_bytes(int64_t rows, int64_t k) const {
  const ModelConfig& c = impl_->model.config();
  return rows * c.hidden_size * 4 +
         topk_lm_head_scratch_bytes(rows, c.vocab_size, impl_->opts.vocab_tile,
                                    impl_->opts.row_chunk);
}

ScoreResponse CpuScorer::score(const ScoreRequest& req) {
  const TeacherInfo& info = impl_->info;
  check_request_for(req, info, impl_->opts.limits);
  ScoreResponse out = response_skeleton(req, info.vocab_size);
  const ScorePlan plan = plan_score_request(req, impl_->opts.max_batch_tokens,
                                            impl_->model.config(), impl_->opts.shared_prompt);
  std::vector<int32_t> actual;
  for (const auto& a : plan.actual) actual.insert(actual.end(), a.begin(), a.end());
  TopKLmHeadArgs a = impl_->lm_args(impl_->hidden_rows(plan, out.row_offsets), req.k, req.temperature);
  a.actual = std::move(actual);
  a.want_ranks = req.with_ranks;
  TopKLmHeadResult r = topk_lm_head(a);
  out.actual_ranks = std::move(r.actual_ranks);
  out.ids = std::move(r.ids);
  out.logprobs = std::move(r.logprobs);
  out.actual_logprobs = std::move(r.actual_logprobs);
  return out;
}

std::vector<NextToken> CpuScorer::next_tokens(const NextTokenRequest& req) {
  const TeacherInfo& info = impl_->info;
  const ScoreLimits& lim = impl_->opts.limits;
  OPD_CHECK(static_cast<int64_t>(req.prompts.size()) <= lim.max_sequences, InvalidArgument,
            "next-token request: ", req.prompts.size(), " prompts exceed the limit of ",
            lim.max_sequences);
  OPD_CHECK(req.k >= 0 && req.k <= info.vocab_size && req.k <= lim.max_k, InvalidArgument,
            "next-token request: k = ", req.k, " is outside [0, min(vocabulary ", info.vocab_size,
            ", limit ", lim.max_k, ")]");
  const size_t n = req.prompts.size();
  std::vector<std::pair<int64_t, int64_t>> need(n);
  int64_t tokens = 0;
  for (size_t s = 0; s < n; ++s) {
    const auto& p = req.prompts[s];
    OPD_CHECK(!p.empty(), InvalidArgument, "next-token request: prompt ", s, " is empty");
    tokens += static_cast<int64_t>(p.size());
    OPD_CHECK(tokens <= lim.max_tokens, InvalidArgument, "next-token request: prompt ", s,
              " brings the token count to ", tokens, ", over the limit of ", lim.max_tokens);
    for (size_t i = 0; i < p.size(); ++i)
      OPD_CHECK(p[i] >= 0 && p[i] < info.vocab_size, InvalidArgument, "next-token request: prompt ",
                s, ", position ", i, ": token id ", p[i], " is outside the vocabulary [0, ",
                info.vocab_size, ")");
    need[s] = {static_cast<int64_t>(p.size()) - 1, static_cast<int64_t>(p.size())};
  }
  std::vector<int64_t> out_row(n + 1);
  for (size_t s = 0; s <= n; ++s) out_row[s] = static_cast<int64_t>(s);
  const ScorePlan plan = plan_forwards(req.prompts, need, impl_->opts.max_batch_tokens);
  TopKLmHeadArgs a = impl_->lm_args(impl_->hidden_rows(plan, out_row), req.k, 1.0);
  a.sample = true;
  a.sample_temperature = req.sample_temperature;
  a.seed = req.seed;
  for (size_t s = 0; s < n; ++s) a.streams.push_back(s);
  TopKLmHeadResult r = topk_lm_head(a);
  std::vector<NextToken> out(n);
  for (size_t s = 0; s < n; ++s) {
    out[s].id = r.sampled[s];
    out[s].logprob = r.sampled_logprobs[s];
    out[s].top_ids.assign(r.ids.begin() + static_cast<int64_t>(s) * req.k,
                          r.ids.begin() + static_cast<int64_t>(s + 1) * req.k);
    out[s].top_logprobs.assign(r.logprobs.begin() + static_cast<int64_t>(s) * req.k,
                               r.logprobs.begin() + static_cast<int64_t>(s + 1) * req.k);
  }
  return out;
}

std::unique_ptr<Scorer> make_local_scorer(const std::string& model_dir, Device device,
                                          DType cuda_dtype) {
  if (device == Device::CPU) return std::make_unique<CpuScorer>(model_dir);
  // CudaScorer throws Unsupported in builds without CUDA.
  CudaScorer::Options o;
  o.dtype = cuda_dtype;
  return std::make_unique<CudaScorer>(model_dir, o);
}

}  // namespace opd
