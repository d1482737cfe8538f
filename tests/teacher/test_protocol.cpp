// Wire protocol: CRC-32 check value, binary and JSON round trips, fuzzing of the decoders
// (every truncation, byte flips, lying counts with a valid CRC) and the vLLM prompt_logprobs
// parser on a fixture constructed from vLLM's documented shape (tests/fixtures/teacher/).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/test_util.h"
#include "teacher/protocol_samples.h"
#include "core/philox.h"
#include "loss/teacher_payload.h"
#include "teacher/protocol.h"

namespace opd {
namespace {

ScoreRequest sample_request() {
  ScoreRequest q;
  q.k = 3;
  q.temperature = 0.75;
  q.model_fingerprint = "58411fcd61c4ac4075053861b9a78e09c628a10043cfc14127290a63c18b9786";
  q.sequences.push_back({{5, 17, 3, 42, 9}, 2, 5});
  q.sequences.push_back({{1}, 1, 1});
  q.sequences.push_back({{7, 7, 90}, 1, 3});
  return q;
}

using test::sample_response;

void expect_same(const ScoreRequest& a, const ScoreRequest& b) {
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.temperature, b.temperature);
  EXPECT_EQ(a.model_fingerprint, b.model_fingerprint);
  ASSERT_EQ(a.sequences.size(), b.sequences.size());
  for (size_t s = 0; s < a.sequences.size(); ++s) {
    EXPECT_EQ(a.sequences[s].ids, b.sequences[s].ids);
    EXPECT_EQ(a.sequences[s].begin, b.sequences[s].begin);
    EXPECT_EQ(a.sequences[s].end, b.sequences[s].end);
  }
}

void expect_same(const ScoreResponse& a, const ScoreResponse& b) {
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.temperature, b.temperature);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.seq_begin, b.seq_begin);
  EXPECT_EQ(a.row_offsets, b.row_offsets);
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.logprobs, b.logprobs);  // bit-exact floats
  EXPECT_EQ(a.actual_logprobs, b.actual_logprobs);
}

TEST(Protocol, Crc32CheckValue) {
  // The standard CRC-32/ISO-HDLC check value of "123456789" (also zlib.crc32(b"123456789")).
  EXPECT_EQ(crc32("123456789", 9), 0xCBF43926u);
  EXPECT_EQ(crc32("", 0), 0u);
}

TEST(Protocol, Crc32EqualsTheBytewiseDefinitionAtEveryLengthAndAlignment) {
  // The 8-byte fold against the one-bit-at-a-time definition (reflected 0xEDB88320).
  auto reference = [](const unsigned char* p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; ++i) {
      c ^= p[i];
      for (int b = 0; b < 8; ++b) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    }
    return c ^ 0xFFFFFFFFu;
  };
  std::vector<unsigned char> buf(300);
  uint32_t x = 12345;
  for (auto& v : buf) v = static_cast<unsigned char>((x = x * 1103515245u + 12345u) >> 16);
  for (size_t offset = 0; offset < 8; ++offset)
    for (size_t n = 0; n + offset <= buf.size(); n += 7)
      EXPECT_EQ(crc32(buf.data() + offset, n), reference(buf.data() + offset, n)) << offset << " " << n;
}

TEST(Protocol, BinaryLayoutIsTheDocumentedOne) {
  // Header bytes written out by hand from docs/teacher_protocol.md.
  ScoreRequest q;
  q.k = 2;
  q.temperature = 1.0;
  q.sequences.push_back({{7, 8}, 1, 2});
  const std::string m = encode_score_request(q);
  ASSERT_EQ(m.size(), 24u + 4 + 4 + 8 + 4 + 12 + 8);
  EXPECT_EQ(m.substr(0, 4), "OPDT");
  EXPECT_EQ(static_cast<uint8_t>(m[4]), 1);  // version 1, little-endian u16
  EXPECT_EQ(static_cast<uint8_t>(m[5]), 0);
  EXPECT_EQ(static_cast<uint8_t>(m[6]), 1);  // kind 1 = score request
  EXPECT_EQ(static_cast<uint8_t>(m[8]), 40);  // body bytes (u64)
  uint32_t crc;
  std::memcpy(&crc, m.data() + 16, 4);
  EXPECT_EQ(crc, crc32(m.data() + 24, m.size() - 24));
  // body: n=1, k=2, T=1.0, fingerprint length 0, then len 2, begin 1, end 2, ids 7 8
  const unsigned char body[] = {1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xF0, 0x3F, 0, 0, 0, 0,
                                2, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 7, 0, 0, 0, 8, 0, 0, 0};
  ASSERT_EQ(sizeof(body), 40u);
  EXPECT_EQ(std::memcmp(m.data() + 24, body, 40), 0);
}

