// `opd generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3 | --prompts FILE.jsonl)
// [--max-new-tokens N] [--temperature T --top-p P --top-k K --min-p P --seed S --n N]
// [--stop STR] [--ignore-eos] [--kv-cache-gb G] [--device cpu|cuda --dtype bf16|f32] [--json]`:
// samples completions with the rollout engine (rollout/engine.h) on the CPU (f32) or the GPU
// (cli/model_device.h). Text prompts need a tokenizer (tokenizer.json in the model directory, or
// --tokenizer PATH); token-id prompts do not. Text is encoded as given (the tokenizer's special
// tokens added); a --prompts line with chat "messages" is rendered with the model's chat template
// (add_generation_prompt; the template beside the tokenizer) and encoded without added special
// tokens, as datasets are (docs/data.md); --chat does the same with text prompts (one user
// message each).
// JSON output (one object): per prompt, per sample: token ids,
// text (when a tokenizer is loaded), finish reason, and two per-token log-probabilities:
// sampling_logprobs under the distribution the token was drawn from (temperature, top-k/p,
// min-p applied; 0 for greedy) and model_logprobs under the unmodified model at temperature 1.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli/commands.h"
#include "cli/generation_progress.h"
#include "cli/id_list.h"  // parse_id_list (ids are range-checked later, by the engine)
#include "cli/model_device.h"
#include "core/error.h"
#include "core/text_io.h"
#include "model/transformer.h"
#include "rollout/engine.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "train/text_adapters.h"  // has_chat_template, chat_template_source

namespace opd::cli {
namespace {

struct GenerateOptions {
  std::string model;
  std::string tokenizer;
  std::vector<std::string> prompts;
  std::vector<std::string> prompt_ids;
  std::string prompts_file;
  int64_t max_new_tokens = 64;
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = 0;
  double min_p = 0.0;
  uint64_t seed = 0;
  int64_t n = 1;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  double kv_cache_gb = 1.0;
  int64_t block_size = 16;
  int64_t max_step_tokens = 512;
  int64_t max_running = 256;
  bool json = false;
  bool chat = false;  // text prompts become one user message through the chat template
  ModelDevice md;
};

struct Prompt {
  std::vector<int32_t> ids;
  std::optional<std::string> text;
};

const Tokenizer& need_tokenizer(const std::optional<Tokenizer>& tok, const std::string& where) {
  if (!tok)
    OPD_FAIL(InvalidArgument, where,
             ": a text prompt needs a tokenizer, but the model directory has no tokenizer.json "
             "(pass --tokenizer PATH, or give token ids with --prompt-ids 1,2,3 / "
             "{\"prompt_ids\": [...]})");
  return *tok;
}

// Chat prompts: messages rendered with the chat template of `template_dir` (the directory the
// tokenizer came from; read at the first use, so runs without chat prompts never parse it), the
// generation prompt added, encoded without added special tokens (as datasets are).
class ChatPrompts {
 public:
  ChatPrompts(const std::optional<Tokenizer>& tok, std::string template_dir)
      : tok_(tok), dir_(std::move(template_dir)) {}
  Prompt render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                const std::string& where) {
    const Tokenizer& t = need_tokenizer(tok_, where);
    if (!chat_) {
      OPD_CHECK(has_chat_template(dir_, t), InvalidData, where, ": a chat prompt needs a chat "
                "template, and ", chat_template_source(dir_), " has none (give \"prompt\" text "
                "without --chat, or \"prompt_ids\")");
      tmpl_ = std::make_unique<ChatTemplate>(ChatTemplate::from_model_dir(dir_));
      chat_ = std::make_unique<TemplateChatRenderer>(*tmpl_);
    }
    std::string text;
    try {
      text = chat_->render(messages, tools, /*add_generation_prompt=*/true);
    } catch (const Error& e) {
      OPD_FAIL(InvalidData, where, ": the chat template failed: ", e.what());
    }
    Prompt p;
    p.ids = t.encode(text, false);
    p.text = std::move(text);
    return p;
  }
  // One user message.
  Prompt user(const std::string& content, const std::string& where) {
    nlohmann::ordered_json m = nlohmann::ordered_json::array();
    m.push_back({{"role", "user"}, {"content", content}});
    return render(m, nlohmann::ordered_json(), where);
  }

