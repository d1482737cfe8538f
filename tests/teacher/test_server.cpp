// The teacher service on loopback (an in-process TeacherServer on an ephemeral port): served
// scores are bit-identical to in-process ones (binary, JSON, our client, and the vLLM-format
// path with ranks checked against the dense logits); malformed requests get a 4xx naming the
// problem and the server keeps serving; a fake teacher sends malformed responses and the client
// reports each with a named error (or retries transport-level damage).
#include <gtest/gtest.h>
#include <httplib.h>

#include <cmath>
#include <limits>
#include <mutex>

#include "common/test_util.h"
#include "core/philox.h"
#include "model/transformer.h"
#include "model/weights_fingerprint.h"
#include "teacher/client.h"
#include "teacher/protocol.h"
#include "teacher/scorer.h"
#include "teacher/server.h"
#include "teacher/server_test_util.h"

namespace opd {
namespace {

std::vector<int32_t> random_ids(uint64_t seed, int64_t len, int64_t V) {
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < len; ++i)
    ids.push_back(static_cast<int32_t>(philox_u32(seed, 3, static_cast<uint64_t>(i)) % V));
  return ids;
}

ScoreRequest request(int64_t k, double T, uint64_t seed = 1) {
  ScoreRequest q;
  q.k = k;
  q.temperature = T;
  q.sequences.push_back({random_ids(seed, 30, 96), 12, 30});
  q.sequences.push_back({random_ids(seed + 1, 9, 96), 1, 9});
  q.sequences.push_back({random_ids(seed + 2, 50, 96), 20, 44});
  return q;
}

void expect_identical(const ScoreResponse& a, const ScoreResponse& b) {
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.temperature, b.temperature);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.seq_begin, b.seq_begin);
  EXPECT_EQ(a.row_offsets, b.row_offsets);
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.logprobs, b.logprobs);
  EXPECT_EQ(a.actual_logprobs, b.actual_logprobs);
}

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    scorer_ = std::make_unique<CpuScorer>(test::fixture_path("models/qwen3"));
    server_ = test::start_test_server(*scorer_);
    http_ = std::make_unique<httplib::Client>("127.0.0.1", server_->port());
  }
  std::string url() const { return cat("http://127.0.0.1:", server_->port()); }

  void expect_healthy() {
    auto h = http_->Get("/health");
    ASSERT_TRUE(h) << "server stopped answering";
    EXPECT_EQ(h->status, 200);
    ScoreRequest q = request(3, 1.0, 77);
    auto r = http_->Post("/v1/score", encode_score_request(q), kBinaryContentType);
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    expect_identical(decode_score_response(r->body), scorer_->score(q));
  }

  std::unique_ptr<CpuScorer> scorer_;
  std::unique_ptr<TeacherServer> server_;
  std::unique_ptr<httplib::Client> http_;
};

TEST_F(ServerTest, ServedScoresEqualInProcess) {
  for (double T : {1.0, 0.6}) {
    ScoreRequest q = request(5, T);
    const ScoreResponse local = scorer_->score(q);
    auto bin = http_->Post("/v1/score", encode_score_request(q), kBinaryContentType);
    ASSERT_TRUE(bin);
    ASSERT_EQ(bin->status, 200) << bin->body;
    EXPECT_EQ(bin->get_header_value("Content-Type"), kBinaryContentType);
    expect_identical(decode_score_response(bin->body), local);
    auto js = http_->Post("/v1/score", score_request_to_json(q).dump(), "application/json");
    ASSERT_TRUE(js);
    ASSERT_EQ(js->status, 200) << js->body;
    expect_identical(score_response_from_json(parse_json(js->body, "t")), local);
    // JSON request, binary answer on request (Accept).
    httplib::Headers accept = {{"Accept", kBinaryContentType}};
    auto mixed = http_->Post("/v1/score", accept, score_request_to_json(q).dump(), "application/json");
    ASSERT_TRUE(mixed);
    expect_identical(decode_score_response(mixed->body), local);
  }
}

TEST_F(ServerTest, ClientScoresEqualInProcessBothEncodings) {
  for (bool binary : {true, false}) {
    ClientOptions co;
    co.url = url();
    co.binary = binary;
    co.student_vocab = 96;
    co.student_fingerprint = scorer_->info().fingerprint;
    TeacherClient client(co);
    EXPECT_EQ(client.api(), TeacherApi::Opd);
    EXPECT_EQ(client.info().vocab_size, 96);
    EXPECT_EQ(client.info().fingerprint, scorer_->info().fingerprint);
    EXPECT_EQ(client.info().eos_token_ids, std::vector<int64_t>{2});
    ScoreRequest q = request(4, 1.0);
    auto v = client.score_validated(q);
    expect_identical(v.response, scorer_->score(q));
    EXPECT_EQ(v.topk.rows, q.num_rows());
  }
}