TEST(Protocol, RoundTrips) {
  expect_same(decode_score_request(encode_score_request(sample_request())), sample_request());
  expect_same(score_request_from_json(parse_json(score_request_to_json(sample_request()).dump(), "t")),
              sample_request());
  expect_same(decode_score_response(encode_score_response(sample_response())), sample_response());
  expect_same(score_response_from_json(parse_json(score_response_to_json(sample_response()).dump(), "t")),
              sample_response());
}

// Every proper prefix of a message is rejected with InvalidData, never read past.
TEST(Protocol, EveryTruncationIsRejected) {
  const std::string req = encode_score_request(sample_request());
  const std::string res = encode_score_response(sample_response());
  for (size_t n = 0; n < req.size(); ++n)
    EXPECT_THROW(decode_score_request(std::string_view(req).substr(0, n)), Error) << n;
  for (size_t n = 0; n < res.size(); ++n)
    EXPECT_THROW(decode_score_response(std::string_view(res).substr(0, n)), Error) << n;
}

// Random byte flips: either rejected with an opd::Error or (a flip the CRC cannot see, e.g.
// none) decoded; never a crash (the ASan build of this suite runs the same loop).
TEST(Protocol, ByteFlipsAreRejectedOrHarmless) {
  const std::string req = encode_score_request(sample_request());
  const std::string res = encode_score_response(sample_response());
  int rejected = 0;
  for (uint64_t t = 0; t < 3000; ++t) {
    const std::string& base = t % 2 ? req : res;
    std::string m = base;
    const int flips = 1 + static_cast<int>(philox_u32(3, t, 0) % 3);
    for (int f = 0; f < flips; ++f) {
      const size_t at = philox_u32(3, t, 1 + 2 * f) % m.size();
      m[at] = static_cast<char>(m[at] ^ (1 + philox_u32(3, t, 2 + 2 * f) % 255));
    }
    try {
      if (t % 2) decode_score_request(m);
      else decode_score_response(m);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidData) << e.what();
      ++rejected;
    }
  }
  EXPECT_EQ(rejected, 3000);  // every flip lands in the header checks or the CRC
}

// Re-seals a body with a correct header so only the counts lie.
std::string seal(const std::string& body, uint16_t kind) {
  std::string m = "OPDT";
  const uint16_t v = 1;
  const uint64_t n = body.size();
  const uint32_t crc = crc32(body.data(), body.size()), reserved = 0;
  m.append(reinterpret_cast<const char*>(&v), 2);
  m.append(reinterpret_cast<const char*>(&kind), 2);
  m.append(reinterpret_cast<const char*>(&n), 8);
  m.append(reinterpret_cast<const char*>(&crc), 4);
  m.append(reinterpret_cast<const char*>(&reserved), 4);
  return m + body;
}

template <typename T> void put(std::string& s, T v) { s.append(reinterpret_cast<const char*>(&v), sizeof(T)); }

