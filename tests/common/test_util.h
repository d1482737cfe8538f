// Shared test helpers: seeded random tensors, error metrics with meaningful tolerances
// (STYLE.md: relative error ||a-b||/||b|| plus elementwise |a-b| <= atol + rtol*|b|; NaN never
// passes), and paths to committed fixtures.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "core/tensor.h"
#include "model/config.h"

namespace opd::test {

std::string source_dir();                   // repository root ($OPD_SOURCE_DIR overrides)
std::string opd_binary();                   // the built opd ($OPD_BINARY overrides)
std::string fixture_path(const std::string& rel);  // tests/fixtures/<rel>
// The whole file as bytes; a file that cannot be opened fails the test (and gives "").
std::string read_file(const std::string& path);

// Runs `opd ARGS` (ARGS as shell words) and returns its exit status and stdout. stderr goes to
// the test's own log (ToTestLog), into `out` after stdout's lines as they interleave (Merge), or
// nowhere (Discard).
enum class Stderr { ToTestLog, Merge, Discard };
struct OpdResult {
  int code = -1;  // exit status; -1 when it did not exit normally or could not start
  std::string out;
};
OpdResult run_opd(const std::string& args, Stderr err = Stderr::ToTestLog);

// A tiny Qwen3 config over the demo tokenizer's vocabulary (272 ids, EOS 256): 2 query / 1 kv
// heads of 16, intermediate 2 x hidden, tied embeddings. The training tests build models from it.
ModelConfig tiny_demo_config(int64_t hidden, int64_t layers);
// A distillation playground in `dir`: student/ (tiny_demo_config(32, 1), seed 1) and teacher/
// (tiny_demo_config(48, 2), seed 2, std 0.1) model directories with the demo tokenizer, and
// train.jsonl with `lines` two-number additions ({"prompt": "a+b=", "completion": "a+b"}).
void write_tiny_distillation(const std::string& dir, int lines);

// A teacher model directory whose every top-K (K <= 28) lies beyond the student's 272 ids:
// `c` (a tiny_demo_config-like config) widened to vocabulary 300, no layer output (o and down
// projections zero, so the final hidden state is the token's embedding), the embedding's first
// column 1 for the 272 ids a prompt can hold and 100 for the 28 beyond, and the final norm
// keeping only that column. Under --vocab-policy clip-to-student, the payload check rejects
// every row ("leaves no entry").
void write_teacher_beyond_student_vocab(const std::string& dir, ModelConfig c);

// Uniform in [lo, hi) from Philox(seed); f32 or f64 tensors on the CPU.
Tensor random_uniform(const Shape& shape, DType dtype, uint64_t seed, double lo = -1, double hi = 1);
// Uniform integers in [lo, hi) as i32.
Tensor random_ints(const Shape& shape, uint64_t seed, int32_t lo, int32_t hi);

// Any float dtype read as double (host tensors).
double element(const Tensor& t, int64_t i);

struct Diff {
  double rel_l2 = 0;      // ||a - b|| / ||b||
  double max_abs = 0;     // max |a - b|
  double max_rel = 0;     // max |a - b| / max |b|
  int64_t worst = -1;     // index of the worst elementwise violation
  bool has_nan = false;   // any NaN/inf in a (or b)
};
Diff compare(const Tensor& a, const Tensor& b);

// gtest assertion: shapes equal, no NaN, rel_l2 <= rel, and |a-b| <= atol + rtol*|b| elementwise.
::testing::AssertionResult close(const Tensor& a, const Tensor& b, double rtol, double atol,
                                 double rel_l2_max = 1.0);

}  // namespace opd::test
