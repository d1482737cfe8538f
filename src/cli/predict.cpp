// `opd predict --model DIR [--ids 1,2,3 ...] [--top K] [--generate N] [--json]`: runs the
// model's forward pass on the CPU over one or more token-id sequences (packed into one batch)
// and prints, per sequence, the next-token cross-entropy of the sequence, the top-K next-token
// predictions after its last token, and optionally a greedy continuation of N tokens.
// Until the tokenizer lands, input and output are token ids.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/log.h"
#include "cli/id_list.h"  // parse_id_list (make_batch checks the ids against the vocabulary)
#include "core/philox.h"
#include "model/transformer.h"

namespace opd::cli {
namespace {

struct PredictOptions {
  std::string model;
  std::vector<std::string> ids;
  int top = 5;
  int generate = 0;
  uint64_t seed = 0;
  bool json = false;
};

struct Prediction {
  std::vector<std::pair<int32_t, double>> top;  // (id, probability)
};

// Top-k of softmax(logits row) in double.
Prediction top_k(const float* row, int64_t vocab, int k) {
  double mx = -INFINITY;
  for (int64_t v = 0; v < vocab; ++v) mx = std::max(mx, static_cast<double>(row[v]));
  double z = 0;
  for (int64_t v = 0; v < vocab; ++v) z += std::exp(row[v] - mx);
  std::vector<int32_t> idx(static_cast<size_t>(vocab));
  for (int64_t v = 0; v < vocab; ++v) idx[static_cast<size_t>(v)] = static_cast<int32_t>(v);
  const int kk = static_cast<int>(std::min<int64_t>(k, vocab));
  std::partial_sort(idx.begin(), idx.begin() + kk, idx.end(), [&](int32_t a, int32_t b) {
    return row[a] != row[b] ? row[a] > row[b] : a < b;
  });
  Prediction p;
  for (int i = 0; i < kk; ++i) p.top.push_back({idx[i], std::exp(row[idx[i]] - mx) / z});
  return p;
}

void run_predict(const PredictOptions& o) {
  auto t0 = std::chrono::steady_clock::now();
  Transformer model = Transformer::load(o.model);
  const int64_t V = model.config().vocab_size;
  std::vector<std::vector<int32_t>> seqs;
  for (const auto& s : o.ids) seqs.push_back(parse_id_list(s, "--ids"));
  if (seqs.empty()) {  // a deterministic example batch: three prompts of different lengths
    for (int len : {12, 7, 3}) {
      std::vector<int32_t> s;
      for (int i = 0; i < len; ++i)
        s.push_back(static_cast<int32_t>(philox_u32(o.seed, static_cast<uint64_t>(len), i) % V));
      seqs.push_back(s);
    }
  }
  const int64_t ctx = model.config().max_position_embeddings;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t len = static_cast<int64_t>(seqs[i].size()) + o.generate;
    if (ctx > 0 && len > ctx)
      log_warn("sequence ", i, ": ", seqs[i].size(), " ids", o.generate ? cat(" + ", o.generate, " generated") : std::string(),
               " = ", len, " positions, past the model's max_position_embeddings ", ctx,
               ": positions beyond it were not trained");
  }
  Batch batch = make_batch(seqs, V);  // validates every id against the vocabulary
  Tensor logits = model.forward(batch);
  const int32_t* cu = batch.cu_seqlens.data<int32_t>();

  // Per-sequence next-token loss from the same logits.
  std::vector<double> seq_loss(seqs.size(), 0.0);
  for (size_t b = 0; b < seqs.size(); ++b) {
    const int64_t n = static_cast<int64_t>(seqs[b].size());
    if (n < 2) continue;
    std::vector<std::vector<int32_t>> one = {seqs[b]};
    Batch single = make_batch(one, V);
    seq_loss[b] = causal_lm_loss(single, logits.slice_rows(cu[b], cu[b + 1]), nullptr);
  }

  nlohmann::json out = nlohmann::json::array();
  for (size_t b = 0; b < seqs.size(); ++b) {
    nlohmann::json j;
    j["ids"] = seqs[b];
    if (seqs[b].empty()) {
      j["error"] = "empty sequence: nothing to predict from";
      out.push_back(j);
      continue;
    }
    const float* last = logits.data<float>() + static_cast<int64_t>(cu[b + 1] - 1) * V;
    Prediction p = top_k(last, V, o.top);
    j["next_token_loss"] = seq_loss[b];
    for (auto& [id, prob] : p.top) j["top"].push_back({{"id", id}, {"prob", prob}});
    if (o.generate > 0) {  // greedy continuation by full re-forward (the rollout engine caches)
      std::vector<int32_t> cont = seqs[b];
      for (int g = 0; g < o.generate; ++g) {
        Batch one = make_batch({cont}, V);
        Tensor lg = model.forward(one);
        Prediction best = top_k(lg.data<float>() + (one.num_tokens() - 1) * V, V, 1);
        cont.push_back(best.top[0].first);
      }
      j["greedy"] = std::vector<int32_t>(cont.begin() + static_cast<long>(seqs[b].size()), cont.end());
    }
    out.push_back(j);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (o.json) {
    std::printf("%s\n", out.dump().c_str());
    return;
  }
  std::printf("%s: %s, %lld sequences, %lld tokens, forward on CPU (%.2f s)\n", o.model.c_str(),
              architecture_name(model.config().arch), (long long)batch.num_sequences(),
              (long long)batch.num_tokens(), secs);
  for (size_t b = 0; b < out.size(); ++b) {
    const auto& j = out[b];
    std::string ids;
    for (int32_t id : seqs[b]) ids += cat(ids.empty() ? "" : ",", id);
    std::printf("\nsequence %zu  ids [%s]\n", b, ids.c_str());
    if (j.contains("error")) {
      std::printf("  %s\n", j["error"].get<std::string>().c_str());
      continue;
    }
    if (seqs[b].size() >= 2)
      std::printf("  next-token loss %.4f nats (perplexity %.2f)\n", seq_loss[b], std::exp(seq_loss[b]));
    std::printf("  next token after the last position:\n");
    for (const auto& t : j["top"])
      std::printf("    id %6d  p=%.4f\n", t["id"].get<int>(), t["prob"].get<double>());
    if (j.contains("greedy")) {
      std::string g;
      for (int32_t id : j["greedy"].get<std::vector<int32_t>>()) g += cat(g.empty() ? "" : ",", id);
      std::printf("  greedy continuation: [%s]\n", g.c_str());
    }
  }
}

}  // namespace

void register_predict(CLI::App& app) {
  auto o = std::make_shared<PredictOptions>();
  CLI::App* cmd = app.add_subcommand(
      "predict", "Forward pass on the CPU: next-token predictions for token-id sequences");
  cmd->add_option("--model", o->model, "Hugging Face model directory")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--ids", o->ids,
                  "a sequence as comma-separated token ids; repeat for a batch (default: three "
                  "seeded random sequences of lengths 12, 7, 3)");
  cmd->add_option("--top", o->top, "how many next-token candidates to print")
      ->default_val(5)
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--generate", o->generate, "greedy continuation length (0 = none)")
      ->default_val(0)
      ->check(CLI::Range(0, 4096));
  cmd->add_option("--seed", o->seed, "seed of the default example sequences")->default_val(0);
  cmd->add_flag("--json", o->json, "print one JSON array (one object per sequence)");
  cmd->callback([o] { run_predict(*o); });
}

}  // namespace opd::cli
