// Teacher scoring (DESIGN.md "Data flow"): for each requested position p of a token sequence
// (a [prompt | completion] row), the top-K (id, logprob) of the teacher's full-vocabulary
// next-token distribution at temperature T, and the logprob of the token actually at p:
//   log p_T(v | ids[0..p-1]) = z_v / T - LSE_u(z_u / T),  z = h_{p-1} W_lm^T  (all V ids).
// Position p is predicted from the hidden state of position p-1, as vLLM's prompt_logprobs
// (position 0 has no distribution). K = 0 returns only the actual token's logprob.
//
// Scorer is the one interface training sees: CpuScorer (in-process, here), CudaScorer
// (in-process on the GPU, teacher/cuda_scorer.h) and TeacherClient (teacher/client.h: an
// `opd serve` or a vLLM server) all return the same ScoreResponse; the caller turns it into a
// TeacherPayload (to_teacher_payload) and must run it through validate_teacher_payload
// (loss/teacher_payload.h) before use.
//
// Ordering of the K entries: logprob descending, ties by smaller id (every backend, the wire
// and the tests use this order, so scores are comparable entry by entry).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"  // Device
#include "loss/teacher_payload.h"

namespace opd {

class Transformer;

struct ScoreSequence {
  std::vector<int32_t> ids;  // [prompt | completion] token ids
  int64_t begin = 1;         // first scored position, >= 1
  int64_t end = 0;           // one past the last scored position, <= ids.size()
};

struct ScoreRequest {
  std::vector<ScoreSequence> sequences;
  int64_t k = 0;                  // entries per position, 0 <= k <= vocab
  double temperature = 1.0;       // applied to the logits before the softmax, finite and > 0
  std::string model_fingerprint;  // expected teacher tokenizer fingerprint ("" = not checked)
  bool with_ranks = false;        // also the actual token's rank (vLLM's "rank"; not on the wire)
  int64_t num_rows() const;       // sum of (end - begin)
};

// Scores of a request, sequence-major CSR with a fixed K per row.
struct ScoreResponse {
  int64_t k = 0;
  double temperature = 1.0;
  int64_t vocab_size = 0;                // the teacher's vocabulary
  std::vector<int64_t> seq_begin;        // per sequence: first scored position
  std::vector<int64_t> row_offsets;      // [sequences + 1]: rows of sequence s
  std::vector<int32_t> ids;              // [rows * k]
  std::vector<float> logprobs;           // [rows * k]
  std::vector<float> actual_logprobs;    // [rows]
  std::vector<int64_t> actual_ranks;     // [rows] when requested: 1 + #{v : z_v > z_y}
  int64_t num_rows() const { return row_offsets.empty() ? 0 : row_offsets.back(); }
  int64_t num_sequences() const { return static_cast<int64_t>(seq_begin.size()); }
};

// What a teacher reports about itself (GET /v1/models; checked against the student at connect).
struct TeacherInfo {
  std::string model_name;
  int64_t vocab_size = 0;
  std::string fingerprint;       // tokenizer_fingerprint(...).sha256 (64 hex chars; "" unknown)
  bool has_tokenizer = false;
  std::vector<int64_t> eos_token_ids;
  int64_t max_model_len = 0;     // max_position_embeddings (0 = unknown)
  // model/weights_fingerprint.h of the served model directory, as an `opd serve` reports it in
  // /v1/models ("" = not reported: vLLM, older opd servers, in-process scorers)
  std::string weights_fingerprint;
};

// Limits a scorer (and the server) enforces on a request, so a request cannot ask for
// unbounded memory. Exceeding one is an InvalidArgument naming the field, value and limit.
struct ScoreLimits {
  int64_t max_sequences = 65536;
  int64_t max_tokens = int64_t{1} << 22;           // sum of sequence lengths
  int64_t max_k = 4096;
  int64_t max_output_entries = int64_t{1} << 26;   // rows * max(k, 1) (8 bytes each on the wire)
};

// Checks structure, ranges and ids against `vocab_size` and `limits`; errors name the
// sequence, position, value and limit. Does not check the fingerprint.
void check_score_request(const ScoreRequest& request, int64_t vocab_size, const ScoreLimits& limits);

// Shape checks of a response against the request it answers (counts, positions, K, vocab);
// values are checked by validate_teacher_payload. Throws InvalidData naming the mismatch.
void check_response_matches(const ScoreResponse& response, const ScoreRequest& request);

// Puts each row's K entries in the protocol's order (logprob descending, ties by smaller id),
// as a remote teacher may not (a vLLM dict has no order; a server may be another program).
// Rows holding a NaN logprob are left as they are (validation refuses them, naming the entry
// as sent). Returns the number of rows it reordered. validate_teacher_payload orders its
// output the same way by itself; this puts the response a client returns (`opd score`) in order.
int64_t sort_response_rows(ScoreResponse& response);

// The ragged payload loss/teacher_payload.h validates (ids widened, logprobs as double).
TeacherPayload to_teacher_payload(const ScoreResponse& response);
// The completion layout the payload must line up with, from the request.
CompletionLayout completion_layout(const ScoreRequest& request);

// Shared prompts (teacher/score_plan.h): how the in-process scorers run completions of one prompt.
enum class SharedPromptMode : uint8_t {
  Auto,    // share a group when shared_prompt_cost predicts less work
  Always,  // share every eligible group (tests; measuring)
  Never,   // the dense path only (each carrier recomputes its prompt)
};
std::string_view shared_prompt_mode_name(SharedPromptMode mode);
SharedPromptMode parse_shared_prompt_mode(std::string_view name);  // "auto", "always", "never"

struct SharedPromptOptions {
  SharedPromptMode mode = SharedPromptMode::Auto;
  int64_t min_prompt_tokens = 64;  // a shorter shared prompt is recomputed per carrier
  int64_t block_size = 16;         // KV cache block (tokens); the shared prompt is cut to a multiple
  // Auto's cost model: one FLOP of paged attention (PagedForward's prefill kernel) costs this
  // many FLOPs of the dense forward (GEMMs and the dense attention kernel). The scorers set it
  // per backend (CpuScorer, CudaScorer Options; docs/teacher.md has the measurements).
  double paged_attention_cost = 1.0;
};

// One next token per sequence (for /v1/completions with max_tokens = 1): sampled from
// softmax(z / sample_temperature) by the Gumbel-max trick over vocabulary tiles with Philox
// noise keyed by (seed, sequence index, id), or argmax when sample_temperature == 0.
struct NextTokenRequest {
  std::vector<std::vector<int32_t>> prompts;
  int64_t k = 0;                  // top-K of the next-token distribution (at temperature 1)
  double sample_temperature = 1.0;
  uint64_t seed = 0;
};
struct NextToken {
  int32_t id = -1;
  float logprob = 0;                 // log p_1(id), temperature 1 (what vLLM reports)
  std::vector<int32_t> top_ids;      // k entries, the ordering above
  std::vector<float> top_logprobs;
};

class Scorer {
 public:
  virtual ~Scorer() = default;
  virtual const TeacherInfo& info() const = 0;
  // Thread-safe. Throws opd::Error: InvalidArgument for a bad request (incl. a fingerprint
  // that is not this teacher's), Io for transport failures of remote scorers.
  virtual ScoreResponse score(const ScoreRequest& request) = 0;
  // One sampled next token per prompt (Unsupported unless the backend generates).
  virtual std::vector<NextToken> next_tokens(const NextTokenRequest& request);
};

// In-process CPU scorer over a Transformer (model/transformer.h).
//
// Work per request: one transformer forward over each distinct sequence (a sequence whose
// tokens ids[0 .. end-2] are a prefix of, or equal to, another's reuses that one's hidden
// states, since causal attention makes row p depend on ids[0..p] only), packed into batches of
// at most max_batch_tokens tokens, then the lm_head in vocabulary tiles of `vocab_tile` ids
// over the scored rows only, keeping per row a running top-K heap and an online log-sum-exp.
// Completions of one prompt (different tokens after a common prompt) can share the prompt's
// K/V instead of recomputing it per sequence: the shared-prompt path of teacher/score_plan.h
// (PagedForward over a KV cache), chosen per group by `shared_prompt` (Auto: a cost model).
//
// Memory beyond the weights: the forward's per-layer activations of one batch
// (O(batch tokens x max(H, I))), hidden rows O(rows x H), one logit tile of
// row_chunk x vocab_tile floats, and the output O(rows x K); never O(tokens x V). With shared
// prompts also the KV cache of one group's step: (prompt + max_batch_tokens + a block per
// suffix) tokens x 2 x layers x Hkv x D x 4 bytes.
class CpuScorer : public Scorer {
 public:
  struct Options {
    int64_t max_batch_tokens = 16384;
    int64_t vocab_tile = 4096;
    int64_t row_chunk = 512;      // scored rows per lm_head GEMM
    ScoreLimits limits;
    // CPU cost of a paged-attention FLOP vs a dense-forward FLOP: measured in docs/teacher.md.
    SharedPromptOptions shared_prompt = {SharedPromptMode::Auto, 64, 16, 6.0};
  };
  CpuScorer(const std::string& model_dir, Options options);
  CpuScorer(const std::string& model_dir);
  ~CpuScorer() override;

  const TeacherInfo& info() const override;
  ScoreResponse score(const ScoreRequest& request) override;
  std::vector<NextToken> next_tokens(const NextTokenRequest& request) override;
  const Options& options() const;
  const Transformer& model() const;  // the f32 model it scores with (also `opd serve`'s generator)
  // Scratch bytes of the lm_head pass for `rows` scored rows (the formula above, asserted in
  // the tests): rows x H (gathered hidden) + min(rows, row_chunk) x min(tile, V) (logit tile),
  // f32, plus per-row state rows x (K x 8 + 32).
  int64_t lm_head_scratch_bytes(int64_t rows, int64_t k) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The in-process scorer of a model directory on `device`: CpuScorer on the CPU, CudaScorer
// (teacher/cuda_scorer.h, in `cuda_dtype`: bf16 or f32) on CUDA; Unsupported for CUDA in builds
// without CUDA.
std::unique_ptr<Scorer> make_local_scorer(const std::string& model_dir, Device device,
                                          DType cuda_dtype = DType::BF16);

}  // namespace opd