void expect_invalid(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "accepted; expected an error containing: " << needle;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidData) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Protocol, LyingCountsWithValidCrcAreRejectedBeforeAllocating) {
  {  // 4 billion sequences in a 20-byte body
    std::string b;
    put<uint32_t>(b, 0xFFFFFFFFu);
    put<int32_t>(b, 2);
    put<double>(b, 1.0);
    put<uint32_t>(b, 0);
    expect_invalid([&] { decode_score_request(seal(b, 1)); }, "sequence count 4294967295");
  }
  {  // one sequence claiming 1e9 ids
    std::string b;
    put<uint32_t>(b, 1);
    put<int32_t>(b, 2);
    put<double>(b, 1.0);
    put<uint32_t>(b, 0);
    put<uint32_t>(b, 1000000000u);
    put<uint32_t>(b, 1);
    put<uint32_t>(b, 2);
    put<int32_t>(b, 5);
    expect_invalid([&] { decode_score_request(seal(b, 1)); }, "sequence ids count 1000000000");
  }
  {  // fingerprint length over the limit
    std::string b;
    put<uint32_t>(b, 0);
    put<int32_t>(b, 2);
    put<double>(b, 1.0);
    put<uint32_t>(b, 100000);
    expect_invalid([&] { decode_score_request(seal(b, 1)); }, "fingerprint length 100000");
  }
  {  // response: rows x k that do not match the bytes (huge k)
    std::string b;
    put<uint32_t>(b, 1);
    put<int32_t>(b, 0x7FFFFFFF);
    put<double>(b, 1.0);
    put<int64_t>(b, 96);
    put<uint32_t>(b, 1);
    put<uint32_t>(b, 3);
    put<int32_t>(b, 1);
    expect_invalid([&] { decode_score_response(seal(b, 2)); }, "do not match");
  }
  {  // response: negative k
    std::string b;
    put<uint32_t>(b, 0);
    put<int32_t>(b, -4);
    put<double>(b, 1.0);
    put<int64_t>(b, 96);
    expect_invalid([&] { decode_score_response(seal(b, 2)); }, "k = -4");
  }
  {  // trailing garbage after a valid request
    std::string m = encode_score_request(sample_request());
    std::string body = m.substr(24) + "xx";
    expect_invalid([&] { decode_score_request(seal(body, 1)); }, "left over");
  }
  // wrong kind, version, magic
  std::string m = encode_score_request(sample_request());
  expect_invalid([&] { decode_score_response(m); }, "message kind 1, expected 2");
  std::string v = m;
  v[4] = 2;
  expect_invalid([&] { decode_score_request(v); }, "protocol version 2 is not supported");
  expect_invalid([&] { decode_score_request("{\"k\": 1, \"sequences\": []}  and more bytes"); },
                 "bad magic");
}

// A remote teacher that sends wrong numbers in a well-formed message: byte flips in the body,
// resealed with a correct header and CRC so they pass the transport checks. Each response must be
// rejected as InvalidData by the decoder, the shape check against its request or the payload
// validation the client runs, or pass all three with values inside their limits; each request
// must be rejected (InvalidData by the decoder, InvalidArgument by check_score_request) or be a
// request the scorer may run. Nothing else (the ASan build also checks every memory access).
TEST(Protocol, ResealedByteFlipsAreRejectedOrPassTheClientChecks) {
  const ScoreResponse base = sample_response();  // 2 sequences: 3 rows from 2, 1 row from 1
  ScoreRequest req;
  req.k = base.k;
  req.temperature = base.temperature;
  req.sequences.push_back({{5, 17, 3, 42, 9}, 2, 5});
  req.sequences.push_back({{1, 8}, 1, 2});
  LossConfig cfg;
  cfg.temperature = base.temperature;
  const std::string res_body = encode_score_response(base).substr(kTeacherHeaderBytes);
  const std::string req_body = encode_score_request(sample_request()).substr(kTeacherHeaderBytes);
  const int64_t vocab = base.vocab_size;
  int rejected[2] = {0, 0}, accepted[2] = {0, 0};
  for (uint64_t t = 0; t < 4000; ++t) {
    const bool is_req = t % 2;
    std::string b = is_req ? req_body : res_body;
    const int flips = 1 + static_cast<int>(philox_u32(5, t, 0) % 3);
    for (int f = 0; f < flips; ++f) {
      const size_t at = philox_u32(5, t, 1 + 2 * f) % b.size();
      b[at] = static_cast<char>(b[at] ^ (1 + philox_u32(5, t, 2 + 2 * f) % 255));
    }
    const std::string m = seal(b, is_req ? 1 : 2);
    try {
      if (is_req) {
        const ScoreRequest q = decode_score_request(m);
        check_score_request(q, vocab, ScoreLimits{});
        for (const auto& s : q.sequences)
          for (int32_t id : s.ids) ASSERT_TRUE(id >= 0 && id < vocab) << id;
      } else {
        const ScoreResponse r = decode_score_response(m);
        check_response_matches(r, req);
        const TeacherTopK v = validate_teacher_payload(to_teacher_payload(r), completion_layout(req),
                                                       vocab, cfg, DType::F32);
        for (int64_t i = 0; i < v.rows * v.k; ++i) {
          const int32_t id = v.ids.data<int32_t>()[i];
          ASSERT_TRUE(id == kEmptySlot || (id >= 0 && id < vocab)) << id;
          ASSERT_TRUE(std::isfinite(v.logprobs.data<float>()[i]) || id == kEmptySlot);
        }
      }
      ++accepted[is_req];
    } catch (const Error& e) {
      EXPECT_TRUE(e.kind() == ErrorKind::InvalidData ||
                  (is_req && e.kind() == ErrorKind::InvalidArgument))
          << e.what();
      ++rejected[is_req];
    }
  }
  std::printf("[ resealed ] responses: %d rejected, %d passed; requests: %d rejected, %d passed\n",
              rejected[0], accepted[0], rejected[1], accepted[1]);
  // Flips in ids, counts and offsets are caught; flips in low mantissa bits pass (still valid).
  EXPECT_GT(rejected[0], 1000);
  EXPECT_GT(rejected[1], 1000);
  EXPECT_GT(accepted[0] + accepted[1], 0);
}