// /v1/models reports the served weights' fingerprint (ServerOptions::weights_fingerprint; `opd
// serve` sets it from --model) and the client reads it into TeacherInfo, so a resumed run can
// tell a teacher whose weights changed behind the same URL; a server that does not report one
// (an older opd, vLLM) leaves it empty.
TEST_F(ServerTest, ModelsReportsTheWeightsFingerprintAndTheClientReadsIt) {
  ClientOptions co;
  co.url = url();
  EXPECT_EQ(TeacherClient(co).info().weights_fingerprint, "");
  ServerOptions so;
  so.port = 0;
  so.weights_fingerprint = weights_fingerprint(test::fixture_path("models/qwen3")).sha256;
  TeacherServer with(*scorer_, so);
  with.start();
  co.url = cat("http://127.0.0.1:", with.port());
  EXPECT_EQ(TeacherClient(co).info().weights_fingerprint, so.weights_fingerprint);
  EXPECT_EQ(so.weights_fingerprint.size(), 64u);
}

// Our /v1/completions parsed by our vLLM client path: top-K and actual logprobs at T = 1 equal
// the in-process scores; the actual token's rank equals 1 + #{logits above it} from the dense
// logits of Transformer::forward.
TEST_F(ServerTest, VllmCompatiblePathMatchesAndRanksAreExact) {
  ClientOptions co;
  co.url = url();
  co.api = TeacherApi::Vllm;
  co.student_vocab = 96;
  co.student_fingerprint = scorer_->info().fingerprint;
  TeacherClient client(co);
  EXPECT_EQ(client.api(), TeacherApi::Vllm);
  ScoreRequest q = request(6, 1.0);
  ScoreResponse v = client.score(q);
  ScoreResponse local = scorer_->score(q);
  // /v1/completions scores every prompt position, so the lm_head GEMMs see other row sets than
  // the in-process call and may round differently in the last bit: compare to 1e-6.
  EXPECT_EQ(v.ids, local.ids);
  ASSERT_EQ(v.logprobs.size(), local.logprobs.size());
  ASSERT_EQ(v.actual_logprobs.size(), local.actual_logprobs.size());
  for (size_t i = 0; i < v.logprobs.size(); ++i) EXPECT_NEAR(v.logprobs[i], local.logprobs[i], 1e-6);
  for (size_t i = 0; i < v.actual_logprobs.size(); ++i)
    EXPECT_NEAR(v.actual_logprobs[i], local.actual_logprobs[i], 1e-6);

  Transformer model = Transformer::load(test::fixture_path("models/qwen3"));
  const auto& ids = q.sequences[0].ids;
  nlohmann::json body = {{"prompt", ids}, {"max_tokens", 0}, {"prompt_logprobs", 2}};
  auto r = http_->Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  auto j = parse_json(r->body, "t");
  Tensor logits = model.forward(make_batch({ids}, 96));
  const auto& plp = j["choices"][0]["prompt_logprobs"];
  ASSERT_TRUE(plp[0].is_null());
  for (size_t p = 1; p < ids.size(); ++p) {
    const float* z = logits.data<float>() + (p - 1) * 96;
    int64_t above = 0;
    for (int v2 = 0; v2 < 96; ++v2) above += z[v2] > z[ids[p]];
    ASSERT_EQ(plp[p][std::to_string(ids[p])]["rank"].get<int64_t>(), above + 1) << "position " << p;
  }
}

