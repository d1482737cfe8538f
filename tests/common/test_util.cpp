// Shared test helpers (see test_util.h).
#include "common/test_util.h"

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <cstdlib>
#include <sstream>

#include "core/philox.h"
#include "model/init.h"

namespace opd::test {

// The compile-time paths can be overridden when the binaries run elsewhere (the GPU machine).
std::string source_dir() {
  const char* env = std::getenv("OPD_SOURCE_DIR");
  return env ? env : OPD_SOURCE_DIR;
}
std::string opd_binary() {
  const char* env = std::getenv("OPD_BINARY");
  return env ? env : OPD_BINARY;
}
std::string fixture_path(const std::string& rel) { return source_dir() + "/tests/fixtures/" + rel; }

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    ADD_FAILURE() << "cannot read " << path;
    return std::string();
  }
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

OpdResult run_opd(const std::string& args, Stderr err) {
  OpdResult r;
  const std::string cmd = opd_binary() + " " + args +
                          (err == Stderr::Merge ? " 2>&1" : err == Stderr::Discard ? " 2>/dev/null" : "");
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

Tensor random_uniform(const Shape& shape, DType dtype, uint64_t seed, double lo, double hi) {
  Tensor t = Tensor::empty(shape, dtype);
  int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    double u = philox_u32(seed, 7, static_cast<uint64_t>(i)) * (1.0 / 4294967296.0);
    double v = lo + (hi - lo) * u;
    if (dtype == DType::F32) t.data<float>()[i] = static_cast<float>(v);
    else if (dtype == DType::F64) t.data<double>()[i] = v;
    else ADD_FAILURE() << "random_uniform: unsupported dtype";
  }
  return t;
}

Tensor random_ints(const Shape& shape, uint64_t seed, int32_t lo, int32_t hi) {
  Tensor t = Tensor::empty(shape, DType::I32);
  for (int64_t i = 0; i < t.numel(); ++i) {
    uint32_t r = philox_u32(seed, 11, static_cast<uint64_t>(i));
    t.data<int32_t>()[i] = lo + static_cast<int32_t>(r % static_cast<uint32_t>(hi - lo));
  }
  return t;
}

double element(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::F32: return t.data<float>()[i];
    case DType::F64: return t.data<double>()[i];
    case DType::BF16: return bf16_to_float(static_cast<const uint16_t*>(t.raw())[i]);
    case DType::F16: return f16_to_float(static_cast<const uint16_t*>(t.raw())[i]);
    case DType::I32: return t.data<int32_t>()[i];
    case DType::I64: return static_cast<double>(t.data<int64_t>()[i]);
  }
  return NAN;
}

Diff compare(const Tensor& a, const Tensor& b) {
  Diff d;
  double num = 0, den = 0, max_b = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    double x = element(a, i), y = element(b, i);
    if (!std::isfinite(x) || !std::isfinite(y)) d.has_nan = true;
    double e = std::fabs(x - y);
    num += e * e;
    den += y * y;
    if (e > d.max_abs || std::isnan(e)) {
      d.max_abs = e;
      d.worst = i;
    }
    max_b = std::max(max_b, std::fabs(y));
  }
  d.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  d.max_rel = max_b > 0 ? d.max_abs / max_b : d.max_abs;
  return d;
}

::testing::AssertionResult close(const Tensor& a, const Tensor& b, double rtol, double atol,
                                 double rel_l2_max) {
  if (a.shape() != b.shape())
    return ::testing::AssertionFailure()
           << "shape " << shape_str(a.shape()) << " vs " << shape_str(b.shape());
  Diff d = compare(a, b);
  if (d.has_nan) return ::testing::AssertionFailure() << "NaN/inf present (index " << d.worst << ")";
  if (d.rel_l2 > rel_l2_max)
    return ::testing::AssertionFailure() << "relative L2 error " << d.rel_l2 << " > " << rel_l2_max;
  for (int64_t i = 0; i < a.numel(); ++i) {
    double x = element(a, i), y = element(b, i);
    if (!(std::fabs(x - y) <= atol + rtol * std::fabs(y)))
      return ::testing::AssertionFailure()
             << "element " << i << ": " << x << " vs " << y << " (|diff| " << std::fabs(x - y)
             << " > " << atol << " + " << rtol << "*|ref|); rel_l2 " << d.rel_l2;
  }
  return ::testing::AssertionSuccess();
}

void write_teacher_beyond_student_vocab(const std::string& dir, ModelConfig c) {
  c.vocab_size = 300;
  ModelWeights w = init_weights(c, 2, 0.1);
  for (LayerWeights& l : w.layers) {
    std::fill_n(l.o_proj.data<float>(), l.o_proj.numel(), 0.f);
    std::fill_n(l.down_proj.data<float>(), l.down_proj.numel(), 0.f);
  }
  float* e = w.embed_tokens.data<float>();
  for (int64_t v = 0; v < c.vocab_size; ++v) e[v * c.hidden_size] = v < 272 ? 1.f : 100.f;
  std::fill_n(w.final_norm.data<float>(), c.hidden_size, 0.f);
  w.final_norm.data<float>()[0] = 1.f;
  save_model_dir(dir, c, w, source_dir() + "/demo/tokenizer");
}

void write_tiny_distillation(const std::string& dir, int lines) {
  const std::string tok = source_dir() + "/demo/tokenizer";
  save_model_dir(dir + "/student", tiny_demo_config(32, 1), init_weights(tiny_demo_config(32, 1), 1), tok);
  save_model_dir(dir + "/teacher", tiny_demo_config(48, 2), init_weights(tiny_demo_config(48, 2), 2, 0.1), tok);
  std::ofstream data(dir + "/train.jsonl");
  for (int i = 0; i < lines; ++i) {
    const int a = (i * 37) % 100, b = (i * 53 + 11) % 100;
    data << "{\"prompt\": \"" << a << "+" << b << "=\", \"completion\": \"" << a + b << "\"}\n";
  }
}

ModelConfig tiny_demo_config(int64_t hidden, int64_t layers) {
  ModelConfig c;
  c.arch = Architecture::Qwen3;
  c.model_type = "qwen3";
  c.vocab_size = 272;
  c.hidden_size = hidden;
  c.intermediate_size = 2 * hidden;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 16;
  c.qk_norm = true;
  c.tie_word_embeddings = true;
  c.max_position_embeddings = 64;
  c.rope_theta = 10000;
  c.eos_token_ids = {256};
  return c;
}

}  // namespace opd::test