TEST(Protocol, MalformedJsonIsNamed) {
  expect_invalid([] { parse_json("{\"k\": 3,", "score request"); }, "malformed JSON");
  auto req = [](const char* text) { return score_request_from_json(parse_json(text, "t")); };
  expect_invalid([&] { req("[1,2]"); }, "expected a JSON object");
  expect_invalid([&] { req(R"({"sequences": []})"); }, "missing field 'k'");
  expect_invalid([&] { req(R"({"k": "3", "sequences": []})"); }, "expected an integer");
  expect_invalid([&] { req(R"({"k": 1.5, "sequences": []})"); }, "expected an integer");
  expect_invalid([&] { req(R"({"k": -1, "sequences": []})"); }, "-1 is outside");
  expect_invalid([&] { req(R"({"k": 1, "sequences": [{"ids": [1, 99999999999]}]})"); },
                 "99999999999 is outside");
  expect_invalid([&] { req(R"({"k": 1, "sequences": [{"ids": [1, 2], "bgin": 1}]})"); },
                 "unknown field 'bgin'");
  expect_invalid([&] { req(R"({"k": 1, "temprature": 2, "sequences": []})"); },
                 "unknown field 'temprature'");
  expect_invalid([&] { req(R"({"k": 1, "sequences": {"ids": [1]}})"); }, "expected an array");
  auto res = [](const char* text) { return score_response_from_json(parse_json(text, "t")); };
  expect_invalid([&] { res(R"({"k": 2, "temperature": 1, "vocab_size": 96, "sequences": [{"begin": 1, "ids": [[1]], "logprobs": [[-1]], "actual_logprobs": [-1]}]})"); },
                 "expected 2 ids and logprobs");
  expect_invalid([&] { res(R"({"k": 1, "temperature": 1, "vocab_size": 96, "sequences": [{"begin": 1, "ids": [[1]], "logprobs": [[null]], "actual_logprobs": [-1]}]})"); },
                 "expected a number");
}

// --- vLLM ---------------------------------------------------------------------------------------

std::string read_fixture(const std::string& rel) { return test::read_file(test::fixture_path(rel)); }

ScoreRequest fixture_request() {
  ScoreRequest q;
  q.k = 2;
  q.sequences.push_back({{5, 17, 3, 42}, 1, 4});
  q.sequences.push_back({{7, 7, 90}, 1, 3});
  return q;
}