TEST_F(ServerTest, CompletionsGenerationAndErrors) {
  // max_tokens 1 at temperature 0 is the argmax of the next-token distribution.
  const auto ids = random_ids(5, 12, 96);
  auto r = http_->Post("/v1/completions",
                       nlohmann::json({{"prompt", ids}, {"max_tokens", 1}, {"temperature", 0}, {"logprobs", 3}}).dump(),
                       "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  auto j = parse_json(r->body, "t");
  Transformer model = Transformer::load(test::fixture_path("models/qwen3"));
  Tensor logits = model.forward(make_batch({ids}, 96));
  const float* z = logits.data<float>() + 11 * 96;
  int32_t best = 0;
  for (int v = 1; v < 96; ++v) best = z[v] > z[best] ? v : best;
  EXPECT_EQ(j["choices"][0]["token_ids"][0].get<int32_t>(), best);
  EXPECT_EQ(j["usage"]["completion_tokens"].get<int64_t>(), 1);
  // Errors.
  auto post = [&](const nlohmann::json& b) { return http_->Post("/v1/completions", b.dump(), "application/json"); };
  auto g = post({{"prompt", ids}, {"max_tokens", 8}});
  ASSERT_TRUE(g);
  EXPECT_EQ(g->status, 501);  // this server has no generator bound (opd serve binds one)
  EXPECT_NE(g->body.find("this server cannot generate more than one token"), std::string::npos)
      << g->body;
  auto t = post({{"prompt", "hello"}, {"max_tokens", 0}});
  EXPECT_EQ(t->status, 400);
  EXPECT_NE(t->body.find("text prompts are not supported"), std::string::npos);
  auto m = post({{"model", "gpt-9"}, {"prompt", ids}, {"max_tokens", 0}});
  EXPECT_EQ(m->status, 404);
  auto bad = post({{"prompt", std::vector<int>{1, 2, 96}}, {"max_tokens", 0}, {"prompt_logprobs", 1}});
  EXPECT_EQ(bad->status, 400);
  EXPECT_NE(bad->body.find("position 2: token id 96 is outside the vocabulary [0, 96)"), std::string::npos)
      << bad->body;
  expect_healthy();
}

// A server with a generator bound (ServerOptions::generator; `opd serve` binds the rollout
// engine): a /v1/completions request's sampling fields reach it as the GenerateRequest (vLLM
// names and defaults; top_k -1 = off; the seed's bits kept), its completions come back in vLLM's
// shape (token_ids, finish_reason, logprobs 0, usage) and TeacherClient::generate reads them
// back; every bad field gets 400 naming it without reaching the generator; a cancelled
// generation is 503; stop() turns `cancelled` true.
TEST(ServerGeneration, FieldsReachTheGeneratorAndAnswersRoundTrip) {
  CpuScorer scorer(test::fixture_path("models/qwen3"));  // vocab 96, context 64
  std::mutex mu;
  std::vector<GenerateRequest> seen;
  std::function<bool()> cancelled_fn;
  bool cancel_next = false;
  ServerOptions o;
  o.port = 0;
  o.threads = 4;
  o.max_generation_tokens = 200;
  o.generator = [&](const GenerateRequest& g, const std::function<bool()>& cancelled) {
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back(g);
    cancelled_fn = cancelled;
    EXPECT_FALSE(cancelled());
    if (cancel_next) OPD_FAIL(Cancelled, "generation stopped: the server is stopping");
    std::vector<GeneratedCompletion> out;
    for (size_t i = 0; i < g.prompts.size(); ++i) {
      GeneratedCompletion c;
      const int64_t n = i % 2 == 0 ? g.max_tokens : 1;  // even prompts run to the limit
      for (int64_t t = 0; t < n; ++t) {
        c.ids.push_back(static_cast<int32_t>((g.prompts[i][0] + t) % 96));
        c.logprobs.push_back(-0.5f * static_cast<float>(t + 1));
      }
      c.stopped = n < g.max_tokens;
      c.text = cat("text of prompt ", i);
      out.push_back(c);
    }
    return out;
  };
  TeacherServer server(scorer, o);
  server.start();
  httplib::Client http("127.0.0.1", server.port());
  auto post = [&](const nlohmann::json& b) {
    auto r = http.Post("/v1/completions", b.dump(), "application/json");
    EXPECT_TRUE(r);
    return r;
  };
  auto r = post({{"prompt", {{3, 4}, {9}}}, {"max_tokens", 5}, {"temperature", 0.5},
                 {"top_p", 0.8}, {"top_k", 7}, {"min_p", 0.1}, {"seed", -3},
                 {"ignore_eos", true}, {"stop_token_ids", {2}}, {"opd_stream_keys", {11, 12}},
                 {"logprobs", 0}, {"stop", nlohmann::json::array()}});
  ASSERT_EQ(r->status, 200) << r->body;
  ASSERT_EQ(seen.size(), 1u);
  const GenerateRequest& g = seen[0];
  EXPECT_EQ(g.prompts, (std::vector<std::vector<int32_t>>{{3, 4}, {9}}));
  EXPECT_EQ(g.max_tokens, 5);
  EXPECT_EQ(g.temperature, 0.5);
  EXPECT_EQ(g.top_p, 0.8);
  EXPECT_EQ(g.top_k, 7);
  EXPECT_EQ(g.min_p, 0.1);
  EXPECT_EQ(g.seed, static_cast<uint64_t>(int64_t{-3}));
  EXPECT_TRUE(g.ignore_eos);
  EXPECT_EQ(g.stop_token_ids, (std::vector<int32_t>{2}));
  EXPECT_EQ(g.stream_keys, (std::vector<uint64_t>{11, 12}));
  auto j = parse_json(r->body, "t");
  EXPECT_EQ(j["choices"][0]["token_ids"], nlohmann::json::parse("[3,4,5,6,7]"));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["choices"][1]["token_ids"], nlohmann::json::parse("[9]"));
  EXPECT_EQ(j["choices"][1]["finish_reason"], "stop");
  EXPECT_EQ(j["choices"][1]["text"], "text of prompt 1");
  EXPECT_EQ(j["choices"][0]["logprobs"]["tokens"][1], "token_id:4");
  EXPECT_EQ(j["choices"][0]["logprobs"]["token_logprobs"][1].get<double>(), -1.0);
  EXPECT_EQ(j["usage"]["completion_tokens"].get<int64_t>(), 6);
  EXPECT_EQ(j["usage"]["prompt_tokens"].get<int64_t>(), 3);

  // Defaults: vLLM's (temperature 1, top_p 1, top_k off, min_p 0, seed 0), EOS honoured.
  ASSERT_EQ(post({{"prompt", {1, 2}}, {"max_tokens", 3}, {"top_k", -1}})->status, 200);
  EXPECT_EQ(seen[1].temperature, 1.0);
  EXPECT_EQ(seen[1].top_p, 1.0);
  EXPECT_EQ(seen[1].top_k, 0);
  EXPECT_EQ(seen[1].min_p, 0.0);
  EXPECT_EQ(seen[1].seed, 0u);
  EXPECT_FALSE(seen[1].ignore_eos);
  EXPECT_TRUE(seen[1].stream_keys.empty());

  // The client: same answer, the full 64-bit seed and the stream keys arrive.
  ClientOptions co;
  co.url = cat("http://127.0.0.1:", server.port());
  co.student_vocab = 96;
  TeacherClient client(co);
  GenerateRequest q;
  q.prompts = {{3, 4}, {9}, {40}};
  q.max_tokens = 4;
  q.seed = 0xfedcba9876543210ull;
  q.stream_keys = {7, 0xffffffffffffffffull, 0};
  const std::vector<GeneratedCompletion> got = client.generate(q);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].ids, (std::vector<int32_t>{3, 4, 5, 6}));
  EXPECT_FALSE(got[0].stopped);
  EXPECT_EQ(got[1].ids, (std::vector<int32_t>{9}));
  EXPECT_TRUE(got[1].stopped);
  EXPECT_EQ(got[2].ids, (std::vector<int32_t>{40, 41, 42, 43}));
  EXPECT_EQ(got[0].logprobs, (std::vector<float>{-0.5f, -1.0f, -1.5f, -2.0f}));
  EXPECT_EQ(seen.back().seed, q.seed);
  EXPECT_EQ(seen.back().stream_keys, q.stream_keys);
  // A request over the server's max_generation_tokens (200 here, stated in /v1/models) goes as
  // consecutive requests that fit, each prompt keeping its stream key: 6 prompts x (10 + 30)
  // tokens = 240 -> 5 + 1.
  {
    GenerateRequest big;
    big.max_tokens = 30;
    for (int i = 0; i < 6; ++i) {
      big.prompts.push_back(random_ids(40 + i, 10, 96));
      big.stream_keys.push_back(100 + i);
    }
    const size_t before = seen.size();
    const std::vector<GeneratedCompletion> got6 = client.generate(big);
    ASSERT_EQ(seen.size(), before + 2) << "not split in two requests";
    EXPECT_EQ(seen[before].prompts.size(), 5u);
    EXPECT_EQ(seen[before + 1].prompts.size(), 1u);
    EXPECT_EQ(seen[before + 1].stream_keys, (std::vector<uint64_t>{105}));
    ASSERT_EQ(got6.size(), 6u);
    for (size_t i = 0; i < 6; ++i)
      EXPECT_EQ(got6[i].ids.front(), big.prompts[i][0]) << "prompt " << i << " answered out of order";
  }
  // A student with a smaller vocabulary (a teacher with padded rows, clip-to-student) refuses
  // generated ids it does not have (prompt 2's 40..43).
  co.student_vocab = 42;
  co.loss.vocab_policy = VocabPolicy::ClipToStudent;
  TeacherClient small(co);
  try {
    small.generate(q);
    ADD_FAILURE() << "ids past the student's vocabulary accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidData);
    EXPECT_NE(std::string(e.what()).find("choice for prompt 2.token_ids[2]: 42 is outside [0, 41]"),
              std::string::npos) << e.what();
  }

  // Bad fields: 400 naming them, nothing generated.
  const size_t calls = seen.size();
  const std::vector<int32_t> ten = random_ids(9, 10, 96);
  const std::vector<std::pair<nlohmann::json, std::string>> bad = {
      {{{"prompt", {1, 2}}, {"max_tokens", 3}, {"logprobs", 2}},
       "logprobs = 2 with max_tokens = 3: only the sampled token's logprob"},
      {{{"prompt", {1, 2}}, {"max_tokens", 3}, {"stop", {"\n"}}}, "stop strings need a tokenizer"},
      {{{"prompt", {1, 2}}, {"max_tokens", 3}, {"stop", "x"}}, "stop strings need a tokenizer"},
      {{{"prompt", ten}, {"max_tokens", 55}},
       "prompt 0 has 10 tokens; with max_tokens = 55 that is 65 positions, over this model's "
       "context length 64"},
      {{{"prompt", {ten, ten, ten, ten}}, {"max_tokens", 50}},
       "4 prompts with max_tokens = 50 come to 240 tokens, over this server's limit of 200"},
      {{{"prompt", {1, 2}}, {"max_tokens", 3}, {"top_p", 0}}, "'top_p' = 0 is outside (0, 1]"},
      {{{"prompt", {1, 2}}, {"max_tokens", 3}, {"top_p", "high"}}, "'top_p' must be a number"},
      {{{"prompt", {1, 2}}, {"max_tokens", 3}, {"min_p", 1.5}}, "'min_p' = 1.5 is outside [0, 1]"},
      {{{"prompt", {1, 2}}, {"max_tokens", 3}, {"top_k", 97}}, "'top_k' = 97 is outside [-1, 96]"},
      {{{"prompt", {1, 2}}, {"max_tokens", 3}, {"ignore_eos", "yes"}}, "'ignore_eos' must be a boolean"},
      {{{"prompt", {1, 2}}, {"max_tokens", 3}, {"stop_token_ids", {5, 96}}},
       "stop_token_ids[1] = 96 is outside the vocabulary [0, 96)"},
      {{{"prompt", {1, 2}}, {"max_tokens", 3}, {"stop_token_ids", 5}}, "'stop_token_ids' must be a list"},
      {{{"prompt", {{1}, {2}}}, {"max_tokens", 3}, {"opd_stream_keys", {1}}},
       "'opd_stream_keys' must be a list of one unsigned integer per prompt (2)"},
      {{{"prompt", {{1}, {2}}}, {"max_tokens", 3}, {"opd_stream_keys", {1, -2}}},
       "opd_stream_keys[1] must be an unsigned integer"},
      {{{"prompt", {1, 2}}, {"max_tokens", 3}, {"n", 2}}, "'n' = 2 is outside [1, 1]"},
  };
  for (const auto& [body, needle] : bad) {
    auto e = post(body);
    EXPECT_EQ(e->status, 400) << body.dump() << "\n" << e->body;
    EXPECT_NE(e->body.find(needle), std::string::npos) << body.dump() << "\n" << e->body;
  }
  EXPECT_EQ(seen.size(), calls) << "a refused request reached the generator";

  // A generation cancelled by the server's stop: 503 (the client retries, the trainer waits).
  {
    std::lock_guard<std::mutex> lock(mu);
    cancel_next = true;
  }
  auto c = post({{"prompt", {1, 2}}, {"max_tokens", 3}});
  EXPECT_EQ(c->status, 503) << c->body;
  EXPECT_NE(c->body.find("generation stopped"), std::string::npos) << c->body;
  server.stop();
  EXPECT_TRUE(cancelled_fn());
}

