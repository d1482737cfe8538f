// opd serve's vLLM/OpenAI /v1/completions as real clients call it (session 17): fields that
// would change the answer and are not implemented (penalties, logit_bias, best_of, streaming,
// ...) get 400 naming the field instead of being ignored; max_tokens 1 honours or refuses the
// rollout-only sampling fields (top_p, top_k, min_p, stop_token_ids, opd_stream_keys) instead
// of sampling from the full distribution; a single generated EOS finishes with "stop" as in vLLM.
#include <gtest/gtest.h>
#include <httplib.h>

#include <mutex>

#include "common/test_util.h"
#include "core/philox.h"
#include "teacher/protocol.h"
#include "teacher/scorer.h"
#include "teacher/server.h"
#include "teacher/server_test_util.h"

namespace opd {
namespace {

using nlohmann::json;

std::vector<int32_t> random_ids(uint64_t seed, int64_t len, int64_t V) {
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < len; ++i)
    ids.push_back(static_cast<int32_t>(philox_u32(seed, 5, static_cast<uint64_t>(i)) % V));
  return ids;
}

httplib::Result post(httplib::Client& http, const json& body) {
  return http.Post("/v1/completions", body.dump(), "application/json");
}

// A 400 whose OpenAI-style error object names `field`.
void expect_refused(httplib::Client& http, const json& body, const std::string& field) {
  auto r = post(http, body);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400) << body.dump() << " -> " << r->body;
  const json e = json::parse(r->body, nullptr, false);
  ASSERT_TRUE(e.is_object() && e.contains("error")) << r->body;
  EXPECT_TRUE(e["error"]["type"].is_string()) << r->body;
  EXPECT_NE(e["error"]["message"].get<std::string>().find("'" + field + "'"), std::string::npos)
      << body.dump() << " -> " << r->body;
}

TEST(VllmApi, UnsupportedFieldsAreRefusedNamingTheField) {
  CpuScorer scorer(test::fixture_path("models/qwen3"));  // vocab 96
  auto server = test::start_test_server(scorer);
  httplib::Client http("127.0.0.1", server->port());
  const auto ids = random_ids(1, 8, 96);
  const json base = {{"prompt", ids}, {"max_tokens", 1}};
  const std::vector<std::pair<std::string, json>> refused = {
      {"best_of", 3},
      {"presence_penalty", 0.5},
      {"frequency_penalty", -1},
      {"repetition_penalty", 1.3},
      {"min_tokens", 2},
      {"logit_bias", {{"5", 100}}},
      {"suffix", "tail"},
      {"use_beam_search", true},
      {"guided_choice", {"a", "b"}},
      {"stream", true},
      {"stream", "true"},  // vLLM coerces it to true and streams
  };
  for (const auto& [field, value] : refused) {
    json b = base;
    b[field] = value;
    expect_refused(http, b, field);
  }
  // Their defaults (what clients send when the feature is off) are accepted.
  json ok = base;
  ok["best_of"] = 1;
  ok["presence_penalty"] = 0;
  ok["frequency_penalty"] = 0.0;
  ok["repetition_penalty"] = 1.0;
  ok["min_tokens"] = 0;
  ok["logit_bias"] = json::object();
  ok["suffix"] = nullptr;
  ok["use_beam_search"] = false;
  ok["stream"] = false;
  auto r = post(http, ok);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
}

