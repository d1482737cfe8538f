// The teacher wire protocol (docs/teacher_protocol.md is the specification): a binary form
// (little-endian, 24-byte versioned header with magic "OPDT", body length and CRC-32 of the
// body) and an equivalent JSON form, for score requests and score responses; plus the
// vLLM-compatible /v1/completions JSON with prompt_logprobs (both directions).
//
// Decoders are fuzz-safe: every count and length is checked against the bytes that remain
// before anything is read or allocated, so memory is bounded by the body size; structural
// errors are InvalidData naming the field, the value and the limit. Decoders check structure
// only; the values of a response (ids, NaN, sums) are checked by validate_teacher_payload
// (loss/teacher_payload.h) in the client, and the ids of a request by check_score_request.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "teacher/scorer.h"

namespace opd {

inline constexpr uint16_t kTeacherProtocolVersion = 1;
inline constexpr size_t kTeacherHeaderBytes = 24;
inline constexpr size_t kMaxFingerprintBytes = 256;
inline constexpr const char* kBinaryContentType = "application/x-opd-score";

enum class MessageKind : uint16_t { ScoreRequest = 1, ScoreResponse = 2 };

// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320, init and final xor 0xFFFFFFFF): the
// same value as zlib's crc32() and Python's zlib.crc32().
uint32_t crc32(const void* data, size_t bytes);

std::string encode_score_request(const ScoreRequest& request);
ScoreRequest decode_score_request(std::string_view message);
std::string encode_score_response(const ScoreResponse& response);
ScoreResponse decode_score_response(std::string_view message);

nlohmann::json score_request_to_json(const ScoreRequest& request);
ScoreRequest score_request_from_json(const nlohmann::json& j);
nlohmann::json score_response_to_json(const ScoreResponse& response);
ScoreResponse score_response_from_json(const nlohmann::json& j);

// Parses JSON text; malformed text is InvalidData naming `what` and the parser's message.
nlohmann::json parse_json(std::string_view text, const char* what);

// --- vLLM /v1/completions (OpenAI API with vLLM's prompt_logprobs extension) -----------------
// Request for a vLLM server: every sequence as a token-id prompt, max_tokens 1, prompt_logprobs K.
nlohmann::json vllm_score_request(const ScoreRequest& request, const std::string& model);
// Parses choices[i].prompt_logprobs (a list with null at position 0, then per position a dict
// {"<token id>": {"logprob", "rank", "decoded_token"}} holding the top-K by rank plus the
// prompt's actual token when it is not among them) into a response for `request`. vLLM reports
// logprobs at temperature 1, so the response's temperature is 1 (validation then decides
// what the distillation temperature allows). Throws InvalidData naming choice, position, key.
ScoreResponse parse_vllm_prompt_logprobs(const nlohmann::json& response,
                                         const ScoreRequest& request, int64_t teacher_vocab);

// --- Generation through /v1/completions (max_tokens > 1): --seq-kd with a remote teacher ------
// The request a client sends (vLLM's sampling fields) and what it reads back per prompt.
struct GenerateRequest {
  std::vector<std::vector<int32_t>> prompts;  // token ids, each non-empty
  int64_t max_tokens = 16;                    // >= 1 tokens per completion
  double temperature = 1.0, top_p = 1.0, min_p = 0.0;
  int64_t top_k = 0;                          // 0 = off (sent as -1, vLLM's "off")
  uint64_t seed = 0;                          // sent as the int64 with the same bits
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;        // besides the model's EOS ids
  // opd extension (field "opd_stream_keys", ignored by vLLM): the sampling stream of each
  // prompt, so that a remote opd teacher draws exactly the samples an in-process one would
  // (rollout/sampler.h). Empty: the server's default per prompt.
  std::vector<uint64_t> stream_keys;
};
struct GeneratedCompletion {
  std::vector<int32_t> ids;     // generated tokens; an EOS / stop token that ended it included
  std::vector<float> logprobs;  // log p of each token under the model at T = 1 (empty: not sent)
  bool stopped = false;         // finish_reason "stop" (EOS or a stop token); false: "length"
  std::string text;             // the ids decoded, when the generator has a tokenizer ("" else)
};
// The JSON body of a generation request (`model` omitted when empty). Asks for the token ids
// both ways vLLM knows (`return_token_ids`, and `logprobs: 0` with
// `return_tokens_as_token_ids`), so that versions with either give ids back.
nlohmann::json generate_request_to_json(const GenerateRequest& request, const std::string& model);
// Reads a /v1/completions answer to `request`: one choice per prompt (matched by `index`, each
// once), its generated ids from `token_ids` (or, when absent, from `logprobs.tokens` written
// "token_id:N"), 1..max_tokens of them, each in [0, vocab); finish_reason "stop" or "length"
// ("length" only with max_tokens ids). Throws InvalidData naming the choice, position and value.
std::vector<GeneratedCompletion> parse_generation_response(const nlohmann::json& response,
                                                           const GenerateRequest& request,
                                                           int64_t vocab);

}  // namespace opd
