// Teacher wire protocol: binary and JSON codecs and the vLLM prompt_logprobs parser
// (protocol.h; byte layout in docs/teacher_protocol.md).
#include "teacher/protocol.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include "core/error.h"
#include "core/text_io.h"
#include "loss/teacher_payload.h"  // canonical_entry_before

namespace opd {

static_assert(std::endian::native == std::endian::little,
              "the wire format is little-endian and is written with memcpy on little-endian hosts");

// --- CRC-32 -----------------------------------------------------------------------------------

namespace {
// Slicing-by-8 (Kounavis & Berry, "A Systematic Approach to Building High Performance
// Software-based CRC Generators", 2005): t[k][i] is the CRC of byte i followed by k zero bytes,
// so 8 input bytes fold in with 8 lookups instead of 8 dependent steps (~8x the bytewise loop;
// a W1 response is 17 MB). Same reflected IEEE polynomial, same value as the bytewise form.
using CrcTables = std::array<std::array<uint32_t, 256>, 8>;
CrcTables make_crc_tables() {
  CrcTables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int b = 0; b < 8; ++b) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    t[0][i] = c;
  }
  for (int k = 1; k < 8; ++k)
    for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFFu];
  return t;
}
}  // namespace

uint32_t crc32(const void* data, size_t bytes) {
  static_assert(std::endian::native == std::endian::little, "the 8-byte fold reads little-endian");
  static const CrcTables t = make_crc_tables();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (; bytes >= 8; bytes -= 8, p += 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFFu] ^ t[2][(hi >> 8) & 0xFFu] ^ t[1][(hi >> 16) & 0xFFu] ^ t[0][hi >> 24];
  }
  for (; bytes > 0; --bytes, ++p) c = t[0][(c ^ *p) & 0xFFu] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

// --- binary -----------------------------------------------------------------------------------

namespace {

class Writer {
 public:
  template <typename T> void put(T v) {
    const size_t at = out_.size();
    out_.resize(at + sizeof(T));
    std::memcpy(out_.data() + at, &v, sizeof(T));
  }
  template <typename T> void put_array(const std::vector<T>& v) {
    const size_t at = out_.size();
    out_.resize(at + v.size() * sizeof(T));
    if (!v.empty()) std::memcpy(out_.data() + at, v.data(), v.size() * sizeof(T));
  }
  void reserve(size_t body_bytes) { out_.reserve(kTeacherHeaderBytes + body_bytes); }
  void put_bytes(const std::string& s) {
    out_.append(s);
  }
  // Header + body: the body is everything written after the header's place (no copy of it).
  std::string finish(MessageKind kind) {
    char* msg = out_.data();
    std::memcpy(msg, "OPDT", 4);
    const uint16_t version = kTeacherProtocolVersion, k = static_cast<uint16_t>(kind);
    const uint64_t body = out_.size() - kTeacherHeaderBytes;
    const uint32_t crc = crc32(msg + kTeacherHeaderBytes, body), reserved = 0;
    std::memcpy(msg + 4, &version, 2);
    std::memcpy(msg + 6, &k, 2);
    std::memcpy(msg + 8, &body, 8);
    std::memcpy(msg + 16, &crc, 4);
    std::memcpy(msg + 20, &reserved, 4);
    return std::move(out_);
  }

