// Rollout engine: greedy generation equals the argmax of a full forward at every step and
// transformers' generate token for token (fixtures from tools/make_generate_fixtures.py); a
// sample does not depend on its batch, n, chunking, block size or preemption; continuous
// batching under max_running; stop conditions (EOS, stop token, stop strings across token
// boundaries, max tokens); progress reports; a KV budget too small for one sequence is a named
// error.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include "model/kv_cache.h"
#include "rollout/engine.h"
#include "rollout/stop.h"
#include "rollout_test_util.h"
#include "tokenizer/tokenizer.h"

namespace opd {
namespace {

using test::request;
using test::seeded_prompt;

int32_t argmax_row(const Tensor& logits, int64_t row) {
  const int64_t V = logits.dim(1);
  const float* z = logits.data<float>() + row * V;
  int64_t best = 0;
  for (int64_t v = 1; v < V; ++v)
    if (z[v] > z[best]) best = v;
  return static_cast<int32_t>(best);
}

double log_softmax_at(const Tensor& logits, int64_t row, int32_t id) {
  const int64_t V = logits.dim(1);
  const float* z = logits.data<float>() + row * V;
  double m = z[0], s = 0;
  for (int64_t v = 1; v < V; ++v) m = std::max(m, static_cast<double>(z[v]));
  for (int64_t v = 0; v < V; ++v) s += std::exp(z[v] - m);
  return z[id] - m - std::log(s);
}

class EngineFamilies : public ::testing::TestWithParam<const char*> {};

TEST_P(EngineFamilies, GreedyEqualsFullForwardArgmaxAtEveryStep) {
  Transformer model = Transformer::load(test::model_dir(GetParam()));
  const int64_t V = model.config().vocab_size;
  EngineOptions opt;
  opt.block_size = 4;
  opt.max_step_tokens = 7;  // prompts are prefilled in several chunks
  RolloutEngine engine(model, opt, {});
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 4; ++i) reqs.push_back(request(seeded_prompt(i, 3 + 5 * i, V), 20, 0.0, 0, 2));
  auto out = engine.generate(reqs);
  int64_t checked = 0;
  for (size_t r = 0; r < reqs.size(); ++r) {
    ASSERT_EQ(out[r].samples.size(), 2u);
    EXPECT_EQ(out[r].samples[0].ids, out[r].samples[1].ids);  // greedy: samples agree
    const SampleOutput& s = out[r].samples[0];
    ASSERT_EQ(s.ids.size(), 20u);
    EXPECT_EQ(s.finish_reason, FinishReason::Length);
    std::vector<int32_t> seq = reqs[r].prompt;
    seq.insert(seq.end(), s.ids.begin(), s.ids.end());
    Tensor logits = model.forward(make_batch({seq}, V));
    for (size_t k = 0; k < s.ids.size(); ++k) {
      const int64_t row = static_cast<int64_t>(reqs[r].prompt.size() + k) - 1;
      EXPECT_EQ(s.ids[k], argmax_row(logits, row)) << "request " << r << " step " << k;
      EXPECT_NEAR(s.model_logprobs[k], log_softmax_at(logits, row, s.ids[k]), 1e-5);
      EXPECT_EQ(s.sampling_logprobs[k], 0.0);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 80);
}

TEST_P(EngineFamilies, GreedyEqualsTransformersGenerate) {
  const std::string family = GetParam();
  nlohmann::json fx = test::generate_fixture(family);
  Transformer model = Transformer::load(test::model_dir(family));
  // The model directory's own EOS ids are what transformers used for the first case of each pair.
  EXPECT_EQ(generation_eos_ids(test::model_dir(family), model.config(), nullptr),
            fx["eos_token_ids"].get<std::vector<int32_t>>());
  int cases = 0;
  for (const auto& c : fx["greedy"]) {
    const std::vector<int32_t> eos = c["eos_token_ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> want = c["expected"].get<std::vector<int32_t>>();
    EngineOptions opt;
    opt.block_size = 8;
    RolloutEngine engine(model, opt, eos);
    auto out = engine.generate({request(c["prompt"].get<std::vector<int32_t>>(),
                                        fx["max_new_tokens"].get<int64_t>(), 0.0)});
    const SampleOutput& s = out[0].samples[0];
    size_t first_diff = 0;
    while (first_diff < std::min(s.ids.size(), want.size()) && s.ids[first_diff] == want[first_diff])
      ++first_diff;
    EXPECT_EQ(s.ids, want) << family << " case " << cases << ": first divergence at step "
                           << first_diff;
    const bool ended_on_eos = std::find(eos.begin(), eos.end(), want.back()) != eos.end();
    EXPECT_EQ(s.finish_reason, ended_on_eos ? FinishReason::Eos : FinishReason::Length);
    ++cases;
  }
  EXPECT_EQ(cases, 6);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, EngineFamilies,
                         ::testing::Values("qwen3", "qwen2", "llama", "llama_bias"));

// Token ids equal and logprobs within fp32 noise: what "the same output" means across batches.
void expect_same_sample(const SampleOutput& a, const SampleOutput& b, const std::string& what) {
  EXPECT_EQ(a.ids, b.ids) << what;
  EXPECT_EQ(a.finish_reason, b.finish_reason) << what;
  ASSERT_EQ(a.model_logprobs.size(), b.model_logprobs.size()) << what;
  for (size_t k = 0; k < a.model_logprobs.size(); ++k) {
    EXPECT_NEAR(a.model_logprobs[k], b.model_logprobs[k], 1e-5) << what << " step " << k;
    EXPECT_NEAR(a.sampling_logprobs[k], b.sampling_logprobs[k], 1e-5) << what << " step " << k;
  }
}

GenerationRequest sampled(std::vector<int32_t> prompt, int64_t n, uint64_t seed) {
  GenerationRequest r = request(std::move(prompt), 18, 1.0, seed, n);
  r.sampling.top_p = 0.95;
  r.sampling.top_k = 40;
  r.ignore_eos = true;
  return r;
}

TEST(Engine, SampleDoesNotDependOnBatchNChunkingOrBlockSize) {
  Transformer model = Transformer::load(test::model_dir("qwen3"));
  const int64_t V = model.config().vocab_size;
  const std::vector<int32_t> a = seeded_prompt(1, 9, V), b = seeded_prompt(2, 4, V),
                             c = seeded_prompt(3, 15, V);
  RolloutEngine alone_engine(model, EngineOptions{}, {2});
  auto alone = alone_engine.generate({sampled(a, 1, 5)});
  auto alone2 = alone_engine.generate({sampled(a, 2, 5)});
  EXPECT_GE(std::set<int32_t>(alone[0].samples[0].ids.begin(), alone[0].samples[0].ids.end()).size(), 4u)
      << "sampling at T=1 should not be degenerate";
  EXPECT_NE(alone2[0].samples[0].ids, alone2[0].samples[1].ids);  // samples differ

  for (int64_t block_size : {1, 4, 16}) {
    for (int64_t step_tokens : {1, 5, 512}) {
      EngineOptions opt;
      opt.block_size = block_size;
      opt.max_step_tokens = step_tokens;
      RolloutEngine engine(model, opt, {2});
      auto out = engine.generate({sampled(b, 2, 9), sampled(a, 4, 5), sampled(c, 3, 5)});
      const std::string what = cat("block_size ", block_size, " max_step_tokens ", step_tokens);
      expect_same_sample(out[1].samples[0], alone[0].samples[0], what + " sample 0");
      expect_same_sample(out[1].samples[1], alone2[0].samples[1], what + " sample 1");
      EXPECT_EQ(engine.stats().preemptions, 0);
    }
  }
  // Seeds and stream keys select the stream: same prompt and seed repeat, others differ.
  RolloutEngine engine(model, EngineOptions{}, {2});
  GenerationRequest keyed = sampled(a, 1, 5);
  keyed.stream_key = 77;
  auto out = engine.generate({sampled(a, 1, 5), sampled(a, 1, 5), sampled(a, 1, 6), keyed});
  EXPECT_EQ(out[0].samples[0].ids, out[1].samples[0].ids);
  EXPECT_NE(out[0].samples[0].ids, out[2].samples[0].ids);
  EXPECT_NE(out[0].samples[0].ids, out[3].samples[0].ids);
}

TEST(Engine, AllocatesOnlyTheBlocksTheRequestsCanUse) {
  Transformer model = Transformer::load(test::model_dir("qwen3"));
  const int64_t V = model.config().vocab_size;
  EngineOptions o;
  o.block_size = 4;  // the default budget (1 GiB) buys far more blocks than these need
  RolloutEngine engine(model, o, {});
  // 5 + 9 - 1 = 13 tokens -> 4 blocks, x 2 samples; 2 + 3 - 1 = 4 tokens -> 1 block.
  engine.generate({request(seeded_prompt(1, 5, V), 9, 0.0, 0, 2), request(seeded_prompt(2, 2, V), 3, 0.0, 0, 1)});
  EXPECT_GT(engine.num_blocks(), 9);
  EXPECT_EQ(engine.stats().num_blocks, 9);
}

TEST(Engine, PreemptionUnderATinyBudgetGivesTheSameOutputs) {
  for (const char* family : {"qwen3", "llama"}) {
    Transformer model = Transformer::load(test::model_dir(family));
    const int64_t V = model.config().vocab_size;
    std::vector<GenerationRequest> reqs;
    for (int i = 0; i < 5; ++i) reqs.push_back(sampled(seeded_prompt(10 + i, 2 + 3 * i, V), 2 + i % 2, 20 + i));
    reqs.push_back(request(seeded_prompt(30, 7, V), 18, 0.0, 0, 2));  // greedy too
    EngineOptions big;
    big.block_size = 4;
    RolloutEngine roomy(model, big, {});
    auto want = roomy.generate(reqs);
    EXPECT_EQ(roomy.stats().preemptions, 0);
    // Budget: exactly the blocks of the longest sample alone (14 + 18 - 1 = 31 tokens = 8
    // blocks), and one more; with 16 samples running, sequences are evicted and recomputed.
    const int64_t block_bytes = KvCache::block_bytes(model.config(), 4, DType::F32);
    for (int64_t blocks : {8, 9, 13}) {
      for (int64_t step_tokens : {3, 64}) {
        EngineOptions tiny = big;
        tiny.kv_cache_bytes = blocks * block_bytes + block_bytes / 2;  // remainder unused
        tiny.max_step_tokens = step_tokens;
        RolloutEngine engine(model, tiny, {});
        EXPECT_EQ(engine.num_blocks(), blocks);
        auto got = engine.generate(reqs);
        EXPECT_GT(engine.stats().preemptions, 0) << blocks << " blocks";
        EXPECT_LE(engine.stats().peak_blocks_used, blocks);
        for (size_t r = 0; r < reqs.size(); ++r)
          for (size_t k = 0; k < want[r].samples.size(); ++k)
            expect_same_sample(got[r].samples[k], want[r].samples[k],
                               cat(family, " ", blocks, " blocks, step ", step_tokens,
                                   ": request ", r, " sample ", k));
        std::printf("%s: %lld blocks, max_step_tokens %lld: %lld preemptions, %lld tokens recomputed, %lld steps\n",
                    family, (long long)blocks, (long long)step_tokens,
                    (long long)engine.stats().preemptions,
                    (long long)engine.stats().recomputed_tokens, (long long)engine.stats().steps);
      }
    }
  }
}

TEST(Engine, ContinuousBatchingAdmitsAsSequencesFinish) {
  Transformer model = Transformer::load(test::model_dir("qwen2"));
  const int64_t V = model.config().vocab_size;
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 6; ++i) {
    reqs.push_back(sampled(seeded_prompt(40 + i, 5, V), 1, 3));
    reqs.back().max_new_tokens = 3 + 4 * i;  // different lengths: finish at different steps
  }
  RolloutEngine wide(model, EngineOptions{}, {});
  auto want = wide.generate(reqs);
  EXPECT_EQ(wide.stats().max_batch, 6);
  EngineOptions narrow;
  narrow.max_running = 2;
  RolloutEngine engine(model, narrow, {});
  auto got = engine.generate(reqs);
  EXPECT_EQ(engine.stats().max_batch, 2);
  // 3+7+...+23 = 78 decode-or-prefill rounds over 2 slots: more steps than the longest request.
  EXPECT_GT(engine.stats().steps, wide.stats().steps);
  for (size_t r = 0; r < reqs.size(); ++r) {
    expect_same_sample(got[r].samples[0], want[r].samples[0], cat("request ", r));
    EXPECT_EQ(got[r].samples[0].ids.size(), static_cast<size_t>(reqs[r].max_new_tokens));
  }
}

// EngineOptions::on_progress: one report per step; finished samples only grow and end at every
// sample; the generated-token count ends at the sum of the completions' lengths.
TEST(Engine, ProgressReportsEveryStepUpToAllSamples) {
  Transformer model = Transformer::load(test::model_dir("qwen2"));
  const int64_t V = model.config().vocab_size;
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 4; ++i) {
    reqs.push_back(sampled(seeded_prompt(60 + i, 5, V), /*n=*/2, /*seed=*/3));
    reqs.back().max_new_tokens = 2 + 3 * i;
  }
  std::vector<GenerationProgress> seen;
  EngineOptions eo;
  eo.max_running = 3;
  eo.on_progress = [&](const GenerationProgress& p) { seen.push_back(p); };
  RolloutEngine engine(model, eo, {});
  auto out = engine.generate(reqs);
  ASSERT_EQ(static_cast<int64_t>(seen.size()), engine.stats().steps);
  int64_t tokens = 0;
  for (const auto& r : out)
    for (const auto& smp : r.samples) tokens += static_cast<int64_t>(smp.ids.size());
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].total_samples, 8);
    EXPECT_EQ(seen[i].steps, static_cast<int64_t>(i) + 1);
    if (i > 0) {
      EXPECT_GE(seen[i].finished_samples, seen[i - 1].finished_samples);
      EXPECT_GE(seen[i].generated_tokens, seen[i - 1].generated_tokens);
    }
  }
  EXPECT_EQ(seen.back().finished_samples, 8);
  EXPECT_EQ(seen.back().generated_tokens, tokens);
  EXPECT_LT(seen[seen.size() / 2].finished_samples, 8);  // reported along the way, not only at the end
}

