// Loading JSONL datasets into token-id samples: format detection, per-format field validation,
// chat-template rendering (prompt = render(prompt turns, add_generation_prompt=true); completion =
// the rest of render(all turns), as TRL splits conversational prompt/completion data), encoding,
// id validation against the vocabulary, the prompt-length policy and the bad-line accounting.
#include "data/dataset.h"

#include <cerrno>
#include <cstring>
#include <fstream>

#include "core/error.h"
#include "core/text_io.h"
#include "core/log.h"
#include "core/sha256.h"

namespace opd {
namespace {

using ojson = nlohmann::ordered_json;

// A problem with one line's content: becomes "file:line: problem", or a counted skip.
// std::getline with a bound: keeps at most `limit` bytes of the line (setting *too_long when
// there were more) and consumes the rest up to the newline. False at end of input.
bool read_line(std::istream& in, std::string& line, size_t limit, bool* too_long) {
  line.clear();
  *too_long = false;
  std::streambuf* sb = in.rdbuf();
  bool any = false;
  for (int c = sb->sbumpc(); c != std::char_traits<char>::eof(); c = sb->sbumpc()) {
    any = true;
    if (c == '\n') return true;
    if (line.size() < limit) line.push_back(static_cast<char>(c));
    else *too_long = true;
  }
  return any;
}

struct LineProblem {
  std::string what;
};
[[noreturn]] void bad(std::string what) { throw LineProblem{std::move(what)}; }

const char* json_type(const ojson& j) { return j.type_name(); }

bool is_blank(const std::string& s) {
  for (char c : s) if (!(c == ' ' || c == '\t' || c == '\r' || c == '\n')) return false;
  return true;
}

std::string keys_of(const ojson& obj) {
  std::string out = "[";
  for (auto it = obj.begin(); it != obj.end(); ++it) out += (out.size() > 1 ? ", " : "") + std::string("\"") + it.key() + "\"";
  return out + "]";
}

DatasetFormat detect(const ojson& obj, bool require_completion) {
  if (obj.contains("prompt_ids")) return DatasetFormat::TokenIds;
  if (obj.contains("messages")) return DatasetFormat::Messages;
  if (obj.contains("prompt") && obj.contains("completion")) return DatasetFormat::PromptCompletion;
  if (obj.contains("prompt") && obj.contains("response")) return DatasetFormat::PromptResponse;
  if (obj.contains("query") && obj.contains("response")) return DatasetFormat::QueryResponse;
  if (!require_completion && obj.contains("prompt")) return DatasetFormat::PromptCompletion;
  if (!require_completion && obj.contains("query")) return DatasetFormat::QueryResponse;
  if (obj.contains("prompt") || obj.contains("query"))
    bad(std::string("a \"") + (obj.contains("prompt") ? "prompt" : "query") +
        "\" without a reference completion (\"completion\" or \"response\"), which this use "
        "needs (SFT, dataset completions, exact match); the line has keys " + keys_of(obj));
  bad("no recognized fields: expected \"messages\", \"prompt\"/\"completion\", \"prompt\"/\"response\" or "
      "\"query\"/\"response\" or \"prompt_ids\"" + std::string(require_completion ? "" : " (or a prompt alone)") + "; the line has keys " + keys_of(obj));
}

// One message of a chat: {"role": str, "content": str | list | null (only with tool_calls)}.
void check_message(const ojson& m, const std::string& where) {
  if (!m.is_object()) bad(where + " must be an object with \"role\" and \"content\", got " + json_type(m));
  if (!m.contains("role")) bad(where + " has no \"role\"");
  if (!m["role"].is_string()) bad(where + ": \"role\" must be a string, got " + json_type(m["role"]));
  const bool has_tool_calls = m.contains("tool_calls") && !m["tool_calls"].is_null();
  if (!m.contains("content")) {
    if (!has_tool_calls) bad(where + " (role \"" + m["role"].get<std::string>() + "\") has no \"content\"");
    return;
  }
  const ojson& c = m["content"];
  if (c.is_string() || c.is_array()) return;
  if (c.is_null() && has_tool_calls) return;
  bad(where + ": \"content\" must be a string" + std::string(has_tool_calls ? ", a list or null" : " or a list of parts") +
      ", got " + json_type(c));
}

void check_messages(const ojson& msgs, const std::string& field) {
  if (!msgs.is_array()) bad("field \"" + field + "\" must be a list of messages, got " + json_type(msgs));
  if (msgs.empty()) bad("field \"" + field + "\" is an empty list");
  for (size_t k = 0; k < msgs.size(); ++k) check_message(msgs[k], cat("\"", field, "\"[", k, "]"));
}

const ojson& field(const ojson& obj, const char* name) {
  if (!obj.contains(name)) bad(cat("missing field \"", name, "\"; the line has keys ", keys_of(obj)));
  return obj[name];
}

bool empty_assistant(const ojson& m) {
  const bool has_tool_calls = m.contains("tool_calls") && !m["tool_calls"].is_null() && !m["tool_calls"].empty();
  if (has_tool_calls) return false;
  if (!m.contains("content") || m["content"].is_null()) return true;
  return (m["content"].is_string() && m["content"].get<std::string>().empty()) ||
         (m["content"].is_array() && m["content"].empty());
}

// What a line means before tokenization: either raw texts, or a conversation whose last
// `completion_turns` messages are the completion.
struct Parsed {
  bool chat = false;
  std::string prompt_text, completion_text;  // raw
  bool has_completion = false;
  ojson messages = ojson::array();           // chat: prompt turns followed by completion turns
  size_t prompt_turns = 0;
  ojson tools = nullptr;
};

Parsed parse_messages(const ojson& obj, bool require_completion) {
  Parsed p;
  p.chat = true;
  const ojson& msgs = field(obj, "messages");
  check_messages(msgs, "messages");
  if (obj.contains("tools") && !obj["tools"].is_null()) {
    if (!obj["tools"].is_array()) bad(std::string("field \"tools\" must be a list of tool schemas, got ") + json_type(obj["tools"]));
    p.tools = obj["tools"];
  }
  p.messages = msgs;
  const std::string last_role = msgs.back()["role"].get<std::string>();
  if (last_role == "assistant") {
    if (empty_assistant(msgs.back())) bad(cat("empty completion: the last assistant turn (\"messages\"[", msgs.size() - 1, "]) has no content"));
    if (msgs.size() < 2) bad("no prompt: the only message is the assistant turn");
    p.prompt_turns = msgs.size() - 1;
    p.has_completion = true;
  } else {
    if (require_completion) {
      bad(cat("no assistant turn to learn from: the last message (\"messages\"[", msgs.size() - 1, "]) has role \"", last_role,
              "\"; the completion must be the last message, with role \"assistant\""));
    }
    p.prompt_turns = msgs.size();
  }
  return p;
}

// prompt/completion and prompt/response: strings or message lists.
Parsed parse_prompt_pair(const ojson& obj, const char* completion_key, bool chat_strings, bool require_completion) {
  Parsed p;
  const ojson& prompt = field(obj, "prompt");
  const bool has_completion = obj.contains(completion_key) && !obj[completion_key].is_null();
  if (!has_completion && require_completion) field(obj, completion_key);  // names the missing field
  if (prompt.is_string()) {
    if (prompt.get<std::string>().empty()) bad("field \"prompt\" is an empty string");
    if (chat_strings) {
      p.chat = true;
      p.messages.push_back({{"role", "user"}, {"content", prompt}});
    } else {
      p.prompt_text = prompt.get<std::string>();
    }
  } else if (prompt.is_array()) {
    check_messages(prompt, "prompt");
    p.chat = true;
    p.messages = prompt;
  } else {
    bad(std::string("field \"prompt\" must be a string or a list of messages, got ") + json_type(prompt));
  }
  p.prompt_turns = p.chat ? p.messages.size() : 0;
  if (!has_completion) return p;
  const ojson& c = obj[completion_key];
  p.has_completion = true;
  if (c.is_string()) {
    if (c.get<std::string>().empty()) bad(cat("empty completion: field \"", completion_key, "\" is an empty string"));
    if (p.chat) p.messages.push_back({{"role", "assistant"}, {"content", c}});
    else p.completion_text = c.get<std::string>();
  } else if (c.is_array()) {
    if (!p.chat) bad(cat("field \"", completion_key, "\" is a list of messages but \"prompt\" is raw text (prompt style raw); use messages for both"));
    check_messages(c, completion_key);
    for (const auto& m : c) {
      if (m["role"] != "assistant") bad(cat("field \"", completion_key, "\" may hold only assistant turns, found role \"", m["role"].get<std::string>(), "\""));
      if (empty_assistant(m)) bad(cat("empty completion: an assistant turn of \"", completion_key, "\" has no content"));
      p.messages.push_back(m);
    }
  } else {
    bad(cat("field \"", completion_key, "\" must be a string or a list of messages, got ", json_type(c)));
  }
  return p;
}

// ms-swift: {"system"?, "history"?: [[query, response], ...], "query", "response"}.
Parsed parse_query_response(const ojson& obj, bool chat_strings, bool require_completion) {
  Parsed p;
  const ojson& q = field(obj, "query");
  if (!q.is_string()) bad(std::string("field \"query\" must be a string, got ") + json_type(q));
  if (q.get<std::string>().empty()) bad("field \"query\" is an empty string");
  const bool has_response = obj.contains("response") && !obj["response"].is_null();
  if (!has_response && require_completion) field(obj, "response");
  const bool has_system = obj.contains("system") && !obj["system"].is_null();
  const bool has_history = obj.contains("history") && !obj["history"].is_null() && !obj["history"].empty();
  if (!chat_strings) {
    if (has_system || has_history) bad("\"system\"/\"history\" need the chat template, but the prompt style is raw");
    p.prompt_text = q.get<std::string>();
  } else {
    p.chat = true;
    if (has_system) {
      if (!obj["system"].is_string()) bad(std::string("field \"system\" must be a string, got ") + json_type(obj["system"]));
      p.messages.push_back({{"role", "system"}, {"content", obj["system"]}});
    }
    if (has_history) {
      const ojson& h = obj["history"];
      if (!h.is_array()) bad(std::string("field \"history\" must be a list of [query, response] pairs, got ") + json_type(h));
      for (size_t k = 0; k < h.size(); ++k) {
        if (!h[k].is_array() || h[k].size() != 2 || !h[k][0].is_string() || !h[k][1].is_string()) {
          bad(cat("\"history\"[", k, "] must be a [query, response] pair of strings, got ", h[k].dump()));
        }
        p.messages.push_back({{"role", "user"}, {"content", h[k][0]}});
        p.messages.push_back({{"role", "assistant"}, {"content", h[k][1]}});
      }
    }
    p.messages.push_back({{"role", "user"}, {"content", q}});
    p.prompt_turns = p.messages.size();
  }
  if (!has_response) return p;
  const ojson& r = obj["response"];
  if (!r.is_string()) bad(std::string("field \"response\" must be a string, got ") + json_type(r));
  if (r.get<std::string>().empty()) bad("empty completion: field \"response\" is an empty string");
  p.has_completion = true;
  if (p.chat) p.messages.push_back({{"role", "assistant"}, {"content", r}});
  else p.completion_text = r.get<std::string>();
  return p;
}

// "prompt_ids" / "completion_ids": a non-empty list of integers in [0, 2^31) (checked against the
// vocabulary later, with the other formats' ids).
std::vector<int32_t> parse_id_list(const ojson& obj, const char* key) {
  const ojson& a = field(obj, key);
  if (!a.is_array()) bad(cat("field \"", key, "\" must be a list of token ids, got ", json_type(a)));
  if (a.empty()) bad(cat("field \"", key, "\" is an empty list"));
  std::vector<int32_t> ids;
  ids.reserve(a.size());
  for (size_t k = 0; k < a.size(); ++k) {
    const ojson& v = a[k];
    if (!v.is_number_integer()) bad(cat("field \"", key, "\" entry ", k, " must be an integer token id, got ", v.dump()));
    const int64_t id = v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT32_MAX)
                           ? int64_t{-1} : v.get<int64_t>();
    if (id < 0 || id > INT32_MAX) bad(cat("field \"", key, "\" entry ", k, " = ", v.dump(), " is not a token id (>= 0)"));
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

void check_ids(const std::vector<int32_t>& ids, int32_t vocab, const std::string& source, const char* part) {
  for (size_t k = 0; k < ids.size(); ++k) {
    OPD_CHECK(ids[k] >= 0 && ids[k] < vocab, InvalidData, source, ": ", part, " token ", k, " has id ", ids[k],
              ", outside the vocabulary [0, ", vocab, ")");
  }
}

}  // namespace

const char* dataset_format_name(DatasetFormat f) {
  switch (f) {
    case DatasetFormat::Auto: return "auto";
    case DatasetFormat::Messages: return "messages";
    case DatasetFormat::PromptCompletion: return "prompt-completion";
    case DatasetFormat::PromptResponse: return "prompt-response";
    case DatasetFormat::QueryResponse: return "query-response";
    case DatasetFormat::TokenIds: return "token-ids";
  }
  return "?";
}

DatasetFormat parse_dataset_format(const std::string& s) {
  for (DatasetFormat f : {DatasetFormat::Auto, DatasetFormat::Messages, DatasetFormat::PromptCompletion,
                          DatasetFormat::PromptResponse, DatasetFormat::QueryResponse,
                          DatasetFormat::TokenIds}) {
    if (s == dataset_format_name(f)) return f;
  }
  OPD_FAIL(InvalidArgument, "unknown dataset format '", s, "' (auto|messages|prompt-completion|prompt-response|query-response|token-ids)");
}

const char* truncation_name(Truncation t) {
  switch (t) {
    case Truncation::Left: return "left";
    case Truncation::Error: return "error";
    case Truncation::Skip: return "skip";
  }
  return "?";
}

Truncation parse_truncation(const std::string& s) {
  for (Truncation t : {Truncation::Left, Truncation::Error, Truncation::Skip}) if (s == truncation_name(t)) return t;
  OPD_FAIL(InvalidArgument, "unknown truncation policy '", s, "' (left|error|skip)");
}

PromptStyle parse_prompt_style(const std::string& s) {
  if (s == "auto") return PromptStyle::Auto;
  if (s == "raw") return PromptStyle::Raw;
  if (s == "chat") return PromptStyle::Chat;
  OPD_FAIL(InvalidArgument, "unknown prompt style '", s, "' (auto|raw|chat)");
}

std::string LoadReport::summary() const {
  std::string s = cat(samples, " samples from ", lines, " lines (", prompt_tokens, " prompt and ", completion_tokens,
                      " completion tokens)");
  if (blank_lines) s += cat("; ", blank_lines, " blank lines");
  if (bad_lines) {
    s += cat("; ", bad_lines, " bad lines skipped, first:");
    for (const auto& b : first_bad_lines) s += cat(" ", b.source, " (", b.problem, ")");
  }
  if (skipped_too_long) {
    s += cat("; ", skipped_too_long, " prompts over the length limit skipped, first:");
    for (const auto& src : first_skipped_too_long) s += " " + src;
  }
  if (truncated_left) s += cat("; ", truncated_left, " prompts truncated on the left");
  return s;
}

Dataset Dataset::load(const std::vector<std::string>& paths, const TextEncoder& encoder, const ChatRenderer* chat,
                      const DatasetOptions& o) {
  OPD_CHECK(!paths.empty(), InvalidArgument, "no dataset files given");
  OPD_CHECK(o.max_prompt_length >= 0, InvalidArgument, "max_prompt_length must be >= 0, got ", o.max_prompt_length);
  Dataset ds;
  LoadReport& rep = ds.report_;
  OPD_CHECK(o.id_limit >= 0 && o.id_limit <= INT32_MAX, InvalidArgument, "dataset id_limit ",
            o.id_limit, " is out of range");
  const int32_t vocab = o.id_limit > 0 ? static_cast<int32_t>(o.id_limit) : encoder.vocab_size();
  for (const std::string& path : paths) {
    std::ifstream in(path, std::ios::binary);
    OPD_CHECK(in.good(), Io, "cannot open dataset ", path, ": ", std::strerror(errno));
    std::string line;
    int64_t line_no = 0;
    bool too_long = false;
    while (read_line(in, line, o.max_line_bytes, &too_long)) {
      ++line_no;
      ++rep.lines;
      if (!too_long && is_blank(line)) { ++rep.blank_lines; continue; }
      const std::string source = cat(path, ":", line_no);
      Sample s;
      s.source = source;
      try {
        if (too_long) bad(cat("line is longer than ", o.max_line_bytes, " bytes (DatasetOptions::max_line_bytes)"));
        ojson obj;
        const int depth = json_nesting_depth(line);
        if (depth > kMaxJsonDepth)
          bad(cat("JSON nested ", depth, " levels deep, over the limit of ", kMaxJsonDepth));
        try {
          obj = ojson::parse(line);
        } catch (const ojson::exception& e) {  // parse_error, and out_of_range for 1e999
          bad(cat("invalid JSON: ", e.what()));
        }
        if (!obj.is_object()) bad(std::string("expected a JSON object, got ") + json_type(obj));
        DatasetFormat fmt = o.format == DatasetFormat::Auto ? detect(obj, o.require_completion) : o.format;
        auto chat_strings = [&](bool ms_swift) {
          return o.prompt_style == PromptStyle::Chat || (o.prompt_style == PromptStyle::Auto && ms_swift);
        };
        Parsed p;
        if (fmt == DatasetFormat::TokenIds) {
          s.prompt_ids = parse_id_list(obj, "prompt_ids");
          const bool has_c = obj.contains("completion_ids") && !obj["completion_ids"].is_null();
          if (has_c || o.require_completion) s.completion_ids = parse_id_list(obj, "completion_ids");
        }
        switch (fmt) {
          case DatasetFormat::TokenIds: break;
          case DatasetFormat::Messages: p = parse_messages(obj, o.require_completion); break;
          case DatasetFormat::PromptCompletion: p = parse_prompt_pair(obj, "completion", chat_strings(false), o.require_completion); break;
          case DatasetFormat::PromptResponse: p = parse_prompt_pair(obj, "response", chat_strings(true), o.require_completion); break;
          case DatasetFormat::QueryResponse: p = parse_query_response(obj, chat_strings(true), o.require_completion); break;
          case DatasetFormat::Auto: OPD_FAIL(Internal, "format not resolved");
        }
        if (fmt != DatasetFormat::TokenIds && p.chat) {
          if (!chat)
            bad(cat("this line needs a chat template and none was found in ",
                    o.chat_template_source, "; add one there, or give the lines as "
                    "prompt/completion text or token ids"));
          ojson prompt_msgs = ojson::array();
          for (size_t k = 0; k < p.prompt_turns; ++k) prompt_msgs.push_back(p.messages[k]);
          std::string prompt_text, full_text;
          try {
            prompt_text = chat->render(prompt_msgs, p.tools, /*add_generation_prompt=*/true);
            if (p.has_completion) full_text = chat->render(p.messages, p.tools, /*add_generation_prompt=*/false);
          } catch (const Error& e) {
            bad(cat("chat template failed on this conversation: ", e.what()));
          }
          p.prompt_text = prompt_text;
          if (p.has_completion) {
            if (full_text.compare(0, prompt_text.size(), prompt_text) != 0) {
              size_t k = 0;
              while (k < prompt_text.size() && k < full_text.size() && prompt_text[k] == full_text[k]) ++k;
              bad(cat("the chat template renders the prompt differently once the completion follows (they differ at byte ", k,
                      "), so the completion cannot be split off"));
            }
            p.completion_text = full_text.substr(prompt_text.size());
            if (p.completion_text.empty()) bad("empty completion: the chat template rendered nothing for the assistant turn");
          }
        }
        if (fmt != DatasetFormat::TokenIds) s.prompt_ids = encoder.encode(p.prompt_text);
        if (s.prompt_ids.empty()) bad("empty prompt: it encodes to 0 tokens");
        if (fmt != DatasetFormat::TokenIds && p.has_completion) {
          s.completion_ids = encoder.encode(p.completion_text);
          if (!p.chat && o.append_eos) {
            auto eos = encoder.eos_id();
            OPD_CHECK(eos.has_value(), InvalidArgument, source,
                      ": append_eos is on but the tokenizer has no EOS token (turn it off to train on raw completions as they are)");
            if (s.completion_ids.empty() || s.completion_ids.back() != *eos) s.completion_ids.push_back(*eos);
          }
          if (s.completion_ids.empty()) bad("empty completion: it encodes to 0 tokens");
        }
      } catch (const LineProblem& lp) {
        if (!o.skip_bad_lines) OPD_FAIL(InvalidData, source, ": ", lp.what);
        ++rep.bad_lines;
        if (rep.first_bad_lines.size() < o.max_listed_bad_lines) rep.first_bad_lines.push_back({source, lp.what});
        continue;
      }
      check_ids(s.prompt_ids, vocab, source, "prompt");
      check_ids(s.completion_ids, vocab, source, "completion");
      const int64_t plen = static_cast<int64_t>(s.prompt_ids.size());
      if (o.max_prompt_length > 0 && plen > o.max_prompt_length) {
        switch (o.truncation) {
          case Truncation::Error:
            OPD_FAIL(InvalidData, source, ": prompt has ", plen, " tokens, over max_prompt_length ", o.max_prompt_length,
                     " (--truncation left keeps its last tokens, --truncation skip leaves it out)");
          case Truncation::Skip:
            ++rep.skipped_too_long;
            if (rep.first_skipped_too_long.size() < o.max_listed_bad_lines) rep.first_skipped_too_long.push_back(source);
            continue;
          case Truncation::Left:
            s.prompt_ids.erase(s.prompt_ids.begin(), s.prompt_ids.end() - o.max_prompt_length);
            ++rep.truncated_left;
            break;
        }
      }
      s.completion_mask.assign(s.prompt_ids.size(), 0);
      s.completion_mask.resize(s.prompt_ids.size() + s.completion_ids.size(), 1);
      rep.prompt_tokens += static_cast<int64_t>(s.prompt_ids.size());
      rep.completion_tokens += static_cast<int64_t>(s.completion_ids.size());
      ds.samples_.push_back(std::move(s));
    }
    OPD_CHECK(!in.bad(), Io, "read error in dataset ", path, ": ", std::strerror(errno));
  }
  rep.samples = static_cast<int64_t>(ds.samples_.size());
  std::string files;
  for (const auto& p : paths) files += (files.empty() ? "" : ", ") + p;
  OPD_CHECK(!ds.samples_.empty(), InvalidData, "dataset ", files, " has no usable samples: ", rep.summary());
  Sha256 h;
  for (const Sample& s : ds.samples_) {
    const uint64_t n[2] = {s.prompt_ids.size(), s.completion_ids.size()};
    h.update(n, sizeof n);
    h.update(s.prompt_ids.data(), s.prompt_ids.size() * sizeof(int32_t));
    h.update(s.completion_ids.data(), s.completion_ids.size() * sizeof(int32_t));
  }
  ds.fingerprint_ = h.hex_digest();
  if (rep.bad_lines || rep.skipped_too_long || rep.truncated_left) log_warn("dataset ", files, ": ", rep.summary());
  else log_info("dataset ", files, ": ", rep.summary());
  return ds;
}

}  // namespace opd