 private:
  std::string out_ = std::string(kTeacherHeaderBytes, '\0');  // the header's place
};

class Reader {
 public:
  Reader(std::string_view body, const char* what) : b_(body), what_(what) {}
  size_t remaining() const { return b_.size() - pos_; }
  void need(uint64_t bytes, const char* field) const {
    OPD_CHECK(bytes <= remaining(), InvalidData, what_, ": ", field, " needs ", bytes,
              " bytes at offset ", pos_, " but only ", remaining(), " of the body's ", b_.size(),
              " bytes remain (truncated body or wrong count)");
  }
  template <typename T> T get(const char* field) {
    need(sizeof(T), field);
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  // count elements of T; count is checked against the remaining bytes before allocating.
  template <typename T> void get_array(std::vector<T>& out, uint64_t count, const char* field) {
    OPD_CHECK(count <= remaining() / sizeof(T), InvalidData, what_, ": ", field, " count ", count,
              " x ", sizeof(T), " bytes exceeds the ", remaining(), " bytes that remain");
    out.resize(static_cast<size_t>(count));
    if (count) std::memcpy(out.data(), b_.data() + pos_, count * sizeof(T));
    pos_ += count * sizeof(T);
  }
  std::string get_string(uint64_t bytes, const char* field) {
    need(bytes, field);
    std::string s(b_.substr(pos_, bytes));
    pos_ += bytes;
    return s;
  }
  void expect_end() const {
    OPD_CHECK(remaining() == 0, InvalidData, what_, ": ", remaining(),
              " bytes left over after the last field (body ", b_.size(), " bytes)");
  }

 private:
  std::string_view b_;
  size_t pos_ = 0;
  const char* what_;
};

// Validates the header and returns the body.
std::string_view open_message(std::string_view msg, MessageKind kind, const char* what) {
  OPD_CHECK(msg.size() >= kTeacherHeaderBytes, InvalidData, what, ": message of ", msg.size(),
            " bytes is shorter than the ", kTeacherHeaderBytes, "-byte header");
  OPD_CHECK(std::memcmp(msg.data(), "OPDT", 4) == 0, InvalidData, what,
            ": bad magic (expected 'OPDT'; is this the binary protocol?)");
  uint16_t version, k;
  uint64_t body;
  uint32_t crc, reserved;
  std::memcpy(&version, msg.data() + 4, 2);
  std::memcpy(&k, msg.data() + 6, 2);
  std::memcpy(&body, msg.data() + 8, 8);
  std::memcpy(&crc, msg.data() + 16, 4);
  std::memcpy(&reserved, msg.data() + 20, 4);
  OPD_CHECK(version == kTeacherProtocolVersion, InvalidData, what, ": protocol version ", version,
            " is not supported (this build speaks version ", kTeacherProtocolVersion, ")");
  OPD_CHECK(k == static_cast<uint16_t>(kind), InvalidData, what, ": message kind ", k,
            ", expected ", static_cast<uint16_t>(kind));
  OPD_CHECK(reserved == 0, InvalidData, what, ": reserved header field is ", reserved,
            ", must be 0");
  OPD_CHECK(body == msg.size() - kTeacherHeaderBytes, InvalidData, what, ": header says ", body,
            " body bytes, the message has ", msg.size() - kTeacherHeaderBytes);
  std::string_view b = msg.substr(kTeacherHeaderBytes);
  const uint32_t actual = crc32(b.data(), b.size());
  OPD_CHECK(actual == crc, InvalidData, what, ": body CRC-32 is ", actual, ", header says ", crc,
            " (corrupted body)");
  return b;
}

uint32_t to_u32(int64_t v, const char* field) {
  OPD_CHECK(v >= 0 && v <= std::numeric_limits<uint32_t>::max(), InvalidArgument, "encode: ",
            field, " = ", v, " does not fit in u32");
  return static_cast<uint32_t>(v);
}

}  // namespace

std::string encode_score_request(const ScoreRequest& q) {
  Writer w;
  OPD_CHECK(q.model_fingerprint.size() <= kMaxFingerprintBytes, InvalidArgument,
            "encode: fingerprint of ", q.model_fingerprint.size(), " bytes exceeds ",
            kMaxFingerprintBytes);
  OPD_CHECK(q.k >= 0 && q.k <= std::numeric_limits<int32_t>::max(), InvalidArgument,
            "encode: k = ", q.k);
  w.put<uint32_t>(to_u32(static_cast<int64_t>(q.sequences.size()), "sequence count"));
  w.put<int32_t>(static_cast<int32_t>(q.k));
  w.put<double>(q.temperature);
  w.put<uint32_t>(static_cast<uint32_t>(q.model_fingerprint.size()));
  w.put_bytes(q.model_fingerprint);
  for (const auto& s : q.sequences) {
    w.put<uint32_t>(to_u32(static_cast<int64_t>(s.ids.size()), "sequence length"));
    w.put<uint32_t>(to_u32(s.begin, "begin"));
    w.put<uint32_t>(to_u32(s.end, "end"));
    w.put_array(s.ids);
  }
  return w.finish(MessageKind::ScoreRequest);
}

ScoreRequest decode_score_request(std::string_view msg) {
  constexpr const char* what = "score request";
  Reader r(open_message(msg, MessageKind::ScoreRequest, what), what);
  ScoreRequest q;
  const uint32_t n = r.get<uint32_t>("sequence count");
  q.k = r.get<int32_t>("k");
  q.temperature = r.get<double>("temperature");
  const uint32_t fp = r.get<uint32_t>("fingerprint length");
  OPD_CHECK(fp <= kMaxFingerprintBytes, InvalidData, what, ": fingerprint length ", fp,
            " exceeds ", kMaxFingerprintBytes);
  q.model_fingerprint = r.get_string(fp, "fingerprint");
  // Each sequence takes at least 12 bytes: a count above remaining / 12 is a lie.
  OPD_CHECK(n <= r.remaining() / 12, InvalidData, what, ": sequence count ", n,
            " cannot fit in the ", r.remaining(), " bytes that remain (12 bytes per sequence)");
  q.sequences.resize(n);
  for (uint32_t s = 0; s < n; ++s) {
    const uint32_t len = r.get<uint32_t>("sequence length");
    q.sequences[s].begin = r.get<uint32_t>("begin");
    q.sequences[s].end = r.get<uint32_t>("end");
    r.get_array(q.sequences[s].ids, len, "sequence ids");
  }
  r.expect_end();
  return q;
}

std::string encode_score_response(const ScoreResponse& p) {
  Writer w;
  const size_t n = p.seq_begin.size();
  OPD_CHECK(p.row_offsets.size() == n + 1, InvalidArgument, "encode: ", p.row_offsets.size(),
            " row offsets for ", n, " sequences");
  w.reserve(24 + 8 * n + 4 * p.ids.size() + 4 * p.logprobs.size() + 4 * p.actual_logprobs.size());
  w.put<uint32_t>(to_u32(static_cast<int64_t>(n), "sequence count"));
  w.put<int32_t>(static_cast<int32_t>(p.k));
  w.put<double>(p.temperature);
  w.put<int64_t>(p.vocab_size);
  for (size_t s = 0; s < n; ++s) {
    w.put<uint32_t>(to_u32(p.seq_begin[s], "begin"));
    w.put<uint32_t>(to_u32(p.row_offsets[s + 1] - p.row_offsets[s], "rows"));
  }
  w.put_array(p.ids);
  w.put_array(p.logprobs);
  w.put_array(p.actual_logprobs);
  return w.finish(MessageKind::ScoreResponse);
}

ScoreResponse decode_score_response(std::string_view msg) {
  constexpr const char* what = "score response";
  Reader r(open_message(msg, MessageKind::ScoreResponse, what), what);
  ScoreResponse p;
  const uint32_t n = r.get<uint32_t>("sequence count");
  p.k = r.get<int32_t>("k");
  OPD_CHECK(p.k >= 0, InvalidData, what, ": k = ", p.k, " is negative");
  p.temperature = r.get<double>("temperature");
  p.vocab_size = r.get<int64_t>("vocab_size");
  OPD_CHECK(n <= r.remaining() / 8, InvalidData, what, ": sequence count ", n,
            " cannot fit in the ", r.remaining(), " bytes that remain (8 bytes per sequence)");
  p.row_offsets.assign(1, 0);
  for (uint32_t s = 0; s < n; ++s) {
    p.seq_begin.push_back(r.get<uint32_t>("begin"));
    p.row_offsets.push_back(p.row_offsets.back() + r.get<uint32_t>("rows"));
  }
  const uint64_t rows = static_cast<uint64_t>(p.row_offsets.back());
  // rows * (8k + 4) bytes must remain exactly; checked without overflow.
  const uint64_t per_row = 8 * static_cast<uint64_t>(p.k) + 4;
  OPD_CHECK(rows <= r.remaining() / per_row && rows * per_row == r.remaining(), InvalidData, what,
            ": ", rows, " rows x (8 k + 4) bytes with k = ", p.k, " do not match the ",
            r.remaining(), " bytes that remain");
  r.get_array(p.ids, rows * static_cast<uint64_t>(p.k), "ids");
  r.get_array(p.logprobs, rows * static_cast<uint64_t>(p.k), "logprobs");
  r.get_array(p.actual_logprobs, rows, "actual_logprobs");
  r.expect_end();
  return p;
}

// --- JSON -------------------------------------------------------------------------------------

nlohmann::json parse_json(std::string_view text, const char* what) {
  check_json_depth(text, what);
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    OPD_FAIL(InvalidData, what, ": malformed JSON: ", e.what());
  }
}