TEST(Engine, StopsOnEosStopTokenAndMaxTokens) {
  Transformer model = Transformer::load(test::model_dir("llama"));
  const int64_t V = model.config().vocab_size;
  GenerationRequest base = sampled(seeded_prompt(50, 6, V), 1, 11);
  RolloutEngine free_run(model, EngineOptions{}, {});
  const std::vector<int32_t> ids = free_run.generate({base})[0].samples[0].ids;
  ASSERT_EQ(ids.size(), 18u);
  // The first token whose first occurrence is at step >= 3 becomes EOS / the stop token.
  const size_t k = test::first_fresh_token(ids);
  ASSERT_LT(k, ids.size());
  const std::vector<int32_t> prefix(ids.begin(), ids.begin() + static_cast<long>(k) + 1);

  RolloutEngine with_eos(model, EngineOptions{}, {ids[k]});
  GenerationRequest r = base;
  r.ignore_eos = false;
  SampleOutput s = with_eos.generate({r})[0].samples[0];
  EXPECT_EQ(s.ids, prefix);
  EXPECT_EQ(s.finish_reason, FinishReason::Eos);
  EXPECT_EQ(s.model_logprobs.size(), prefix.size());
  r.ignore_eos = true;  // the other side of the flag
  s = with_eos.generate({r})[0].samples[0];
  EXPECT_EQ(s.ids, ids);
  EXPECT_EQ(s.finish_reason, FinishReason::Length);

  test::expect_stop_token_and_max_tokens(free_run, base, ids, k);
}