// Without a generator the single-token path samples with temperature and seed only: the other
// sampling fields are refused (400 naming the field), their "off" values accepted. With one
// bound, a max_tokens 1 request that sets them goes to it (as max_tokens > 1 does), a plain one
// stays on the scorer.
TEST(VllmApi, SingleTokenSamplingFieldsAreHonouredOrRefused) {
  CpuScorer scorer(test::fixture_path("models/qwen3"));
  const auto ids = random_ids(2, 8, 96);
  {
    auto server = test::start_test_server(scorer);
    httplib::Client http("127.0.0.1", server->port());
    const json base = {{"prompt", ids}, {"max_tokens", 1}};
    for (const auto& [field, value] : std::vector<std::pair<std::string, json>>{
             {"top_p", 0.5}, {"top_k", 5}, {"min_p", 0.2}, {"stop_token_ids", {3}},
             {"opd_stream_keys", {7}}}) {
      json b = base;
      b[field] = value;
      expect_refused(http, b, field);
    }
    json off = base;
    off["top_p"] = 1.0;
    off["top_k"] = -1;
    off["min_p"] = 0;
    off["stop_token_ids"] = json::array();
    auto r = post(http, off);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
  }
  std::mutex mu;
  std::vector<GenerateRequest> seen;
  ServerOptions o;
  o.port = 0;
  o.threads = 2;
  o.generator = [&](const GenerateRequest& g, const std::function<bool()>&) {
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back(g);
    std::vector<GeneratedCompletion> out(g.prompts.size());
    for (auto& c : out) {
      c.ids = {11};
      c.logprobs = {-0.25f};
    }
    return out;
  };
  TeacherServer server(scorer, o);
  server.start();
  httplib::Client http("127.0.0.1", server.port());
  auto r = post(http, {{"prompt", ids}, {"max_tokens", 1}, {"top_p", 0.5}, {"top_k", 4},
                       {"logprobs", 0}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].max_tokens, 1);
  EXPECT_EQ(seen[0].top_p, 0.5);
  EXPECT_EQ(seen[0].top_k, 4);
  const json j = json::parse(r->body);
  EXPECT_EQ(j["choices"][0]["token_ids"], json::parse("[11]"));
  EXPECT_EQ(j["choices"][0]["logprobs"]["token_logprobs"][0].get<double>(), -0.25);
  EXPECT_EQ(j["usage"]["completion_tokens"].get<int64_t>(), 1);
  // Top-N logprobs are the scorer's: with a rollout-only field they are refused as for longer
  // generations.
  expect_refused(http, {{"prompt", ids}, {"max_tokens", 1}, {"top_p", 0.5}, {"logprobs", 2}},
                 "top_p");
  r = post(http, {{"prompt", ids}, {"max_tokens", 1}, {"logprobs", 2}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(seen.size(), 1u);  // the plain single-token request stayed on the scorer
}

// vLLM checks EOS before the length limit: a single sampled token that is an EOS id (2 in the
// fixture) finishes with "stop", any other with "length"; ignore_eos makes every one "length".
TEST(VllmApi, SingleTokenAtEosFinishesWithStop) {
  CpuScorer scorer(test::fixture_path("models/qwen3"));
  ASSERT_EQ(scorer.info().eos_token_ids, std::vector<int64_t>{2});
  auto server = test::start_test_server(scorer);
  httplib::Client http("127.0.0.1", server->port());
  json prompts = json::array();
  for (uint64_t s = 0; s < 600; ++s) prompts.push_back(random_ids(100 + s, 3, 96));
  // A high temperature flattens the distribution: ~1/96 of the prompts sample the EOS.
  json body = {{"prompt", prompts}, {"max_tokens", 1}, {"temperature", 50}, {"seed", 9}};
  auto r = post(http, body);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body.substr(0, 300);
  json j = json::parse(r->body);
  int stops = 0;
  for (const json& c : j["choices"]) {
    const bool eos = c["token_ids"][0].get<int32_t>() == 2;
    stops += eos;
    EXPECT_EQ(c["finish_reason"], eos ? "stop" : "length") << c.dump();
  }
  EXPECT_GT(stops, 0) << "no prompt sampled the EOS; the check above saw only one side";
  body["ignore_eos"] = true;
  r = post(http, body);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body.substr(0, 300);
  j = json::parse(r->body);
  for (const json& c : j["choices"]) EXPECT_EQ(c["finish_reason"], "length") << c.dump();
}

}  // namespace
}  // namespace opd