TEST(VllmFormat, ParsesTheDocumentedShape) {
  const auto j = parse_json(read_fixture("teacher/vllm_completions_prompt_logprobs.json"), "fixture");
  ScoreRequest q = fixture_request();
  ScoreResponse r = parse_vllm_prompt_logprobs(j, q, 96);
  // Expected values read off the fixture by hand (top-K by rank, actual token separately).
  EXPECT_EQ(r.k, 2);
  EXPECT_EQ(r.temperature, 1.0);
  EXPECT_EQ(r.seq_begin, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(r.row_offsets, (std::vector<int64_t>{0, 3, 5}));
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2, 3, 8, 41, 42, 7, 11, 12, 13}));
  const std::vector<float> lp = {-0.6931471806f, -1.3862943611f, -0.1053605157f, -2.9957322736f,
                                 -0.4f, -2.5f, -0.2231435513f, -1.8971199849f, -0.5108256238f,
                                 -1.2039728043f};
  EXPECT_EQ(r.logprobs, lp);
  EXPECT_EQ(r.actual_logprobs,
            (std::vector<float>{-3.0f, -0.1053605157f, -2.5f, -0.2231435513f, -9999.0f}));
  // Scored range narrower than the prompt: only those positions.
  q.sequences[0].begin = 2;
  q.sequences[0].end = 3;
  ScoreResponse n = parse_vllm_prompt_logprobs(j, q, 96);
  EXPECT_EQ(n.row_offsets, (std::vector<int64_t>{0, 1, 3}));
  EXPECT_EQ(n.ids[0], 3);
  // And the parsed payload passes the loss's validation at T = 1 (topk+tail), and is refused
  // for topk+tail at T = 2 (vLLM cannot temper), accepted for topk at T = 2.
  LossConfig cfg;
  EXPECT_NO_THROW(validate_teacher_payload(to_teacher_payload(r), completion_layout(fixture_request()),
                                           96, cfg, DType::F32));
  cfg.temperature = 2.0;
  EXPECT_THROW(validate_teacher_payload(to_teacher_payload(r), completion_layout(fixture_request()),
                                        96, cfg, DType::F32),
               Error);
  cfg.mode = SupportMode::TopK;
  EXPECT_NO_THROW(validate_teacher_payload(to_teacher_payload(r), completion_layout(fixture_request()),
                                           96, cfg, DType::F32));
}

TEST(VllmFormat, MalformedResponsesAreNamed) {
  const std::string text = read_fixture("teacher/vllm_completions_prompt_logprobs.json");
  auto mutate = [&](const std::function<void(nlohmann::json&)>& fn) {
    auto j = parse_json(text, "fixture");
    fn(j);
    return j;
  };
  auto parse = [&](const nlohmann::json& j) { parse_vllm_prompt_logprobs(j, fixture_request(), 96); };
  auto choice0 = [](nlohmann::json& j) -> nlohmann::json& { return j["choices"][1]; };  // index 0
  expect_invalid([&] { parse(mutate([&](auto& j) { choice0(j)["prompt_logprobs"][0] = nlohmann::json::object(); })); },
                 "prompt_logprobs[0] must be null");
  expect_invalid([&] { parse(mutate([&](auto& j) { choice0(j)["prompt_logprobs"].erase(3); })); },
                 "has 3 entries for a prompt of 4 tokens");
  expect_invalid([&] { parse(mutate([&](auto& j) { choice0(j)["prompt_logprobs"][1].erase("17"); })); },
                 "prompt token 17 is missing");
  expect_invalid([&] {
    parse(mutate([&](auto& j) {
      choice0(j)["prompt_logprobs"][2]["50"] = {{"logprob", -5.0}, {"rank", 3}};
      choice0(j)["prompt_logprobs"][2]["51"] = {{"logprob", -6.0}, {"rank", 4}};
    }));
  }, "4 entries, expected K = 2");
  expect_invalid([&] { parse(mutate([&](auto& j) { choice0(j)["prompt_logprobs"][2]["-5"] = {{"logprob", -5.0}, {"rank", 3}}; })); },
                 "key '-5' is not a token id");
  expect_invalid([&] { parse(mutate([&](auto& j) { choice0(j)["prompt_logprobs"][3]["41"]["logprob"] = "x"; })); },
                 "expected a number");
  expect_invalid([&] { parse(mutate([&](auto& j) { j["choices"][0]["index"] = 0; })); },
                 "index 0 appears twice");
  expect_invalid([&] { parse(mutate([&](auto& j) { j["choices"].erase(0); })); }, "1 choices for 2 prompts");
  expect_invalid([&] { parse(mutate([&](auto& j) { choice0(j)["prompt_logprobs"] = nullptr; })); },
                 "was prompt_logprobs requested?");
  // Out-of-range ids parse (they are numbers) but validation names them.
  auto j = mutate([&](auto& j) {
    auto& d = choice0(j)["prompt_logprobs"][2];
    d["500"] = d["8"];
    d.erase("8");
  });
  ScoreResponse r = parse_vllm_prompt_logprobs(j, fixture_request(), 96);
  try {
    validate_teacher_payload(to_teacher_payload(r), completion_layout(fixture_request()), 96,
                             LossConfig{}, DType::F32);
    ADD_FAILURE() << "id 500 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("id 500 (entry 1) is outside the student vocabulary [0, 96)"),
              std::string::npos)
        << e.what();
  }
}