// The Qwen3 tokenizer on the Qwen3 fixture model: its ids 0..93 are the single printable ASCII
// characters '!'..'~' (byte-level BPE base tokens), so every token of the fixture's 96-token
// vocabulary decodes to one byte and a multi-character stop string always spans tokens.
TEST(Engine, StopStringsAcrossTokenBoundaries) {
  Transformer model = Transformer::load(test::model_dir("qwen3"));
  Tokenizer tok = Tokenizer::load(test::fixture_path("tokenizers/qwen3"));
  const int64_t V = model.config().vocab_size;
  GenerationRequest base = sampled(seeded_prompt(60, 5, V), 1, 4);
  base.max_new_tokens = 30;
  RolloutEngine engine(model, EngineOptions{}, {}, &tok);
  SampleOutput full = engine.generate({base})[0].samples[0];
  ASSERT_EQ(full.ids.size(), 30u);
  const std::string text = tok.decode(full.ids);  // one-shot decode: independent of the engine's
  ASSERT_TRUE(full.text.has_value());
  EXPECT_EQ(*full.text, text);

  for (size_t start : {0ul, 7ul, 20ul}) {
    for (size_t len : {2ul, 3ul, 5ul}) {
      const std::string stop = text.substr(start, len);
      GenerationRequest r = base;
      r.stop = {"never-in-96-token-text~~~", stop};
      const size_t at = text.find(stop);  // the first occurrence may be before `start`
      // The token completing the stop string: the shortest prefix whose decode covers it.
      size_t k = 0;
      while (tok.decode(std::vector<int32_t>(full.ids.begin(), full.ids.begin() + static_cast<long>(k) + 1)).size() <
             at + stop.size())
        ++k;
      SampleOutput s = engine.generate({r})[0].samples[0];
      EXPECT_EQ(s.ids, std::vector<int32_t>(full.ids.begin(), full.ids.begin() + static_cast<long>(k) + 1))
          << "stop '" << stop << "'";
      EXPECT_EQ(s.finish_reason, FinishReason::Stop);
      EXPECT_EQ(s.stop, stop);
      EXPECT_EQ(s.text, text.substr(0, at)) << "text ends before the stop string";
    }
  }
  // A stop string that never occurs: the sample runs to max_new_tokens.
  GenerationRequest r = base;
  r.stop = {"never-in-96-token-text~~~"};
  SampleOutput s = engine.generate({r})[0].samples[0];
  EXPECT_EQ(s.ids, full.ids);
  EXPECT_EQ(s.finish_reason, FinishReason::Length);
}

