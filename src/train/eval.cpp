// Held-out evaluation (see eval.h): exact match, reverse KL to a teacher on student samples,
// greedy agreement with a teacher.
#include "train/eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <span>
#include <sstream>

#include "core/error.h"
#include "rollout/engine.h"
#include "teacher/scorer.h"

namespace opd {

namespace {
std::string ids_str(const std::vector<int32_t>& ids) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < ids.size(); ++i) s << (i ? "," : "") << ids[i];
  s << "]";
  return s.str();
}
}  // namespace

EvalResult evaluate_exact_match(const Transformer& model, const std::vector<int32_t>& eos_ids,
                                const Dataset& data, const EvalOptions& options) {
  OPD_CHECK(options.max_new_tokens >= 1, InvalidArgument, "eval: max_new_tokens ",
            options.max_new_tokens, " must be >= 1");
  size_t n = data.size();
  if (options.limit > 0) n = std::min(n, static_cast<size_t>(options.limit));
  std::vector<GenerationRequest> requests;
  requests.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const Sample& s = data[i];
    OPD_CHECK(!s.completion_ids.empty(), InvalidArgument, "eval: sample ", s.source,
              " has no reference completion");
    GenerationRequest r;
    r.prompt = s.prompt_ids;
    r.sampling.temperature = 0;
    // One token past the reference, so a model that does not stop there is judged wrong.
    r.max_new_tokens = std::min<int64_t>(options.max_new_tokens,
                                         static_cast<int64_t>(s.completion_ids.size()) + 1);
    requests.push_back(std::move(r));
  }
  EngineOptions eo;
  eo.kv_cache_bytes = static_cast<int64_t>(options.kv_cache_gb * (1 << 30));
  eo.should_cancel = options.should_cancel;
  eo.on_progress = options.on_progress;
  RolloutEngine engine(model, eo, eos_ids);
  auto outputs = engine.generate(requests);
  EvalResult result;
  for (size_t i = 0; i < n; ++i) {
    const auto& got = outputs[i].samples.at(0).ids;
    const auto& want = data[i].completion_ids;
    ++result.total;
    if (got == want) {
      ++result.correct;
    } else if (static_cast<int64_t>(result.wrong_examples.size()) < options.max_examples) {
      result.wrong_examples.push_back(data[i].source + ": got " + ids_str(got) + " want " +
                                      ids_str(want));
    }
  }
  return result;
}

namespace {
size_t prompt_count(const Dataset& data, int64_t limit) {
  size_t n = data.size();
  if (limit > 0) n = std::min(n, static_cast<size_t>(limit));
  return n;
}
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

ReverseKlResult evaluate_reverse_kl(const Transformer& student, Scorer& teacher,
                                    const std::vector<int32_t>& eos_ids, const Dataset& data,
                                    const ReverseKlOptions& options) {
  OPD_CHECK(options.max_new_tokens >= 1, InvalidArgument, "eval reverse-kl: max_new_tokens ",
            options.max_new_tokens, " must be >= 1");
  OPD_CHECK(options.samples_per_prompt >= 1, InvalidArgument, "eval reverse-kl: samples per prompt ",
            options.samples_per_prompt, " must be >= 1");
  OPD_CHECK(std::isfinite(options.temperature) && options.temperature > 0, InvalidArgument,
            "eval reverse-kl: temperature ", options.temperature, " must be finite and > 0");
  const size_t n = prompt_count(data, options.limit);
  OPD_CHECK(n > 0, InvalidArgument, "eval reverse-kl: no prompts");

  // 1. Student samples from q_T: plain temperature sampling (no filtering), so the rollout's
  //    sampling_logprob is log q_T(y) itself.
  std::vector<GenerationRequest> requests(n);
  for (size_t i = 0; i < n; ++i) {
    GenerationRequest& r = requests[i];
    r.prompt = data[i].prompt_ids;
    r.sampling.temperature = options.temperature;
    r.sampling.seed = options.seed;
    r.n = options.samples_per_prompt;
    r.max_new_tokens = options.max_new_tokens;
  }
  EngineOptions eo;
  eo.kv_cache_bytes = static_cast<int64_t>(options.kv_cache_gb * (1 << 30));
  eo.on_progress = options.on_progress;
  auto t0 = std::chrono::steady_clock::now();
  RolloutEngine engine(student, eo, eos_ids);
  auto outputs = engine.generate(requests);
  ReverseKlResult result;
  result.seconds_rollout = seconds_since(t0);

  // 2. Teacher log p_T of every sampled token: one score request, K = 0.
  ScoreRequest req;
  req.k = 0;
  req.temperature = options.temperature;
  std::vector<std::pair<size_t, size_t>> who;  // (prompt, sample) of each scored sequence
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < outputs[i].samples.size(); ++j) {
      const SampleOutput& smp = outputs[i].samples[j];
      OPD_CHECK(!smp.ids.empty() && smp.ids.size() == smp.sampling_logprobs.size(), Internal,
                "eval reverse-kl: sample ", j, " of ", data[i].source, " has ", smp.ids.size(),
                " ids and ", smp.sampling_logprobs.size(), " logprobs");
      ScoreSequence s;
      s.ids = data[i].prompt_ids;
      s.ids.insert(s.ids.end(), smp.ids.begin(), smp.ids.end());
      s.begin = static_cast<int64_t>(data[i].prompt_ids.size());
      s.end = static_cast<int64_t>(s.ids.size());
      req.sequences.push_back(std::move(s));
      who.emplace_back(i, j);
    }
  }
  t0 = std::chrono::steady_clock::now();
  ScoreResponse resp = teacher.score(req);
  result.seconds_teacher = seconds_since(t0);
  check_response_matches(resp, req);

  // 3. Per-token differences; per-sample sums for the standard error of the ratio estimate.
  std::vector<double> seq_sum, seq_len;
  double sum = 0, sum_q = 0, sum_p = 0;
  for (size_t s = 0; s < who.size(); ++s) {
    const SampleOutput& smp = outputs[who[s].first].samples[who[s].second];
    const int64_t r0 = resp.row_offsets[s];
    double ss = 0;
    for (size_t t = 0; t < smp.ids.size(); ++t) {
      const double lq = smp.sampling_logprobs[t];
      const double lp = resp.actual_logprobs[static_cast<size_t>(r0) + t];
      OPD_CHECK(std::isfinite(lq) && std::isfinite(lp), InvalidData, "eval reverse-kl: ",
                data[who[s].first].source, " sample ", who[s].second, " token ", t, " (id ",
                smp.ids[t], "): log q = ", lq, ", log p = ", lp, " (non-finite)");
      ss += lq - lp;
      sum_q += lq;
      sum_p += lp;
    }
    sum += ss;
    seq_sum.push_back(ss);
    seq_len.push_back(static_cast<double>(smp.ids.size()));
    result.tokens += static_cast<int64_t>(smp.ids.size());
    if (smp.finish_reason == FinishReason::Length) ++result.truncated;
    if (options.keep_samples) {
      ReverseKlSample k;
      k.prompt_index = static_cast<int64_t>(who[s].first);
      k.ids = smp.ids;
      k.student_logprobs = smp.sampling_logprobs;
      k.teacher_logprobs.assign(resp.actual_logprobs.begin() + r0,
                                resp.actual_logprobs.begin() + r0 + static_cast<int64_t>(smp.ids.size()));
      result.kept.push_back(std::move(k));
    }
  }
  result.prompts = static_cast<int64_t>(n);
  result.samples = static_cast<int64_t>(who.size());
  const double tokens = static_cast<double>(result.tokens);
  result.mean = sum / tokens;
  result.student_logprob = sum_q / tokens;
  result.teacher_logprob = sum_p / tokens;
  // Ratio estimator R = sum s_i / sum n_i over m samples: se^2 = sum (s_i - R n_i)^2 /
  // (m (m - 1) nbar^2) (the delta method; samples of one prompt are treated as independent).
  const size_t m = seq_sum.size();
  if (m >= 2) {
    double v = 0;
    for (size_t i = 0; i < m; ++i) v += std::pow(seq_sum[i] - result.mean * seq_len[i], 2);
    const double nbar = tokens / static_cast<double>(m);
    result.std_error = std::sqrt(v / (static_cast<double>(m) * static_cast<double>(m - 1))) / nbar;
  }
  return result;
}