namespace {

const nlohmann::json& field(const nlohmann::json& j, const char* name, const std::string& where) {
  OPD_CHECK(j.is_object(), InvalidData, where, ": expected a JSON object, got ", j.type_name());
  auto it = j.find(name);
  OPD_CHECK(it != j.end(), InvalidData, where, ": missing field '", name, "'");
  return *it;
}

int64_t get_int(const nlohmann::json& v, const std::string& where, int64_t lo, int64_t hi) {
  OPD_CHECK(v.is_number_integer(), InvalidData, where, ": expected an integer, got ",
            v.type_name(), " ", v.dump().substr(0, 40));
  OPD_CHECK(!(v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi)) &&
                v.get<int64_t>() >= lo && v.get<int64_t>() <= hi,
            InvalidData, where, ": ", v.dump(), " is outside [", lo, ", ", hi, "]");
  return v.get<int64_t>();
}

double get_number(const nlohmann::json& v, const std::string& where) {
  OPD_CHECK(v.is_number(), InvalidData, where, ": expected a number, got ", v.type_name());
  return v.get<double>();
}

// A /v1/completions answer's choices, one per prompt, ordered by their `index` (each index
// exactly once): choices[i] answers prompt i.
std::vector<const nlohmann::json*> choices_by_index(const nlohmann::json& j, size_t prompts,
                                                    const std::string& what) {
  const auto& choices = field(j, "choices", what);
  OPD_CHECK(choices.is_array(), InvalidData, what, ".choices: expected an array");
  OPD_CHECK(choices.size() == prompts, InvalidData, what, ": ", choices.size(), " choices for ",
            prompts, " prompts");
  std::vector<const nlohmann::json*> by_index(prompts, nullptr);
  for (size_t c = 0; c < choices.size(); ++c) {
    const std::string w = cat(what, ".choices[", c, "]");
    const int64_t idx = get_int(field(choices[c], "index", w), w + ".index", 0,
                                static_cast<int64_t>(prompts) - 1);
    OPD_CHECK(by_index[static_cast<size_t>(idx)] == nullptr, InvalidData, w, ": index ", idx,
              " appears twice");
    by_index[static_cast<size_t>(idx)] = &choices[c];
  }
  return by_index;
}