TEST(CompletionText, FindsTheEarliestStopAndHoldsIncompleteCharacters) {
  Tokenizer tok = Tokenizer::load(test::fixture_path("tokenizers/qwen3"));
  // "é" is two bytes; in the byte-level vocabulary each byte alone is a token.
  const std::vector<int32_t> e_acute = tok.encode("é");
  std::vector<int32_t> bytes;
  for (unsigned char ch : std::string("é")) {
    std::string one(1, static_cast<char>(ch));
    // find the single-byte token for this byte by decoding candidates
    for (int32_t id = 0; id < 256; ++id)
      if (tok.token_bytes(id) == one) {
        bytes.push_back(id);
        break;
      }
  }
  ASSERT_EQ(bytes.size(), 2u);
  CompletionText t(tok, {"xé", "éy"});
  for (int32_t id : tok.encode("abx")) EXPECT_FALSE(t.push(id));
  EXPECT_FALSE(t.push(bytes[0]));  // half a character: nothing emitted, no match yet
  EXPECT_EQ(t.text(), "abx");
  EXPECT_TRUE(t.push(bytes[1]));
  EXPECT_EQ(t.text(), "ab");
  EXPECT_EQ(*t.matched(), "xé");
  try {
    t.push(bytes[0]);
    ADD_FAILURE() << "push after a match accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("after the stop string"), std::string::npos);
  }
  CompletionText u(tok, {});
  u.push(bytes[0]);
  u.finish();
  EXPECT_EQ(u.text(), "\xEF\xBF\xBD");  // an unfinished character becomes U+FFFD
  (void)e_acute;
}