// The prompt token outside the top K is told by its id, not by its rank: vLLM 0.x ranks it
// 1 + #{v: z_v > z_y}, so when its logprob ties the K-th entry's (the top-K took another id of
// that value) its rank is K or better and sorts beside or before a top-K entry. Before, such a
// position was refused ("the one ranked last is token ..., not the prompt token"), and bf16
// logits tie often. Entries come out in the protocol's order whatever the dict's order.
TEST(VllmFormat, APromptTokenTiedWithTheKthEntryIsNotMistakenForATopKEntry) {
  auto j = parse_json(read_fixture("teacher/vllm_completions_prompt_logprobs.json"), "fixture");
  // Choice for prompt 0, position 2 (prompt token 3): top-2 {50, 60} at -1.5, the prompt
  // token 3 at -1.5 too (a three-way tie), ranked 1 like both.
  auto& d = j["choices"][1]["prompt_logprobs"][2];
  d = {{"60", {{"logprob", -1.5}, {"rank", 2}}},
       {"3", {{"logprob", -1.5}, {"rank", 1}}},
       {"50", {{"logprob", -1.5}, {"rank", 1}}}};
  ScoreResponse r = parse_vllm_prompt_logprobs(j, fixture_request(), 96);
  EXPECT_EQ(std::vector<int32_t>(r.ids.begin() + 2, r.ids.begin() + 4), (std::vector<int32_t>{50, 60}));
  EXPECT_EQ(r.actual_logprobs[1], -1.5f);
  // The prompt token tied with the K-th (rank K, as vLLM 0.x writes it) and a smaller id.
  d = {{"9", {{"logprob", -0.5}, {"rank", 1}}},
       {"3", {{"logprob", -2.25}, {"rank", 2}}},
       {"70", {{"logprob", -2.25}, {"rank", 2}}}};
  r = parse_vllm_prompt_logprobs(j, fixture_request(), 96);
  EXPECT_EQ(std::vector<int32_t>(r.ids.begin() + 2, r.ids.begin() + 4), (std::vector<int32_t>{9, 70}));
  EXPECT_EQ(std::vector<float>(r.logprobs.begin() + 2, r.logprobs.begin() + 4),
            (std::vector<float>{-0.5f, -2.25f}));
  // But a prompt token "outside the top K" that is more likely than a top-K entry is not vLLM.
  d = {{"9", {{"logprob", -0.5}, {"rank", 1}}},
       {"3", {{"logprob", -1.0}, {"rank", 3}}},
       {"70", {{"logprob", -2.25}, {"rank", 2}}}};
  expect_invalid([&] { parse_vllm_prompt_logprobs(j, fixture_request(), 96); },
                 "prompt token 3 is not in the top K, but its logprob -1 is above that of top-K token 70");
}

// sort_response_rows: any order becomes the protocol's (logprob descending, ties by smaller
// id); rows already in it and rows with a NaN are left alone; the count says how many moved.
TEST(Protocol, SortResponseRowsPutsEntriesInTheProtocolsOrder) {
  ScoreResponse r;
  r.k = 3;
  r.row_offsets = {0, 4};
  r.seq_begin = {1};
  r.ids = {5, 6, 7, /**/ 9, 2, 4, /**/ 8, 1, 3, /**/ 1, 2, 3};
  r.logprobs = {-1, -2, -3, /**/ -3, -1, -1, /**/ -2, NAN, -1, /**/ -0.5f, -0.5f, -4};
  r.actual_logprobs = {-1, -1, -1, -1};
  EXPECT_EQ(sort_response_rows(r), 1);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{5, 6, 7, 2, 4, 9, 8, 1, 3, 1, 2, 3}));
  EXPECT_EQ(r.logprobs[3], -1.0f);
  EXPECT_EQ(r.logprobs[5], -3.0f);
  EXPECT_TRUE(std::isnan(r.logprobs[7]));  // left as sent: validation names it
  EXPECT_EQ(sort_response_rows(r), 0);
}