// JSON answers are bounded (ServerOptions::max_json_entries): a request whose JSON answer would
// hold more (id, logprob) entries gets 400 naming the limit and the binary format, before any
// scoring; the same request in binary is served; the server keeps serving.
TEST(ServerJsonLimit, LargeJsonAnswersAreRefusedBinaryServed) {
  CpuScorer scorer(test::fixture_path("models/qwen3"));
  ServerOptions o;
  o.port = 0;
  o.threads = 2;
  o.max_json_entries = 100;
  TeacherServer server(scorer, o);
  server.start();
  httplib::Client http("127.0.0.1", server.port());
  ScoreRequest q = request(4, 1.0);  // rows x k well over 100 entries
  ASSERT_GT(q.num_rows() * q.k, 100);
  auto js = http.Post("/v1/score", score_request_to_json(q).dump(), "application/json");
  ASSERT_TRUE(js);
  EXPECT_EQ(js->status, 400);
  EXPECT_NE(js->body.find("exceed this server's limit of 100"), std::string::npos) << js->body;
  EXPECT_NE(js->body.find(kBinaryContentType), std::string::npos) << js->body;
  auto bin = http.Post("/v1/score", encode_score_request(q), kBinaryContentType);
  ASSERT_TRUE(bin);
  ASSERT_EQ(bin->status, 200) << bin->body;
  expect_identical(decode_score_response(bin->body), scorer.score(q));
  // /v1/completions: 11 scored positions x (20 + 1) entries > 100; 11 x (5 + 1) fits.
  const auto ids = random_ids(9, 12, 96);
  auto big = http.Post("/v1/completions",
                       nlohmann::json({{"prompt", ids}, {"max_tokens", 0}, {"prompt_logprobs", 20}}).dump(),
                       "application/json");
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 400);
  EXPECT_NE(big->body.find("prompt_logprobs"), std::string::npos) << big->body;
  auto small = http.Post("/v1/completions",
                         nlohmann::json({{"prompt", ids}, {"max_tokens", 0}, {"prompt_logprobs", 5}}).dump(),
                         "application/json");
  ASSERT_TRUE(small);
  EXPECT_EQ(small->status, 200) << small->body;
}

