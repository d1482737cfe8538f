// Exact-match evaluation with greedy generation (see eval.h).
#include "train/eval.h"

#include <algorithm>
#include <sstream>

#include "core/error.h"
#include "rollout/engine.h"

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

}  // namespace opd