void reject_unknown(const nlohmann::json& j, std::initializer_list<const char*> known,
                    const std::string& where) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool ok = false;
    for (const char* k : known) ok = ok || it.key() == k;
    OPD_CHECK(ok, InvalidData, where, ": unknown field '", it.key(), "'");
  }
}

constexpr int64_t kI32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kI32Min = std::numeric_limits<int32_t>::min();

}  // namespace

nlohmann::json score_request_to_json(const ScoreRequest& q) {
  nlohmann::json j;
  j["k"] = q.k;
  j["temperature"] = q.temperature;
  if (!q.model_fingerprint.empty()) j["model_fingerprint"] = q.model_fingerprint;
  j["sequences"] = nlohmann::json::array();
  for (const auto& s : q.sequences)
    j["sequences"].push_back({{"ids", s.ids}, {"begin", s.begin}, {"end", s.end}});
  return j;
}

ScoreRequest score_request_from_json(const nlohmann::json& j) {
  const std::string what = "score request";
  OPD_CHECK(j.is_object(), InvalidData, what, ": expected a JSON object, got ", j.type_name());
  reject_unknown(j, {"k", "temperature", "model_fingerprint", "sequences"}, what);
  ScoreRequest q;
  q.k = get_int(field(j, "k", what), what + ".k", 0, kI32Max);
  q.temperature = j.contains("temperature") ? get_number(j["temperature"], what + ".temperature")
                                            : 1.0;
  if (j.contains("model_fingerprint")) {
    OPD_CHECK(j["model_fingerprint"].is_string(), InvalidData, what,
              ".model_fingerprint: expected a string");
    q.model_fingerprint = j["model_fingerprint"].get<std::string>();
    OPD_CHECK(q.model_fingerprint.size() <= kMaxFingerprintBytes, InvalidData, what,
              ".model_fingerprint: ", q.model_fingerprint.size(), " bytes exceed ",
              kMaxFingerprintBytes);
  }
  const auto& seqs = field(j, "sequences", what);
  OPD_CHECK(seqs.is_array(), InvalidData, what, ".sequences: expected an array");
  for (size_t s = 0; s < seqs.size(); ++s) {
    const std::string w = cat(what, ".sequences[", s, "]");
    const auto& js = seqs[s];
    OPD_CHECK(js.is_object(), InvalidData, w, ": expected an object");
    reject_unknown(js, {"ids", "begin", "end"}, w);
    const auto& ids = field(js, "ids", w);
    OPD_CHECK(ids.is_array(), InvalidData, w, ".ids: expected an array");
    ScoreSequence sq;
    sq.ids.reserve(ids.size());
    for (size_t p = 0; p < ids.size(); ++p)
      sq.ids.push_back(static_cast<int32_t>(get_int(ids[p], cat(w, ".ids[", p, "]"), kI32Min, kI32Max)));
    sq.begin = js.contains("begin") ? get_int(js["begin"], w + ".begin", 0, kI32Max) : 1;
    sq.end = js.contains("end") ? get_int(js["end"], w + ".end", 0, kI32Max)
                                : static_cast<int64_t>(sq.ids.size());
    q.sequences.push_back(std::move(sq));
  }
  return q;
}