// One engine for successive rollouts with the weights updated in place between them (how the
// trainer uses it: engine kept across steps, AdamW writing the same tensors) gives what a
// fresh engine gives on the updated weights. On the CPU nothing device-side is kept; the CUDA
// version (CudaRollout.KeptDeviceState...) checks the kept packed weights and graphs.
TEST(Engine, AnEngineKeptAcrossInPlaceWeightUpdatesEqualsAFreshOne) {
  Transformer model = Transformer::load(test::model_dir("qwen3"));
  const int64_t V = model.config().vocab_size;
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 3; ++i) {
    GenerationRequest r = request(seeded_prompt(40 + i, 5 + i, V), 9, 1.0, 70 + i, 2);
    r.ignore_eos = true;
    reqs.push_back(r);
  }
  RolloutEngine kept(model, EngineOptions{}, {});
  const auto before = kept.generate(reqs);
  for (LayerWeights& L : model.weights().layers) {
    float* w = L.q_proj.data<float>();
    for (int64_t i = 0; i < L.q_proj.numel(); ++i) w[i] *= (i % 3 == 0) ? 1.7f : 0.6f;
  }
  const auto after = kept.generate(reqs);
  const auto want = RolloutEngine(model, EngineOptions{}, {}).generate(reqs);
  bool changed = false;
  for (size_t r = 0; r < reqs.size(); ++r) {
    for (size_t k = 0; k < 2; ++k) {
      EXPECT_EQ(after[r].samples[k].ids, want[r].samples[k].ids) << "request " << r;
      EXPECT_EQ(after[r].samples[k].model_logprobs, want[r].samples[k].model_logprobs);
      changed = changed || after[r].samples[k].ids != before[r].samples[k].ids;
    }
  }
  EXPECT_TRUE(changed) << "the update did not change any sample";
}