// --- generation (/v1/completions with max_tokens > 1: --seq-kd with a remote teacher) ---------

GenerateRequest generation_request() {
  GenerateRequest g;
  g.prompts = {{5, 17, 3, 42}, {7, 7, 90}};
  g.max_tokens = 4;
  return g;
}

TEST(GenerationFormat, RequestCarriesVllmSamplingFieldsAndOpdStreamKeys) {
  GenerateRequest g = generation_request();
  g.temperature = 0.7;
  g.top_p = 0.9;
  g.min_p = 0.05;
  g.top_k = 0;  // off: vLLM's -1
  g.seed = 0xfedcba9876543210ull;  // sent as the int64 with the same bits (vLLM's range)
  g.ignore_eos = true;
  g.stop_token_ids = {2, 3};
  g.stream_keys = {1, 0xffffffffffffffffull};
  const nlohmann::json j = generate_request_to_json(g, "teacher-model");
  EXPECT_EQ(j["model"], "teacher-model");
  EXPECT_EQ(j["prompt"], nlohmann::json::parse("[[5,17,3,42],[7,7,90]]"));
  EXPECT_EQ(j["max_tokens"].get<int64_t>(), 4);
  EXPECT_EQ(j["temperature"].get<double>(), 0.7);
  EXPECT_EQ(j["top_p"].get<double>(), 0.9);
  EXPECT_EQ(j["min_p"].get<double>(), 0.05);
  EXPECT_EQ(j["top_k"].get<int64_t>(), -1);
  EXPECT_EQ(static_cast<uint64_t>(j["seed"].get<int64_t>()), g.seed);
  EXPECT_TRUE(j["seed"].is_number_integer() && j["seed"].get<int64_t>() < 0);
  EXPECT_TRUE(j["ignore_eos"].get<bool>());
  EXPECT_EQ(j["stop_token_ids"], nlohmann::json::parse("[2,3]"));
  EXPECT_EQ(j["opd_stream_keys"][1].get<uint64_t>(), 0xffffffffffffffffull);
  EXPECT_EQ(j["n"].get<int64_t>(), 1);
  EXPECT_EQ(j["logprobs"].get<int64_t>(), 0);
  EXPECT_TRUE(j["return_token_ids"].get<bool>());
  EXPECT_TRUE(j["return_tokens_as_token_ids"].get<bool>());
  g.top_k = 20;
  g.stream_keys.clear();
  const nlohmann::json k = generate_request_to_json(g, "");
  EXPECT_EQ(k["top_k"].get<int64_t>(), 20);
  EXPECT_FALSE(k.contains("model"));
  EXPECT_FALSE(k.contains("opd_stream_keys"));
}

TEST(GenerationFormat, ParsesTokenIdsOrTheirTokenStrings) {
  const auto j = parse_json(read_fixture("teacher/vllm_completions_generation.json"), "fixture");
  const auto check = [](const std::vector<GeneratedCompletion>& out) {
    ASSERT_EQ(out.size(), 2u);
    EXPECT_EQ(out[0].ids, (std::vector<int32_t>{10, 11, 95, 0}));
    EXPECT_FALSE(out[0].stopped);
    EXPECT_EQ(out[0].logprobs, (std::vector<float>{-0.5f, -0.125f, -2.0f, -0.75f}));
    EXPECT_EQ(out[1].ids, (std::vector<int32_t>{44, 45, 2}));
    EXPECT_TRUE(out[1].stopped);
    EXPECT_EQ(out[1].logprobs, (std::vector<float>{-0.25f, -1.5f, -0.0625f}));
  };
  check(parse_generation_response(j, generation_request(), 96));
  // A vLLM without return_token_ids: the ids come from logprobs.tokens ("token_id:N").
  auto no_ids = j;
  for (auto& c : no_ids["choices"]) c.erase("token_ids");
  check(parse_generation_response(no_ids, generation_request(), 96));
  // Without logprobs the ids still parse; the logprobs are then empty.
  auto no_lp = j;
  for (auto& c : no_lp["choices"]) c["logprobs"] = nullptr;
  const auto out = parse_generation_response(no_lp, generation_request(), 96);
  EXPECT_EQ(out[0].ids, (std::vector<int32_t>{10, 11, 95, 0}));
  EXPECT_TRUE(out[0].logprobs.empty());
}