nlohmann::json score_response_to_json(const ScoreResponse& p) {
  nlohmann::json j;
  j["object"] = "opd.score";
  j["protocol_version"] = kTeacherProtocolVersion;
  j["k"] = p.k;
  j["temperature"] = p.temperature;
  j["vocab_size"] = p.vocab_size;
  j["sequences"] = nlohmann::json::array();
  for (size_t s = 0; s < p.seq_begin.size(); ++s) {
    nlohmann::json js;
    js["begin"] = p.seq_begin[s];
    nlohmann::json ids = nlohmann::json::array(), lps = nlohmann::json::array(),
                   act = nlohmann::json::array();
    for (int64_t r = p.row_offsets[s]; r < p.row_offsets[s + 1]; ++r) {
      nlohmann::json ri = nlohmann::json::array(), rl = nlohmann::json::array();
      for (int64_t k = 0; k < p.k; ++k) {
        ri.push_back(p.ids[r * p.k + k]);
        rl.push_back(p.logprobs[r * p.k + k]);
      }
      ids.push_back(std::move(ri));
      lps.push_back(std::move(rl));
      act.push_back(p.actual_logprobs[r]);
    }
    js["ids"] = std::move(ids);
    js["logprobs"] = std::move(lps);
    js["actual_logprobs"] = std::move(act);
    j["sequences"].push_back(std::move(js));
  }
  return j;
}

