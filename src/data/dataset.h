// JSONL datasets of prompts (and optional reference completions) in the formats people already
// have, turned once into token ids that are never re-tokenized later (DESIGN.md data flow):
//   messages                 OpenAI chat: the last assistant turn is the completion; everything
//                            before it is the prompt, rendered with add_generation_prompt=true.
//   prompt / completion      TRL: strings (raw text by default) or message lists (conversational).
//   prompt / response        ms-swift: chat-templated by default.
//   query / response         ms-swift: optional "system" and "history" [[query, response], ...].
//   prompt_ids / completion_ids  pre-tokenized: lists of token ids used as they are (no template,
//                            no EOS appended); checked against the id limit below.
// Each line is validated; a malformed line is an InvalidData error naming file:line and the
// problem, or, with skip_bad_lines, counted and listed in the LoadReport. Prompts longer than
// max_prompt_length follow the Truncation policy. Nothing is dropped without being counted.
// docs/data.md is the user-facing description.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/text_encoder.h"

namespace opd {

enum class DatasetFormat {
  Auto,              // detect per line from the keys present (messages > prompt/completion > ...)
  Messages,
  PromptCompletion,
  PromptResponse,
  QueryResponse,
  TokenIds,          // "prompt_ids" (+ "completion_ids")
};

// What happens to a prompt longer than max_prompt_length tokens.
enum class Truncation {
  Left,   // keep its last max_prompt_length tokens (the end of the prompt is next to the completion)
  Error,  // stop with an error naming file:line, length and limit
  Skip,   // leave the sample out; counted and listed in the LoadReport
};

// How a string prompt becomes text. Message-list prompts always go through the chat template.
enum class PromptStyle {
  Auto,  // prompt/completion (TRL): Raw; prompt/response and query/response (ms-swift): Chat
  Raw,   // the string is the model input as is (already formatted)
  Chat,  // the string is one user message, rendered with the chat template
};

struct DatasetOptions {
  DatasetFormat format = DatasetFormat::Auto;
  PromptStyle prompt_style = PromptStyle::Auto;
  int64_t max_prompt_length = 0;  // tokens; 0 = no limit
  Truncation truncation = Truncation::Error;
  // Completion is required (distillation from dataset completions, --sft-alpha) or optional
  // (on-policy only: the student writes completions; prompt-only lines are then accepted).
  bool require_completion = true;
  // Raw-text completions get the tokenizer's EOS appended (unless they already end with it), so a
  // model trained on them learns to stop. Chat-templated completions carry their end-of-turn
  // token already and are never changed.
  bool append_eos = true;
  bool skip_bad_lines = false;
  // Ids (from text or pre-tokenized) must be < this; 0 = the tokenizer's vocabulary. The trainer
  // sets the model's vocab_size (which may exceed the tokenizer's, e.g. padded embeddings).
  int64_t id_limit = 0;
  size_t max_listed_bad_lines = 10;  // how many bad lines the report lists (all are counted)
  // A longer line is a bad line, read past without being held in memory (a file with no
  // newline would otherwise be read whole into one string). 64 MiB is ~100x a 128k-token line.
  size_t max_line_bytes = size_t{64} << 20;
  // Where the caller looks for a chat template, for the error of a chat line when it found
  // none (e.g. "MODEL_DIR (a \"chat_template\" in tokenizer_config.json, or chat_template.jinja)").
  std::string chat_template_source = "the model directory";
};

struct Sample {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> completion_ids;  // empty when the line has no completion
  // Over the whole sequence [prompt | completion]: 0 for prompt tokens, 1 for completion tokens
  // (the positions the loss is taken over).
  std::vector<uint8_t> completion_mask;
  std::string source;  // "file:line"
  int64_t sequence_length() const { return static_cast<int64_t>(prompt_ids.size() + completion_ids.size()); }
};

struct BadLine {
  std::string source;  // file:line
  std::string problem;
};

struct LoadReport {
  int64_t lines = 0;           // lines read, blank ones included
  int64_t blank_lines = 0;     // empty or whitespace-only lines (not samples)
  int64_t samples = 0;         // samples kept
  int64_t bad_lines = 0;       // malformed lines skipped (skip_bad_lines)
  std::vector<BadLine> first_bad_lines;
  int64_t skipped_too_long = 0;   // Truncation::Skip
  std::vector<std::string> first_skipped_too_long;
  int64_t truncated_left = 0;     // Truncation::Left
  int64_t prompt_tokens = 0, completion_tokens = 0;
  std::string summary() const;    // one paragraph for the log, naming every count that is not 0
};

class Dataset {
 public:
  // chat may be null when no line needs a chat template (a line that does is then a bad line).
  static Dataset load(const std::vector<std::string>& paths, const TextEncoder& encoder, const ChatRenderer* chat,
                      const DatasetOptions& options = {});

  size_t size() const { return samples_.size(); }
  const Sample& operator[](size_t i) const { return samples_[i]; }
  const std::vector<Sample>& samples() const { return samples_; }
  const LoadReport& report() const { return report_; }
  // SHA-256 over every sample's ids, in order: the identity a saved data cursor is checked against.
  const std::string& fingerprint() const { return fingerprint_; }

 private:
  std::vector<Sample> samples_;
  LoadReport report_;
  std::string fingerprint_;
};

const char* dataset_format_name(DatasetFormat f);
DatasetFormat parse_dataset_format(const std::string& s);  // auto|messages|prompt-completion|...
const char* truncation_name(Truncation t);
Truncation parse_truncation(const std::string& s);         // left|error|skip
PromptStyle parse_prompt_style(const std::string& s);      // auto|raw|chat

}  // namespace opd