// Malformed requests of every kind: a 4xx with a JSON error naming the problem, and the server
// keeps serving (checked after each).
TEST_F(ServerTest, MalformedRequestsGet4xxAndServerKeepsServing) {
  struct Case {
    std::string content_type, body;
    int status;
    std::string needle;
  };
  ScoreRequest good = request(3, 1.0);
  const std::string bin = encode_score_request(good);
  std::string crc_bad = bin;
  crc_bad.back() ^= 0x40;
  ScoreRequest neg = good;
  neg.sequences[1].ids[4] = -7;
  ScoreRequest big = good;
  big.sequences[0].ids[2] = 1 << 30;
  ScoreRequest nan_t = good;
  nan_t.temperature = std::numeric_limits<double>::quiet_NaN();
  ScoreRequest huge_k = good;
  huge_k.k = 1 << 30;
  ScoreRequest range = good;
  range.sequences[2].end = 51;
  ScoreRequest fp = good;
  fp.model_fingerprint = "0000";
  std::vector<Case> cases = {
      {kBinaryContentType, "", 400, "shorter than the 24-byte header"},
      {kBinaryContentType, bin.substr(0, bin.size() - 3), 400, "header says"},
      {kBinaryContentType, crc_bad, 400, "CRC-32"},
      {kBinaryContentType, "GET / HTTP/1.1 garbage garbage garbage", 400, "bad magic"},
      {kBinaryContentType, encode_score_request(neg), 400, "sequence 1, position 4: token id -7"},
      {kBinaryContentType, encode_score_request(big), 400, "token id 1073741824 is outside"},
      {kBinaryContentType, encode_score_request(nan_t), 400, "temperature nan"},
      {kBinaryContentType, encode_score_request(huge_k), 400, "k = 1073741824"},
      {kBinaryContentType, encode_score_request(range), 400, "end <= length 50"},
      {kBinaryContentType, encode_score_request(fp), 409, "expects teacher fingerprint '0000'"},
      {"application/json", "{\"k\": 3, \"sequences\": [", 400, "malformed JSON"},
      {"application/json", "{\"k\": 3, \"sequences\": [{\"ids\": [1, 2, \"x\"]}]}", 400, "expected an integer"},
      {"application/json", "{\"k\": 3, \"sequences\": [{\"ids\": [1, 2, 3], \"begin\": -1}]}", 400, "-1 is outside"},
      {"application/json", "[]", 400, "expected a JSON object"},
      {"text/plain", "hello", 415, "neither"},
      {kBinaryContentType, std::string(2 << 20, 'x'), 413, "exceeds the server's limit of 1048576 bytes"},
      // ~120 KB of '[': its copy or dump() would recurse past the thread's stack (session 15:
      // one such request ended `opd serve` with SIGSEGV).
      {"application/json",
       "{\"k\": 2, \"sequences\": [{\"ids\": " + std::string(60000, '[') + std::string(60000, ']') + "}]}",
       400, "JSON nested 60003 levels deep, over the limit of 256"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.needle);
    auto r = http_->Post("/v1/score", c.body, c.content_type.c_str());
    ASSERT_TRUE(r) << "no response";
    EXPECT_EQ(r->status, c.status) << r->body;
    auto j = parse_json(r->body, "error body");
    ASSERT_TRUE(j.contains("error")) << r->body;
    EXPECT_NE(j["error"]["message"].get<std::string>().find(c.needle), std::string::npos) << r->body;
    expect_healthy();
  }
  // Random garbage bodies.
  for (uint64_t t = 0; t < 50; ++t) {
    std::string body(1 + philox_u32(9, t, 0) % 300, '\0');
    for (size_t i = 0; i < body.size(); ++i) body[i] = static_cast<char>(philox_u32(9, t, i + 1));
    auto r = http_->Post("/v1/score", body, t % 2 ? kBinaryContentType : "application/json");
    ASSERT_TRUE(r);
    EXPECT_GE(r->status, 400);
    EXPECT_LT(r->status, 500) << r->body;
  }
  auto nr = http_->Get("/v1/nothing");
  EXPECT_EQ(nr->status, 404);
  // The same depth guard on /v1/completions (its prompt, and its model name).
  for (const std::string& field : {"prompt", "model"}) {
    auto d = http_->Post("/v1/completions",
                         "{\"" + field + "\": " + std::string(100000, '[') + std::string(100000, ']') + "}",
                         "application/json");
    ASSERT_TRUE(d) << "no response (" << field << ")";
    EXPECT_EQ(d->status, 400) << d->body;
    EXPECT_NE(d->body.find("JSON nested 100001 levels deep"), std::string::npos) << d->body;
  }
  expect_healthy();
  // The 413 is counted too: bodies are read inside the handlers (session 16).
  EXPECT_EQ(server_->requests_rejected(), static_cast<int64_t>(cases.size()) + 50 + 2);
}