ScoreResponse score_response_from_json(const nlohmann::json& j) {
  const std::string what = "score response";
  OPD_CHECK(j.is_object(), InvalidData, what, ": expected a JSON object, got ", j.type_name());
  ScoreResponse p;
  p.k = get_int(field(j, "k", what), what + ".k", 0, kI32Max);
  p.temperature = get_number(field(j, "temperature", what), what + ".temperature");
  p.vocab_size = get_int(field(j, "vocab_size", what), what + ".vocab_size", 0,
                         std::numeric_limits<int64_t>::max());
  const auto& seqs = field(j, "sequences", what);
  OPD_CHECK(seqs.is_array(), InvalidData, what, ".sequences: expected an array");
  p.row_offsets.assign(1, 0);
  for (size_t s = 0; s < seqs.size(); ++s) {
    const std::string w = cat(what, ".sequences[", s, "]");
    const auto& js = seqs[s];
    p.seq_begin.push_back(get_int(field(js, "begin", w), w + ".begin", 0, kI32Max));
    const auto& ids = field(js, "ids", w);
    const auto& lps = field(js, "logprobs", w);
    const auto& act = field(js, "actual_logprobs", w);
    OPD_CHECK(ids.is_array() && lps.is_array() && act.is_array() && ids.size() == lps.size() &&
                  ids.size() == act.size(),
              InvalidData, w, ": ids, logprobs and actual_logprobs must be arrays of one length");
    for (size_t r = 0; r < ids.size(); ++r) {
      const std::string wr = cat(w, " row ", r);
      OPD_CHECK(ids[r].is_array() && lps[r].is_array() &&
                    static_cast<int64_t>(ids[r].size()) == p.k &&
                    static_cast<int64_t>(lps[r].size()) == p.k,
                InvalidData, wr, ": expected ", p.k, " ids and logprobs");
      for (int64_t k = 0; k < p.k; ++k) {
        p.ids.push_back(static_cast<int32_t>(get_int(ids[r][k], wr + " id", kI32Min, kI32Max)));
        p.logprobs.push_back(static_cast<float>(get_number(lps[r][k], wr + " logprob")));
      }
      p.actual_logprobs.push_back(static_cast<float>(get_number(act[r], wr + " actual_logprob")));
    }
    p.row_offsets.push_back(p.row_offsets.back() + static_cast<int64_t>(ids.size()));
  }
  return p;
}

// --- vLLM -------------------------------------------------------------------------------------

nlohmann::json vllm_score_request(const ScoreRequest& q, const std::string& model) {
  nlohmann::json j;
  j["model"] = model;
  nlohmann::json prompts = nlohmann::json::array();
  for (const auto& s : q.sequences) prompts.push_back(s.ids);
  j["prompt"] = std::move(prompts);
  j["max_tokens"] = 1;
  j["prompt_logprobs"] = q.k;
  j["temperature"] = 1.0;
  return j;
}

