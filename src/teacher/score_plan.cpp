// Forward plan shared by the in-process scorers (what and why in teacher/score_plan.h): dedupe
// of prefix-contained sequences, packing, shared-prompt groups and their cost model, and the
// paged run of those groups.
#include "teacher/score_plan.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <span>
#include <unordered_map>

#include "core/error.h"
#include "model/kv_cache.h"
#include "model/paged_forward.h"
#include "tokenizer/fingerprint.h"

namespace opd {

namespace {

// Distinct forwards: carriers (longest first, so a carrier is seen before its prefixes) and the
// sequences each one serves.
struct Carriers {
  std::vector<size_t> carrier;              // sequence index of each carrier
  std::vector<std::vector<size_t>> members;  // per carrier: the sequences it serves
};

Carriers find_carriers(const std::vector<std::vector<int32_t>>& fwd,
                       const std::vector<std::pair<int64_t, int64_t>>& need) {
  std::vector<size_t> order;
  for (size_t s = 0; s < fwd.size(); ++s)
    if (need[s].second > need[s].first) order.push_back(s);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return fwd[a].size() > fwd[b].size(); });
  Carriers c;
  std::unordered_map<int32_t, std::vector<size_t>> by_first;  // first token -> carrier slots
  for (size_t s : order) {
    const auto& t = fwd[s];
    bool found = false;
    for (size_t slot : by_first[t[0]]) {
      const auto& f = fwd[c.carrier[slot]];
      if (f.size() >= t.size() && std::memcmp(f.data(), t.data(), t.size() * 4) == 0) {
        c.members[slot].push_back(s);
        found = true;
        break;
      }
    }
    if (!found) {
      by_first[t[0]].push_back(c.carrier.size());
      c.carrier.push_back(s);
      c.members.push_back({s});
    }
  }
  return c;
}

// Packs the carriers `slots` (in order) into dense batches of at most max_batch_tokens tokens.
void pack_dense(const std::vector<std::vector<int32_t>>& fwd,
                const std::vector<std::pair<int64_t, int64_t>>& need, const Carriers& c,
                const std::vector<size_t>& slots, int64_t max_batch_tokens, ScorePlan& plan) {
  size_t i = 0;
  while (i < slots.size()) {
    ScorePlan::ForwardBatch b;
    int64_t tokens = 0;
    size_t j = i;
    while (j < slots.size()) {
      const size_t slot = slots[j];
      const int64_t len = static_cast<int64_t>(fwd[c.carrier[slot]].size());
      if (j > i && tokens + len > max_batch_tokens) break;
      for (size_t s : c.members[slot]) {
        b.takes.push_back({s, tokens + need[s].first, need[s].second - need[s].first});
        plan.rows += need[s].second - need[s].first;
      }
      b.sequences.push_back(fwd[c.carrier[slot]]);
      tokens += len;
      ++j;
    }
    plan.batches.push_back(std::move(b));
    i = j;
  }
}

double attention_pairs(double q, double cached) { return q * cached + q * (q + 1) / 2; }

}  // namespace

std::string_view shared_prompt_mode_name(SharedPromptMode mode) {
  switch (mode) {
    case SharedPromptMode::Auto: return "auto";
    case SharedPromptMode::Always: return "always";
    case SharedPromptMode::Never: return "never";
  }
  return "?";
}

SharedPromptMode parse_shared_prompt_mode(std::string_view name) {
  if (name == "auto") return SharedPromptMode::Auto;
  if (name == "always") return SharedPromptMode::Always;
  if (name == "never") return SharedPromptMode::Never;
  OPD_FAIL(InvalidArgument, "shared-prompt mode '", name, "' is not one of auto, always, never");
}

SharedPromptCost shared_prompt_cost(const ModelConfig& c, int64_t prompt,
                                    const std::vector<int64_t>& suffix_lengths, double a) {
  const double H = static_cast<double>(c.hidden_size), I = static_cast<double>(c.intermediate_size);
  const double qd = static_cast<double>(c.num_attention_heads * c.head_dim);
  const double kvd = static_cast<double>(c.num_key_value_heads * c.head_dim);
  const double layers = static_cast<double>(c.num_hidden_layers);
  const double lin = 2 * layers * (H * qd + 2 * H * kvd + qd * H + 3 * H * I);
  const double att = 4 * qd * layers;  // per (query, key) pair: q.k and p.v, multiply-add
  const double P = static_cast<double>(prompt);
  SharedPromptCost cost;
  cost.shared = lin * P + a * att * attention_pairs(P, 0);
  for (int64_t len : suffix_lengths) {
    const double S = static_cast<double>(len);
    cost.dense += lin * (P + S) + att * attention_pairs(P + S, 0);
    cost.shared += lin * S + a * att * attention_pairs(S, P);
  }
  return cost;
}