TEST(Engine, BudgetTooSmallForOneSequenceIsANamedError) {
  Transformer model = Transformer::load(test::model_dir("qwen3"));
  const int64_t V = model.config().vocab_size;
  const int64_t block_bytes = KvCache::block_bytes(model.config(), 4, DType::F32);
  EngineOptions opt;
  opt.block_size = 4;
  opt.kv_cache_bytes = 5 * block_bytes;  // 20 token slots
  RolloutEngine engine(model, opt, {});
  // 10 + 11 - 1 = 20 slots fit exactly; one more token does not.
  auto ok = engine.generate({request(seeded_prompt(1, 10, V), 11, 0.0)});
  EXPECT_EQ(ok[0].samples[0].ids.size(), 11u);
  try {
    engine.generate({request(seeded_prompt(1, 3, V), 4, 0.0), request(seeded_prompt(1, 10, V), 12, 0.0)});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::OutOfMemory);
    const std::string msg = e.what();
    for (const char* part : {"request 1", "10 prompt tokens + max_new_tokens 12", "K/V for 21 tokens",
                             "6 blocks of 4 tokens", "holds only 5 blocks"})
      EXPECT_NE(msg.find(part), std::string::npos) << part << " missing from: " << msg;
  }
  opt.kv_cache_bytes = block_bytes - 1;
  RolloutEngine none(model, opt, {});
  try {
    none.generate({request(seeded_prompt(1, 3, V), 4, 0.0)});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::OutOfMemory);
    EXPECT_NE(std::string(e.what()).find("is less than one KV block"), std::string::npos) << e.what();
  }
}

