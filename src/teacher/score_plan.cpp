// Forward plan shared by the in-process scorers (what and why in teacher/score_plan.h).
#include "teacher/score_plan.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <unordered_map>

#include "core/error.h"
#include "tokenizer/fingerprint.h"

namespace opd {

ScorePlan plan_forwards(const std::vector<std::vector<int32_t>>& fwd,
                        const std::vector<std::pair<int64_t, int64_t>>& need,
                        int64_t max_batch_tokens) {
  OPD_CHECK(fwd.size() == need.size() && max_batch_tokens > 0, InvalidArgument,
            "plan_forwards: ", fwd.size(), " sequences, ", need.size(),
            " row ranges, max_batch_tokens ", max_batch_tokens);
  const size_t n = fwd.size();
  ScorePlan plan;
  // Dedupe: longest first so carriers are seen before their prefixes.
  std::vector<size_t> order;
  for (size_t s = 0; s < n; ++s)
    if (need[s].second > need[s].first) order.push_back(s);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return fwd[a].size() > fwd[b].size(); });
  std::vector<size_t> carriers;
  std::vector<std::vector<size_t>> members;                   // per carrier
  std::unordered_map<int32_t, std::vector<size_t>> by_first;  // first token -> carrier slots
  for (size_t s : order) {
    const auto& t = fwd[s];
    bool found = false;
    for (size_t slot : by_first[t[0]]) {
      const auto& c = fwd[carriers[slot]];
      if (c.size() >= t.size() && std::memcmp(c.data(), t.data(), t.size() * 4) == 0) {
        members[slot].push_back(s);
        found = true;
        break;
      }
    }
    if (!found) {
      by_first[t[0]].push_back(carriers.size());
      carriers.push_back(s);
      members.push_back({s});
    }
  }
  // Pack carriers into batches of at most max_batch_tokens tokens.
  size_t i = 0;
  while (i < carriers.size()) {
    ScorePlan::ForwardBatch b;
    int64_t tokens = 0;
    size_t j = i;
    while (j < carriers.size()) {
      const int64_t len = static_cast<int64_t>(fwd[carriers[j]].size());
      if (j > i && tokens + len > max_batch_tokens) break;
      for (size_t s : members[j]) {
        b.takes.push_back({s, tokens + need[s].first, need[s].second - need[s].first});
        plan.rows += need[s].second - need[s].first;
      }
      b.sequences.push_back(fwd[carriers[j]]);
      tokens += len;
      ++j;
    }
    plan.batches.push_back(std::move(b));
    i = j;
  }
  plan.actual.resize(n);
  return plan;
}

ScorePlan plan_score_request(const ScoreRequest& req, int64_t max_batch_tokens) {
  const size_t n = req.sequences.size();
  std::vector<std::vector<int32_t>> fwd(n);
  std::vector<std::pair<int64_t, int64_t>> need(n);
  for (size_t s = 0; s < n; ++s) {
    const ScoreSequence& q = req.sequences[s];
    if (q.end > q.begin) {
      fwd[s].assign(q.ids.begin(), q.ids.begin() + (q.end - 1));
      need[s] = {q.begin - 1, q.end - 1};
    }
  }
  ScorePlan plan = plan_forwards(fwd, need, max_batch_tokens);
  for (size_t s = 0; s < n; ++s) {
    const ScoreSequence& q = req.sequences[s];
    if (q.end > q.begin) plan.actual[s].assign(q.ids.begin() + q.begin, q.ids.begin() + q.end);
  }
  return plan;
}

ScoreResponse response_skeleton(const ScoreRequest& req, int64_t vocab_size) {
  ScoreResponse out;
  out.k = req.k;
  out.temperature = req.temperature;
  out.vocab_size = vocab_size;
  out.row_offsets.push_back(0);
  for (const ScoreSequence& q : req.sequences) {
    out.seq_begin.push_back(q.begin);
    out.row_offsets.push_back(out.row_offsets.back() + (q.end - q.begin));
  }
  return out;
}

void check_request_for(const ScoreRequest& req, const TeacherInfo& info,
                       const ScoreLimits& limits) {
  check_score_request(req, info.vocab_size, limits);
  OPD_CHECK(req.model_fingerprint.empty() || req.model_fingerprint == info.fingerprint,
            InvalidArgument, "score request: expects teacher fingerprint '", req.model_fingerprint,
            "' but this teacher (", info.model_name, ") is '", info.fingerprint, "'");
}

TeacherInfo describe_teacher(const std::string& dir, const ModelConfig& c) {
  TeacherInfo info;
  TokenizerFingerprint fp = tokenizer_fingerprint(dir, c.vocab_size);
  info.model_name = std::filesystem::path(dir).lexically_normal().filename().string();
  if (info.model_name.empty())
    info.model_name = std::filesystem::path(dir).lexically_normal().parent_path().filename().string();
  info.vocab_size = c.vocab_size;
  info.fingerprint = fp.sha256;
  info.has_tokenizer = fp.has_tokenizer;
  info.eos_token_ids = c.eos_token_ids;
  info.max_model_len = c.max_position_embeddings;
  return info;
}

}  // namespace opd