// A second server on a port another one holds is refused (cpp-httplib's default SO_REUSEPORT
// let both bind, and the kernel split the requests between two different teachers).
TEST_F(ServerTest, ASecondServerOnTheSamePortIsRefused) {
  ServerOptions o;
  o.port = server_->port();
  o.threads = 1;
  TeacherServer second(*scorer_, o);
  try {
    second.start();
    ADD_FAILURE() << "a second server bound port " << o.port;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Io) << e.what();
    EXPECT_NE(std::string(e.what()).find("in use"), std::string::npos) << e.what();
  }
  expect_healthy();
}

// --- client against a fake teacher -------------------------------------------------------------

class FakeTeacher {
 public:
  FakeTeacher() {
    http_.Get("/v1/models", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"object":"list","data":[{"id":"fake","object":"model","opd":{"vocab_size":96,"tokenizer_fingerprint":"fp96","eos_token_ids":[2]}}]})",
                      "application/json");
    });
    http_.Post("/v1/score", [this](const httplib::Request&, httplib::Response& res) {
      std::lock_guard<std::mutex> lock(mu_);
      ++calls_;
      if (fail_first_ > 0) {
        --fail_first_;
        res.status = 503;
        res.set_content(R"({"error":{"message":"busy"}})", "application/json");
        return;
      }
      res.status = status_;
      res.set_content(body_, content_type_);
    });
    port_ = http_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { http_.listen_after_bind(); });
  }
  ~FakeTeacher() {
    http_.stop();
    thread_.join();
  }
  void respond(int status, std::string body, std::string ct, int fail_first = 0) {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = status;
    body_ = std::move(body);
    content_type_ = std::move(ct);
    fail_first_ = fail_first;
  }
  int calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }
  std::string url() const { return cat("http://127.0.0.1:", port_); }

 private:
  httplib::Server http_;
  std::thread thread_;
  std::mutex mu_;
  int port_ = 0, status_ = 200, fail_first_ = 0, calls_ = 0;
  std::string body_, content_type_;
};