 private:
  const std::optional<Tokenizer>& tok_;
  std::string dir_;
  std::unique_ptr<ChatTemplate> tmpl_;
  std::unique_ptr<TemplateChatRenderer> chat_;
};

// JSONL lines: {"prompt": "text"}, {"prompt_ids": [1, 2, 3]} or {"messages": [...], "tools"?: [...]};
// blank lines are skipped. "messages" lines (and "prompt" text with `chat_text`, --chat) go
// through `chat`.
std::vector<Prompt> read_prompts_file(const std::string& path, const std::optional<Tokenizer>& tok,
                                      ChatPrompts& chat, bool chat_text) {
  std::ifstream in(path, std::ios::binary);
  OPD_CHECK(in.good(), Io, "cannot open --prompts file ", path);
  std::vector<Prompt> out;
  std::string line;
  for (size_t no = 1; std::getline(in, line); ++no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = cat(path, " line ", no);
    check_json_depth(line, where);
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    OPD_CHECK(!j.is_discarded() && j.is_object(), InvalidData, where, ": not a JSON object");
    Prompt p;
    if (j.contains("prompt_ids")) {
      const auto& a = j["prompt_ids"];
      OPD_CHECK(a.is_array() && !a.empty(), InvalidData, where,
                ": prompt_ids must be a non-empty array of token ids");
      for (size_t i = 0; i < a.size(); ++i) {
        OPD_CHECK(a[i].is_number_integer() && a[i].get<int64_t>() >= INT32_MIN &&
                      a[i].get<int64_t>() <= INT32_MAX,
                  InvalidData, where, ": prompt_ids[", i, "] = ", a[i].dump(),
                  " is not a 32-bit integer");
        p.ids.push_back(static_cast<int32_t>(a[i].get<int64_t>()));
      }
    } else if (j.contains("prompt")) {
      OPD_CHECK(j["prompt"].is_string(), InvalidData, where, ": prompt must be a string");
      if (chat_text) {
        p = chat.user(j["prompt"].get<std::string>(), where);
      } else {
        p.text = j["prompt"].get<std::string>();
        p.ids = need_tokenizer(tok, where).encode(*p.text, true);
      }
    } else if (j.contains("messages")) {
      // Parsed again keeping key order: a template iterating a message's items sees the file's.
      const nlohmann::ordered_json oj = nlohmann::ordered_json::parse(line);
      const nlohmann::ordered_json& messages = oj["messages"];
      OPD_CHECK(messages.is_array() && !messages.empty(), InvalidData, where,
                ": messages must be a non-empty array of {role, content}");
      p = chat.render(messages, oj.contains("tools") ? oj["tools"] : nlohmann::ordered_json(), where);
    } else {
      OPD_FAIL(InvalidData, where, ": expected a \"prompt\" or \"prompt_ids\" field");
    }
    out.push_back(std::move(p));
  }
  return out;
}

void run_generate(const GenerateOptions& o) {
  check_model_device(o.md, "opd generate");
  std::optional<Tokenizer> tok;
  if (!o.tokenizer.empty())
    tok.emplace(Tokenizer::load(o.tokenizer));
  else if (std::filesystem::exists(o.model + "/tokenizer.json"))
    tok.emplace(Tokenizer::load(o.model));

  // The chat template lives beside the tokenizer: the model directory's, or --tokenizer's.
  namespace fs = std::filesystem;
  ChatPrompts chat(tok, o.tokenizer.empty()                ? o.model
                        : fs::is_directory(o.tokenizer) ? o.tokenizer
                                                        : fs::path(o.tokenizer).parent_path().string());
  std::vector<Prompt> prompts;
  for (const std::string& t : o.prompts)
    prompts.push_back(o.chat ? chat.user(t, "--prompt")
                             : Prompt{need_tokenizer(tok, "--prompt").encode(t, true), t});
  for (const std::string& s : o.prompt_ids) prompts.push_back({parse_id_list(s, "--prompt-ids"), {}});
  if (!o.prompts_file.empty()) {
    std::vector<Prompt> more = read_prompts_file(o.prompts_file, tok, chat, o.chat);
    prompts.insert(prompts.end(), more.begin(), more.end());
  }
  OPD_CHECK(!prompts.empty(), InvalidArgument,
            "no prompt: give --prompt TEXT, --prompt-ids 1,2,3 or --prompts FILE.jsonl");

  std::vector<GenerationRequest> reqs;
  for (const Prompt& p : prompts) {
    GenerationRequest r;
    r.prompt = p.ids;
    r.sampling.temperature = o.temperature;
    r.sampling.top_p = o.top_p;
    r.sampling.top_k = o.top_k;
    r.sampling.min_p = o.min_p;
    r.sampling.seed = o.seed;
    r.n = o.n;
    r.max_new_tokens = o.max_new_tokens;
    r.stop = o.stop;
    r.ignore_eos = o.ignore_eos;
    reqs.push_back(std::move(r));
  }
  // Loaded after the prompts are read, so a bad prompt file fails before a model reaches the GPU.
  Transformer model = load_model_on(o.model, o.md, "opd generate");
  EngineOptions eo;
  eo.kv_cache_bytes = static_cast<int64_t>(o.kv_cache_gb * 1024.0 * 1024.0 * 1024.0);
  eo.block_size = o.block_size;
  eo.max_step_tokens = o.max_step_tokens;
  eo.max_running = o.max_running;
  const std::vector<int32_t> eos = generation_eos_ids(o.model, model.config(), tok ? &*tok : nullptr);
  GenerationProgressDisplay shown("generate");
  eo.on_progress = shown.callback();
  RolloutEngine engine(model, eo, eos, tok ? &*tok : nullptr);
  std::vector<RequestOutput> outs = engine.generate(reqs);
  shown.finish();
  const EngineStats& st = engine.stats();

  nlohmann::json results = nlohmann::json::array();
  for (size_t i = 0; i < outs.size(); ++i) {
    nlohmann::json pj;
    pj["prompt_index"] = i;
    pj["prompt_ids"] = prompts[i].ids;
    if (prompts[i].text) pj["prompt"] = *prompts[i].text;
    pj["samples"] = nlohmann::json::array();
    for (size_t k = 0; k < outs[i].samples.size(); ++k) {
      const SampleOutput& s = outs[i].samples[k];
      nlohmann::json sj;
      sj["index"] = k;
      sj["ids"] = s.ids;
      sj["text"] = s.text ? nlohmann::json(*s.text) : nlohmann::json(nullptr);
      sj["finish_reason"] = finish_reason_name(s.finish_reason);
      if (s.finish_reason == FinishReason::Stop) sj["stop"] = s.stop;
      sj["sampling_logprobs"] = s.sampling_logprobs;
      sj["model_logprobs"] = s.model_logprobs;
      pj["samples"].push_back(sj);
    }
    results.push_back(pj);
  }
  nlohmann::json stats = {{"seconds", st.seconds},
                          {"steps", st.steps},
                          {"prefill_tokens", st.prefill_tokens},
                          {"decode_tokens", st.decode_tokens},
                          {"preemptions", st.preemptions},
                          {"recomputed_tokens", st.recomputed_tokens},
                          {"kv_blocks", st.num_blocks},
                          {"block_size", o.block_size},
                          {"peak_kv_blocks_used", st.peak_blocks_used},
                          {"max_batch", st.max_batch}};
  if (o.json) {
    nlohmann::json out = {{"model", o.model}, {"eos_token_ids", eos}, {"results", results},
                          {"stats", stats}};
    // Invalid UTF-8 cannot occur in text (the decoder emits U+FFFD), but be safe anyway.
    std::printf("%s\n", out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return;
  }
  std::printf("%s: %s, %zu prompts x n=%lld, %.2f s, %lld steps, %lld preemptions\n",
              o.model.c_str(), architecture_name(model.config().arch), prompts.size(),
              (long long)o.n, st.seconds, (long long)st.steps, (long long)st.preemptions);
  for (const auto& pj : results) {
    std::printf("\nprompt %zu  ids %s\n", pj["prompt_index"].get<size_t>(),
                pj["prompt_ids"].dump().c_str());
    for (const auto& sj : pj["samples"]) {
      double total = 0;
      for (double lp : sj["model_logprobs"]) total += lp;
      std::printf("  sample %zu [%s, %zu tokens, model logprob %.3f]: %s\n",
                  sj["index"].get<size_t>(), sj["finish_reason"].get<std::string>().c_str(),
                  sj["ids"].size(), total,
                  sj["text"].is_null() ? sj["ids"].dump().c_str()
                                       : sj["text"].dump(-1, ' ', false,
                                                         nlohmann::json::error_handler_t::replace).c_str());
    }
  }
}

}  // namespace

void register_generate(CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand(
      "generate", "Sample completions with the rollout engine (paged KV cache; CPU, or the GPU "
                  "with --device cuda)");
  cmd->add_option("--model", o->model, "Hugging Face model directory")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--tokenizer", o->tokenizer,
                  "tokenizer.json or a directory holding one (default: the model directory's)");
  cmd->add_option("--prompt", o->prompts, "a text prompt (repeatable; needs a tokenizer)");
  cmd->add_flag("--chat", o->chat, "text prompts (--prompt, {\"prompt\": TEXT} lines) become one "
                "user message rendered with the chat template beside the tokenizer (generation "
                "prompt added); without it text is encoded as given");
  cmd->add_option("--prompt-ids", o->prompt_ids,
                  "a prompt as comma-separated token ids (repeatable; no tokenizer needed)");
  cmd->add_option("--prompts", o->prompts_file,
                  "JSONL file: one {\"prompt\": TEXT}, {\"prompt_ids\": [ids]} or {\"messages\": [...]} "
                  "(rendered with the model's chat template) per line")
      ->check(CLI::ExistingFile);
  cmd->add_option("--max-new-tokens", o->max_new_tokens, "tokens to generate at most per sample")
      ->default_val(64)
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--temperature", o->temperature, "sampling temperature; 0 = greedy")
      ->default_val(1.0);
  cmd->add_option("--top-p", o->top_p, "nucleus sampling mass in (0, 1]; 1 = off")->default_val(1.0);
  cmd->add_option("--top-k", o->top_k, "keep the k most likely tokens; 0 = off")->default_val(0);
  cmd->add_option("--min-p", o->min_p, "drop tokens below min_p x the top probability; 0 = off")
      ->default_val(0.0);
  cmd->add_option("--seed", o->seed, "sampling seed (a sample depends on seed, prompt, index)")
      ->default_val(0);
  cmd->add_option("--n", o->n, "samples per prompt (they share the prompt's KV blocks)")
      ->default_val(1)
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--stop", o->stop, "stop string (repeatable; needs a tokenizer)");
  cmd->add_flag("--ignore-eos", o->ignore_eos, "do not stop at EOS tokens");
  cmd->add_option("--kv-cache-gb", o->kv_cache_gb, "KV cache budget in GiB")
      ->default_val(1.0)
      ->check(CLI::PositiveNumber);
  cmd->add_option("--block-size", o->block_size, "tokens per KV cache block")->default_val(16);
  cmd->add_option("--max-step-tokens", o->max_step_tokens,
                  "tokens per forward step (prefill chunk budget)")
      ->default_val(512);
  cmd->add_option("--max-running", o->max_running, "sequences decoded together at most")
      ->default_val(256);
  add_model_device_flags(cmd, o->md, "the model and its sampling");
  cmd->add_flag("--json", o->json, "print one JSON object");
  cmd->callback([o] { run_generate(*o); });
}

}  // namespace opd::cli