ScorePlan plan_forwards(const std::vector<std::vector<int32_t>>& fwd,
                        const std::vector<std::pair<int64_t, int64_t>>& need,
                        int64_t max_batch_tokens) {
  OPD_CHECK(fwd.size() == need.size() && max_batch_tokens > 0, InvalidArgument,
            "plan_forwards: ", fwd.size(), " sequences, ", need.size(),
            " row ranges, max_batch_tokens ", max_batch_tokens);
  ScorePlan plan;
  const Carriers c = find_carriers(fwd, need);
  std::vector<size_t> all(c.carrier.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  pack_dense(fwd, need, c, all, max_batch_tokens, plan);
  plan.actual.resize(fwd.size());
  return plan;
}

namespace {

ScorePlan plan_with_shared(const std::vector<std::vector<int32_t>>& fwd,
                           const std::vector<std::pair<int64_t, int64_t>>& need,
                           int64_t max_batch_tokens, const ModelConfig& config,
                           const SharedPromptOptions& o) {
  OPD_CHECK(fwd.size() == need.size() && max_batch_tokens > 0, InvalidArgument,
            "plan_forwards: ", fwd.size(), " sequences, ", need.size(),
            " row ranges, max_batch_tokens ", max_batch_tokens);
  OPD_CHECK(o.block_size > 0 && o.min_prompt_tokens >= 0 && std::isfinite(o.paged_attention_cost) &&
                o.paged_attention_cost > 0,
            InvalidArgument, "shared-prompt options: block_size ", o.block_size,
            " (> 0), min_prompt_tokens ", o.min_prompt_tokens, " (>= 0), paged_attention_cost ",
            o.paged_attention_cost, " (finite, > 0)");
  ScorePlan plan;
  const Carriers c = find_carriers(fwd, need);
  const int64_t bs = o.block_size;
  // Each carrier's longest shareable prompt: the rows before the first one any of its sequences
  // needs, cut to whole blocks. Eligible carriers sorted by those tokens, so carriers with a
  // common prompt are adjacent and the common prefix of a run is the minimum of its adjacent
  // ones; a run whose common prefix (whole blocks) stays >= the minimum is one group.
  const int64_t min_prompt = std::max<int64_t>(o.min_prompt_tokens, 1);
  std::vector<int64_t> prompt_len(c.carrier.size(), 0);
  std::vector<size_t> dense, eligible;
  for (size_t slot = 0; slot < c.carrier.size(); ++slot) {
    int64_t first = INT64_MAX;
    for (size_t s : c.members[slot]) first = std::min(first, need[s].first);
    prompt_len[slot] = first / bs * bs;
    if (o.mode == SharedPromptMode::Never || prompt_len[slot] < min_prompt) dense.push_back(slot);
    else eligible.push_back(slot);
  }
  auto tokens = [&](size_t slot) { return fwd[c.carrier[slot]].data(); };
  std::stable_sort(eligible.begin(), eligible.end(), [&](size_t x, size_t y) {
    return std::lexicographical_compare(tokens(x), tokens(x) + prompt_len[x], tokens(y),
                                        tokens(y) + prompt_len[y]);
  });
  std::vector<std::vector<size_t>> groups;
  std::vector<int64_t> group_prompt;
  for (size_t i = 0; i < eligible.size(); ++i) {
    const size_t slot = eligible[i];
    if (i > 0) {
      const size_t prev = eligible[i - 1];
      const int64_t limit = std::min(prompt_len[prev], prompt_len[slot]);
      int64_t lcp = 0;
      while (lcp < limit && tokens(prev)[lcp] == tokens(slot)[lcp]) ++lcp;
      const int64_t common = std::min(group_prompt.back(), lcp / bs * bs);
      if (common >= min_prompt) {
        groups.back().push_back(slot);
        group_prompt.back() = common;
        continue;
      }
    }
    groups.push_back({slot});
    group_prompt.push_back(prompt_len[slot]);
  }
  for (size_t gi = 0; gi < groups.size(); ++gi)
    for (size_t slot : groups[gi]) prompt_len[slot] = group_prompt[gi];
  std::vector<std::vector<size_t>> shared;
  for (auto& g : groups) {
    bool share = g.size() >= 2;
    if (share && o.mode == SharedPromptMode::Auto) {
      std::vector<int64_t> suffix;
      for (size_t slot : g)
        suffix.push_back(static_cast<int64_t>(fwd[c.carrier[slot]].size()) - prompt_len[g[0]]);
      const SharedPromptCost cost =
          shared_prompt_cost(config, prompt_len[g[0]], suffix, o.paged_attention_cost);
      share = cost.shared < cost.dense;
    }
    if (share) shared.push_back(std::move(g));
    else dense.insert(dense.end(), g.begin(), g.end());
  }
  std::sort(dense.begin(), dense.end());  // carrier order, as without sharing
  pack_dense(fwd, need, c, dense, max_batch_tokens, plan);

  plan.block_size = bs;
  for (const auto& g : shared) {
    const int64_t P = prompt_len[g[0]];
    ScorePlan::SharedGroup sg;
    const auto& first = fwd[c.carrier[g[0]]];
    sg.prompt.assign(first.begin(), first.begin() + P);
    size_t i = 0;
    while (i < g.size()) {
      ScorePlan::SharedGroup::Step st;
      int64_t tokens = 0, blocks = P / bs;
      size_t j = i;
      while (j < g.size()) {
        const size_t slot = g[j];
        const auto& f = fwd[c.carrier[slot]];
        const int64_t len = static_cast<int64_t>(f.size()) - P;
        if (j > i && tokens + len > max_batch_tokens) break;
        for (size_t s : c.members[slot]) {
          st.takes.push_back({s, tokens + need[s].first - P, need[s].second - need[s].first});
          plan.rows += need[s].second - need[s].first;
        }
        st.suffixes.emplace_back(f.begin() + P, f.end());
        tokens += len;
        blocks += (len + bs - 1) / bs;
        ++j;
      }
      plan.cache_blocks = std::max(plan.cache_blocks, blocks);
      sg.steps.push_back(std::move(st));
      i = j;
    }
    plan.shared.push_back(std::move(sg));
  }
  plan.actual.resize(fwd.size());
  return plan;
}

void request_forwards(const ScoreRequest& req, std::vector<std::vector<int32_t>>& fwd,
                      std::vector<std::pair<int64_t, int64_t>>& need) {
  const size_t n = req.sequences.size();
  fwd.assign(n, {});
  need.assign(n, {0, 0});
  for (size_t s = 0; s < n; ++s) {
    const ScoreSequence& q = req.sequences[s];
    if (q.end > q.begin) {
      fwd[s].assign(q.ids.begin(), q.ids.begin() + (q.end - 1));
      need[s] = {q.begin - 1, q.end - 1};
    }
  }
}

void fill_actual(const ScoreRequest& req, ScorePlan& plan) {
  for (size_t s = 0; s < req.sequences.size(); ++s) {
    const ScoreSequence& q = req.sequences[s];
    if (q.end > q.begin) plan.actual[s].assign(q.ids.begin() + q.begin, q.ids.begin() + q.end);
  }
}

}  // namespace

ScorePlan plan_score_request(const ScoreRequest& req, int64_t max_batch_tokens) {
  std::vector<std::vector<int32_t>> fwd;
  std::vector<std::pair<int64_t, int64_t>> need;
  request_forwards(req, fwd, need);
  ScorePlan plan = plan_forwards(fwd, need, max_batch_tokens);
  fill_actual(req, plan);
  return plan;
}

ScorePlan plan_score_request(const ScoreRequest& req, int64_t max_batch_tokens,
                             const ModelConfig& config, const SharedPromptOptions& shared) {
  std::vector<std::vector<int32_t>> fwd;
  std::vector<std::pair<int64_t, int64_t>> need;
  request_forwards(req, fwd, need);
  ScorePlan plan = plan_with_shared(fwd, need, max_batch_tokens, config, shared);
  fill_actual(req, plan);
  return plan;
}

void run_shared_prompts(const ScorePlan& plan, const PagedForward& forward, KvCache& cache,
                        int64_t max_batch_tokens, const ConsumeHidden& consume) {
  if (plan.shared.empty()) return;
  const int64_t bs = plan.block_size;
  OPD_CHECK(cache.block_size() == bs && cache.num_blocks() >= plan.cache_blocks &&
                max_batch_tokens > 0,
            InvalidArgument, "shared prompts: cache of ", cache.num_blocks(), " blocks of ",
            cache.block_size(), " for a plan of ", plan.cache_blocks, " blocks of ", bs);
  for (const ScorePlan::SharedGroup& g : plan.shared) {
    const int64_t P = static_cast<int64_t>(g.prompt.size());
    std::vector<int32_t> prompt_table(static_cast<size_t>(P / bs));
    for (size_t b = 0; b < prompt_table.size(); ++b) prompt_table[b] = static_cast<int32_t>(b);
    // The prompt's K/V, in chunks (its hidden rows are not needed).
    for (int64_t at = 0; at < P; at += max_batch_tokens) {
      const int64_t n = std::min(max_batch_tokens, P - at);
      PagedStep step;
      step.add(std::span<const int32_t>(g.prompt.data() + at, static_cast<size_t>(n)), at,
               prompt_table);
      (void)forward.step_hidden(step, cache);
    }
    for (const auto& st : g.steps) {
      std::vector<std::vector<int32_t>> tables;
      int32_t next = static_cast<int32_t>(P / bs);
      for (const auto& suf : st.suffixes) {
        std::vector<int32_t> t = prompt_table;
        const int64_t blocks = (static_cast<int64_t>(suf.size()) + bs - 1) / bs;
        for (int64_t b = 0; b < blocks; ++b) t.push_back(next++);
        tables.push_back(std::move(t));
      }
      PagedStep step;
      for (size_t i = 0; i < st.suffixes.size(); ++i) step.add(st.suffixes[i], P, tables[i]);
      const Tensor h = forward.step_hidden(step, cache);
      consume(h, st.takes);
    }
  }
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