// A well-formed response to request(2, 1.0) (rows 18 + 8 + 24), values from the real scorer.
ScoreResponse good_response() {
  CpuScorer s(test::fixture_path("models/qwen3"));
  return s.score(request(2, 1.0));
}

TEST(ClientFaults, MalformedResponsesGetNamedErrors) {
  FakeTeacher fake;
  ClientOptions co;
  co.url = fake.url();
  co.student_vocab = 96;
  co.student_fingerprint = "fp96";
  co.max_attempts = 2;
  co.backoff_initial_s = 0.01;
  TeacherClient client(co);
  const ScoreRequest q = request(2, 1.0);
  const ScoreResponse good = good_response();

  auto expect_error = [&](ScoreResponse bad, ErrorKind kind, const std::string& needle) {
    fake.respond(200, encode_score_response(bad), kBinaryContentType);
    try {
      client.score(q);
      ADD_FAILURE() << "accepted a response that should fail with: " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), kind) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  fake.respond(200, encode_score_response(good), kBinaryContentType);
  expect_identical(client.score(q), good);

  ScoreResponse r = good;
  r.logprobs[5] = std::numeric_limits<float>::quiet_NaN();
  expect_error(r, ErrorKind::InvalidData, "(entry 1) is NaN");
  r = good;
  r.ids[3] = 500;
  expect_error(r, ErrorKind::InvalidData, "id 500 (entry 1) is outside the student vocabulary [0, 96)");
  r = good;
  r.ids[0] = -3;
  expect_error(r, ErrorKind::InvalidData, "id -3 (entry 0) is outside the student vocabulary");
  r = good;
  r.ids[1] = r.ids[0];
  expect_error(r, ErrorKind::InvalidData, "is repeated");
  r = good;
  r.actual_logprobs[2] = std::numeric_limits<float>::infinity();
  expect_error(r, ErrorKind::InvalidData, "actual-token logprob inf");
  r = good;
  r.logprobs[0] = 0.5f;
  r.logprobs[1] = 0.4f;
  expect_error(r, ErrorKind::InvalidData, "sum to");
  r = good;  // one row missing from sequence 1 (and from the arrays)
  r.row_offsets = {0, 18, 25, 49};
  r.ids.resize(49 * 2);
  r.logprobs.resize(49 * 2);
  r.actual_logprobs.resize(49);
  expect_error(r, ErrorKind::InvalidData, "sequence 1 has 7 rows, requested 8");
  r = good;
  r.seq_begin[2] = 19;
  expect_error(r, ErrorKind::InvalidData, "sequence 2 starts at position 19, requested 20");
  r = good;
  r.vocab_size = 200;
  // Refused before the payload check (which would say "teacher vocabulary 200 is larger than the
  // student's 96"): the answer does not carry the vocabulary /v1/models reported.
  expect_error(r, ErrorKind::InvalidData, "answered with vocabulary 200 but reported 96 at connect");

  // JSON responses with bad types.
  fake.respond(200, R"({"k":2,"temperature":1,"vocab_size":96,"sequences":"no"})", "application/json");
  EXPECT_THROW(client.score(q), Error);
  // Damaged bodies are retried, then reported with the last cause.
  std::string damaged = encode_score_response(good);
  damaged[40] ^= 1;
  fake.respond(200, damaged, kBinaryContentType);
  try {
    client.score(q);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Io);
    EXPECT_NE(std::string(e.what()).find("CRC-32"), std::string::npos) << e.what();
  }
  // 4xx is not retried and carries the server's message.
  const int before = fake.calls();
  fake.respond(400, R"({"error":{"message":"k too large"}})", "application/json");
  try {
    client.score(q);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("k too large"), std::string::npos) << e.what();
  }
  EXPECT_EQ(fake.calls(), before + 1);
  // 503 then success: retried, one result.
  fake.respond(200, encode_score_response(good), kBinaryContentType, /*fail_first=*/1);
  const int64_t retries = client.stats().retries;
  expect_identical(client.score(q), good);
  EXPECT_EQ(client.stats().retries, retries + 1);
}

TEST(ClientFaults, CompatibilityIsCheckedAtConnect) {
  FakeTeacher fake;
  ClientOptions co;
  co.url = fake.url();
  co.student_vocab = 96;
  co.student_fingerprint = "other";
  try {
    TeacherClient c(co);
    ADD_FAILURE() << "fingerprint mismatch accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("does not share the student's tokenizer"), std::string::npos)
        << e.what();
  }
  co.loss.vocab_policy = VocabPolicy::ClipToStudent;
  EXPECT_NO_THROW(TeacherClient{co});  // the explicit policy accepts it (with a warning)
  co.loss.vocab_policy = VocabPolicy::Error;
  co.student_fingerprint = "fp96";
  co.student_vocab = 50;
  EXPECT_THROW(TeacherClient{co}, Error);  // teacher vocab 96 > student 50
  // Nothing listening: Io after the attempts.
  co.url = "http://127.0.0.1:1";
  co.max_attempts = 2;
  co.backoff_initial_s = 0.01;
  try {
    TeacherClient c(co);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Io) << e.what();
  }
  co.url = "https://example.org:443";
  EXPECT_THROW(TeacherClient{co}, Error);
}

}  // namespace
}  // namespace opd