TEST(GenerationFormat, MalformedResponsesAreNamed) {
  const std::string text = read_fixture("teacher/vllm_completions_generation.json");
  auto parse = [&](const std::function<void(nlohmann::json&)>& fn, int64_t vocab = 96) {
    auto j = parse_json(text, "fixture");
    fn(j);
    parse_generation_response(j, generation_request(), vocab);
  };
  auto c0 = [](nlohmann::json& j) -> nlohmann::json& { return j["choices"][1]; };  // index 0
  expect_invalid([&] { parse([](auto&) {}, 95); },
                 "token_ids[2]: 95 is outside [0, 94]");  // the student's vocabulary decides
  expect_invalid([&] { parse([&](auto& j) { c0(j)["token_ids"][1] = -3; }); },
                 "choice for prompt 0.token_ids[1]: -3 is outside [0, 95]");
  expect_invalid([&] { parse([&](auto& j) { c0(j)["token_ids"][1] = 1.5; }); },
                 "token_ids[1]: expected an integer");
  expect_invalid([&] { parse([&](auto& j) { c0(j)["token_ids"].push_back(3); }); },
                 "5 generated tokens, expected 1 to max_tokens = 4");
  expect_invalid([&] { parse([&](auto& j) { c0(j)["token_ids"] = nlohmann::json::array(); }); },
                 "0 generated tokens");
  expect_invalid([&] { parse([&](auto& j) { c0(j)["token_ids"].erase(3); }); },
                 "finish_reason 'length' after 3 tokens, but max_tokens is 4");
  expect_invalid([&] { parse([&](auto& j) { c0(j)["finish_reason"] = "abort"; }); },
                 "finish_reason 'abort': expected 'stop' or 'length'");
  expect_invalid([&] { parse([&](auto& j) { c0(j).erase("finish_reason"); }); },
                 "missing field 'finish_reason'");
  expect_invalid([&] { parse([&](auto& j) { j["choices"][0]["index"] = 0; }); },
                 "index 0 appears twice");
  expect_invalid([&] { parse([&](auto& j) { j["choices"].erase(0); }); },
                 "1 choices for 2 prompts");
  expect_invalid([&] { parse([&](auto& j) { j["choices"][0]["index"] = 2; }); },
                 ".index: 2 is outside [0, 1]");
  expect_invalid([&] { parse([&](auto& j) { c0(j)["token_ids"] = "10 11"; }); },
                 ".token_ids: expected a list");
  // Without token_ids, the token strings are checked the same way.
  auto tokens = [&](const nlohmann::json& t) {
    return [&, t](nlohmann::json& j) {
      c0(j).erase("token_ids");
      c0(j)["logprobs"]["tokens"][2] = t;
    };
  };
  expect_invalid([&] { parse(tokens("95")); }, "'95' is not 'token_id:N'");
  expect_invalid([&] { parse(tokens("token_id:-1")); }, "'token_id:-1' is not 'token_id:N'");
  expect_invalid([&] { parse(tokens("token_id:96")); }, "token id 96 is outside the vocabulary [0, 96)");
  expect_invalid([&] { parse(tokens("token_id:99999999999")); }, "is not 'token_id:N'");
  expect_invalid([&] { parse(tokens(7)); }, "expected a string");
  expect_invalid([&] { parse([&](auto& j) { c0(j).erase("token_ids"); c0(j)["logprobs"] = nullptr; }); },
                 "no token_ids and no logprobs.tokens");
}

}  // namespace
}  // namespace opd