TEST(Engine, RejectsBadRequests) {
  Transformer model = Transformer::load(test::model_dir("qwen3"));
  RolloutEngine engine(model, EngineOptions{}, {2});
  auto error_of = [&](const GenerationRequest& r) -> std::string {
    try {
      engine.generate({request({1, 2}, 2, 0.0), r});
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(error_of(request({5, 96, 7}, 2, 0.0)).find(
                "request 1: prompt token id 96 at position 1 is outside the vocabulary [0, 96)"),
            std::string::npos);
  EXPECT_NE(error_of(request({5, -1}, 2, 0.0)).find("prompt token id -1 at position 1"), std::string::npos);
  EXPECT_NE(error_of(request({}, 2, 0.0)).find("request 1: the prompt is empty"), std::string::npos);
  EXPECT_NE(error_of(request({1}, 0, 0.0)).find("max_new_tokens must be >= 1, got 0"), std::string::npos);
  EXPECT_NE(error_of(request({1}, 2, 0.0, 0, 0)).find("n must be >= 1, got 0"), std::string::npos);
  EXPECT_NE(error_of(request({1}, 2, -0.5)).find("request 1: temperature must be"), std::string::npos);
  GenerationRequest r = request({1}, 2, 1.0);
  r.stop = {"x"};
  EXPECT_NE(error_of(r).find("stop strings need a tokenizer"), std::string::npos);
  r = request({1}, 2, 1.0);
  r.stop_token_ids = {100};
  EXPECT_NE(error_of(r).find("stop token id 100 is outside the vocabulary"), std::string::npos);
  try {
    RolloutEngine bad(model, EngineOptions{}, {96});
    ADD_FAILURE() << "EOS outside the vocabulary accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("EOS token id 96 is outside the vocabulary [0, 96)"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace opd

namespace opd {
namespace {

// EOS ids come from config.json, generation_config.json (int or list) and the tokenizer.
TEST(GenerationEosIds, UnionOfConfigGenerationConfigAndTokenizer) {
  Transformer model = Transformer::load(test::model_dir("qwen3"));  // config eos_token_id 2
  const std::string dir = ::testing::TempDir() + "opd_eos_ids_" + std::to_string(::getpid()) + "";
  std::filesystem::create_directories(dir);
  auto write_gen = [&](const std::string& body) {
    std::ofstream(dir + "/generation_config.json") << body;
  };
  std::filesystem::remove(dir + "/generation_config.json");
  EXPECT_EQ(generation_eos_ids(dir, model.config(), nullptr), std::vector<int32_t>({2}));
  write_gen(R"({"eos_token_id": 7, "do_sample": true})");
  EXPECT_EQ(generation_eos_ids(dir, model.config(), nullptr), std::vector<int32_t>({2, 7}));
  write_gen(R"({"eos_token_id": [7, 2, 9]})");
  EXPECT_EQ(generation_eos_ids(dir, model.config(), nullptr), std::vector<int32_t>({2, 7, 9}));
  write_gen(R"({"eos_token_id": null})");
  EXPECT_EQ(generation_eos_ids(dir, model.config(), nullptr), std::vector<int32_t>({2}));
  // The Qwen3 tokenizer's EOS (<|im_end|>, 151645) is outside this 96-token model: skipped.
  Tokenizer tok = Tokenizer::load(test::fixture_path("tokenizers/qwen3"));
  ASSERT_TRUE(tok.eos_id().has_value());
  EXPECT_EQ(generation_eos_ids(dir, model.config(), &tok), std::vector<int32_t>({2}));
  const std::pair<std::string, std::string> bad[] = {
      {R"({"eos_token_id": 96})", "eos_token_id 96 is outside the vocabulary [0, 96)"},
      {R"({"eos_token_id": "2"})", "must be an integer or a list"},
      {R"({"eos_token_id": [1, 2.5]})", "entries must be integers"},
      {R"([1])", "not a JSON object"},
  };
  for (const auto& [body, part] : bad) {
    write_gen(body);
    try {
      generation_eos_ids(dir, model.config(), nullptr);
      ADD_FAILURE() << "accepted " << body;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidData);
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("generation_config.json"), std::string::npos) << e.what();
    }
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace opd

namespace opd {
namespace {

TEST(Engine, CancelStopsGenerationWithANamedError) {
  Transformer model = Transformer::load(test::model_dir("qwen3"));
  const int64_t V = model.config().vocab_size;
  GenerationRequest r = sampled(seeded_prompt(60, 5, V), 1, 4);
  r.max_new_tokens = 30;
  EngineOptions opt;
  int polls = 0;
  opt.should_cancel = [&] { return ++polls > 5; };
  RolloutEngine engine(model, opt, {});
  try {
    engine.generate({r});
    FAIL() << "generate must stop when should_cancel says so";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Cancelled);
  }
  EXPECT_EQ(polls, 6);
  // Without the request to cancel the same engine runs to the end.
  opt.should_cancel = [] { return false; };
  RolloutEngine free_run(model, opt, {});
  EXPECT_EQ(free_run.generate({r})[0].samples[0].ids.size(), 30u);
}

}  // namespace
}  // namespace opd