ScoreResponse parse_vllm_prompt_logprobs(const nlohmann::json& j, const ScoreRequest& q,
                                         int64_t teacher_vocab) {
  const std::string what = "vLLM completions response";
  const std::vector<const nlohmann::json*> by_index = choices_by_index(j, q.sequences.size(), what);
  ScoreResponse p;
  p.k = q.k;
  p.temperature = 1.0;
  p.vocab_size = teacher_vocab;
  p.row_offsets.assign(1, 0);
  std::vector<std::pair<double, int64_t>> entries;  // (logprob, id) of one position
  for (size_t s = 0; s < q.sequences.size(); ++s) {
    const ScoreSequence& sq = q.sequences[s];
    const std::string w = cat(what, ": choice for prompt ", s);
    const auto& plp = field(*by_index[s], "prompt_logprobs", w);
    OPD_CHECK(plp.is_array(), InvalidData, w, ".prompt_logprobs: expected a list, got ",
              plp.type_name(), " (was prompt_logprobs requested?)");
    OPD_CHECK(plp.size() == sq.ids.size(), InvalidData, w, ".prompt_logprobs has ", plp.size(),
              " entries for a prompt of ", sq.ids.size(), " tokens");
    OPD_CHECK(!plp.empty() && plp[0].is_null(), InvalidData, w,
              ".prompt_logprobs[0] must be null (the first token has no context)");
    p.seq_begin.push_back(sq.begin);
    for (int64_t pos = sq.begin; pos < sq.end; ++pos) {
      const std::string wp = cat(w, " position ", pos);
      const auto& d = plp[static_cast<size_t>(pos)];
      OPD_CHECK(d.is_object(), InvalidData, wp, ": expected a dict of token id -> logprob, got ",
                d.type_name());
      const int32_t y = sq.ids[static_cast<size_t>(pos)];
      entries.clear();
      double actual = std::numeric_limits<double>::quiet_NaN();
      bool have_actual = false;
      for (auto it = d.begin(); it != d.end(); ++it) {
        // Keys are decimal token ids; parse strictly (no sign games, no trailing text).
        const std::string& key = it.key();
        OPD_CHECK(!key.empty() && key.size() <= 18 &&
                      std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; }),
                  InvalidData, wp, ": key '", key.substr(0, 40), "' is not a token id");
        const int64_t id = std::stoll(key);
        const std::string wk = cat(wp, " token ", id);
        const double lp = get_number(field(it.value(), "logprob", wk), wk + ".logprob");
        // "rank" is checked for its form only: the order comes from the logprobs (below).
        if (it.value().contains("rank") && !it.value()["rank"].is_null())
          get_int(it.value()["rank"], wk + ".rank", 1, std::numeric_limits<int64_t>::max());
        if (id == y) {
          actual = lp;
          have_actual = true;
        }
        entries.push_back({lp, id});
      }
      OPD_CHECK(have_actual, InvalidData, wp, ": the prompt token ", y,
                " is missing from the dict (vLLM always includes it)");
      const int64_t n = static_cast<int64_t>(entries.size());
      OPD_CHECK(n == q.k || n == q.k + 1, InvalidData, wp, ": ", n, " entries, expected K = ",
                q.k, " (or K + 1 when the prompt token is not in the top K)");
      if (n == q.k + 1) {
        // K + 1 entries: the top K and the prompt token, which vLLM adds when it is not among
        // them (a dict cannot hold it twice). It is told by its id, not by its rank: vLLM 0.x
        // ranks it 1 + #{v: z_v > z_y}, so a prompt token whose logit ties the K-th one's
        // (that top-K took another id of the same value) ranks K or better, beside or before
        // a top-K entry. (Picking "the one ranked last" refused such positions, and bf16
        // logits tie often.)
        entries.erase(std::find_if(entries.begin(), entries.end(),
                                   [&](const std::pair<double, int64_t>& e) { return e.second == y; }));
        // Outside the top K, it cannot be more likely than any entry inside (ties allowed).
        for (const auto& e : entries)
          OPD_CHECK(actual <= e.first, InvalidData, wp, ": ", n, " entries, so the prompt token ",
                    y, " is not in the top K, but its logprob ", actual,
                    " is above that of top-K token ", e.second, " (", e.first, ")");
      }
      // A dict has no order: the protocol's (logprob descending, ties by smaller id).
      std::sort(entries.begin(), entries.end(),
                [](const std::pair<double, int64_t>& a, const std::pair<double, int64_t>& b) {
                  return canonical_entry_before(a.first, a.second, b.first, b.second);
                });
      for (const auto& e : entries) {
        OPD_CHECK(e.second <= std::numeric_limits<int32_t>::max(), InvalidData, wp,
                  ": token id ", e.second, " does not fit in int32");
        p.ids.push_back(static_cast<int32_t>(e.second));
        p.logprobs.push_back(static_cast<float>(e.first));
      }
      p.actual_logprobs.push_back(static_cast<float>(actual));
    }
    p.row_offsets.push_back(p.row_offsets.back() + (sq.end - sq.begin));
  }
  return p;
}

// --- generation ---------------------------------------------------------------------------------

nlohmann::json generate_request_to_json(const GenerateRequest& q, const std::string& model) {
  nlohmann::json j;
  if (!model.empty()) j["model"] = model;
  nlohmann::json prompts = nlohmann::json::array();
  for (const auto& p : q.prompts) prompts.push_back(p);
  j["prompt"] = std::move(prompts);
  j["max_tokens"] = q.max_tokens;
  j["temperature"] = q.temperature;
  j["top_p"] = q.top_p;
  j["top_k"] = q.top_k > 0 ? q.top_k : -1;
  j["min_p"] = q.min_p;
  j["seed"] = static_cast<int64_t>(q.seed);
  j["ignore_eos"] = q.ignore_eos;
  if (!q.stop_token_ids.empty()) j["stop_token_ids"] = q.stop_token_ids;
  if (!q.stream_keys.empty()) j["opd_stream_keys"] = q.stream_keys;
  j["n"] = 1;
  j["logprobs"] = 0;
  j["return_token_ids"] = true;
  j["return_tokens_as_token_ids"] = true;
  return j;
}