AgreementResult evaluate_agreement(const Transformer& student, const std::vector<int32_t>& student_eos,
                                   const Transformer& teacher, const std::vector<int32_t>& teacher_eos,
                                   const Dataset& data, const AgreementOptions& options,
                                   const Tokenizer* tokenizer) {
  OPD_CHECK(options.tokens >= 1, InvalidArgument, "eval agreement: tokens ", options.tokens,
            " must be >= 1");
  const size_t n = prompt_count(data, options.limit);
  OPD_CHECK(n > 0, InvalidArgument, "eval agreement: no prompts");
  std::vector<GenerationRequest> requests(n);
  for (size_t i = 0; i < n; ++i) {
    requests[i].prompt = data[i].prompt_ids;
    requests[i].sampling.temperature = 0;
    requests[i].max_new_tokens = options.tokens;
  }
  EngineOptions eo;
  eo.kv_cache_bytes = static_cast<int64_t>(options.kv_cache_gb * (1 << 30));
  eo.on_progress = options.on_progress;
  auto greedy = [&](const Transformer& m, const std::vector<int32_t>& eos) {
    RolloutEngine engine(m, eo, eos);
    return engine.generate(requests);
  };
  const auto s_out = greedy(student, student_eos);
  const auto t_out = greedy(teacher, teacher_eos);
  AgreementResult r;
  for (size_t i = 0; i < n; ++i) {
    const auto& a = s_out[i].samples.at(0).ids;
    const auto& b = t_out[i].samples.at(0).ids;
    const size_t la = std::min(a.size(), static_cast<size_t>(options.tokens));
    const size_t lb = std::min(b.size(), static_cast<size_t>(options.tokens));
    const size_t common = std::min(la, lb);
    size_t prefix = 0;
    while (prefix < common && a[prefix] == b[prefix]) ++prefix;
    int64_t agree = 0;
    for (size_t t = 0; t < common; ++t) agree += a[t] == b[t];
    ++r.prompts;
    r.compared_tokens += static_cast<int64_t>(std::max(la, lb));
    r.agreeing_tokens += agree;
    r.prefix_tokens += static_cast<int64_t>(prefix);
    const bool exact = la == lb && prefix == la;
    if (exact) {
      ++r.exact;
    } else if (static_cast<int64_t>(r.examples.size()) < options.max_examples) {
      auto show = [&](const std::vector<int32_t>& ids, size_t len) {
        std::span<const int32_t> head(ids.data(), len);
        if (!tokenizer) return ids_str(std::vector<int32_t>(head.begin(), head.end()));
        std::string quoted(1, '"');
        quoted += tokenizer->decode(head);
        quoted += '"';
        return quoted;
      };
      r.examples.push_back(data[i].source + ": student " + show(a, la) + " | teacher " + show(b, lb));
    }
  }
  return r;
}

}  // namespace opd