std::vector<GeneratedCompletion> parse_generation_response(const nlohmann::json& j,
                                                           const GenerateRequest& q,
                                                           int64_t vocab) {
  const std::string what = "completions (generation) response";
  const std::vector<const nlohmann::json*> by_index = choices_by_index(j, q.prompts.size(), what);
  std::vector<GeneratedCompletion> out(q.prompts.size());
  for (size_t s = 0; s < q.prompts.size(); ++s) {
    const nlohmann::json& c = *by_index[s];
    const std::string w = cat(what, ": choice for prompt ", s);
    GeneratedCompletion& g = out[s];
    const nlohmann::json* lp = nullptr;
    if (c.contains("logprobs") && c["logprobs"].is_object()) lp = &c["logprobs"];
    if (c.contains("token_ids") && !c["token_ids"].is_null()) {
      const auto& ids = c["token_ids"];
      OPD_CHECK(ids.is_array(), InvalidData, w, ".token_ids: expected a list, got ",
                ids.type_name());
      for (size_t t = 0; t < ids.size(); ++t)
        g.ids.push_back(static_cast<int32_t>(
            get_int(ids[t], cat(w, ".token_ids[", t, "]"), 0, vocab - 1)));
    } else {
      // vLLM without return_token_ids: the tokens of logprobs, "token_id:N"
      // (return_tokens_as_token_ids).
      OPD_CHECK(lp != nullptr && lp->contains("tokens") && (*lp)["tokens"].is_array(),
                InvalidData, w, ": no token_ids and no logprobs.tokens (the server returns "
                "neither token ids nor tokens as 'token_id:N')");
      const auto& toks = (*lp)["tokens"];
      for (size_t t = 0; t < toks.size(); ++t) {
        const std::string wt = cat(w, ".logprobs.tokens[", t, "]");
        OPD_CHECK(toks[t].is_string(), InvalidData, wt, ": expected a string, got ",
                  toks[t].type_name());
        const std::string& str = toks[t].get_ref<const std::string&>();
        const std::string prefix = "token_id:";
        const std::string digits = str.rfind(prefix, 0) == 0 ? str.substr(prefix.size()) : "";
        OPD_CHECK(!digits.empty() && digits.size() <= 10 &&
                      std::all_of(digits.begin(), digits.end(),
                                  [](char ch) { return ch >= '0' && ch <= '9'; }),
                  InvalidData, wt, ": '", str.substr(0, 40),
                  "' is not 'token_id:N' (was return_tokens_as_token_ids honoured?)");
        const int64_t id = std::stoll(digits);
        OPD_CHECK(id < vocab, InvalidData, wt, ": token id ", id,
                  " is outside the vocabulary [0, ", vocab, ")");
        g.ids.push_back(static_cast<int32_t>(id));
      }
    }
    const int64_t n = static_cast<int64_t>(g.ids.size());
    OPD_CHECK(n >= 1 && n <= q.max_tokens, InvalidData, w, ": ", n,
              " generated tokens, expected 1 to max_tokens = ", q.max_tokens);
    const auto& fr = field(c, "finish_reason", w);
    OPD_CHECK(fr.is_string(), InvalidData, w, ".finish_reason: expected a string, got ",
              fr.type_name());
    const std::string& reason = fr.get_ref<const std::string&>();
    OPD_CHECK(reason == "stop" || reason == "length", InvalidData, w, ".finish_reason '",
              reason.substr(0, 40), "': expected 'stop' or 'length'");
    g.stopped = reason == "stop";
    OPD_CHECK(g.stopped || n == q.max_tokens, InvalidData, w, ": finish_reason 'length' after ",
              n, " tokens, but max_tokens is ", q.max_tokens);
    if (lp != nullptr && lp->contains("token_logprobs") && (*lp)["token_logprobs"].is_array()) {
      const auto& tl = (*lp)["token_logprobs"];
      // With echo the prompt's entries come first; the generated ones are the last n.
      if (static_cast<int64_t>(tl.size()) >= n) {
        for (int64_t t = static_cast<int64_t>(tl.size()) - n; t < static_cast<int64_t>(tl.size()); ++t) {
          const auto& v = tl[static_cast<size_t>(t)];
          g.logprobs.push_back(v.is_number() ? static_cast<float>(v.get<double>())
                                             : std::numeric_limits<float>::quiet_NaN());
        }
      }
    }
  }
  return out;
}

}  // namespace opd
