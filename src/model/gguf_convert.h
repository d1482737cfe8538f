// GGUF -> Hugging Face model directory (config.json, model.safetensors, generation_config.json,
// tokenizer.json, tokenizer_config.json): the architectures opd runs (GGUF general.architecture
// "llama", "qwen2", "qwen3"), every tensor dequantized (dequant.h) to f32 or bf16 and renamed to
// its transformers name. llama.cpp's converter permutes the rows of Llama's q_proj / k_proj
// (per head, it interleaves the two rotary halves: HF row h*D + s*D/2 + i is stored at
// h*D + 2i + s) so its RoPE can rotate adjacent pairs; the import undoes that permutation.
// Qwen GGUFs are stored unpermuted. A tensor opd does not map, a missing tensor or a shape that
// disagrees with the config is an error naming it; nothing is dropped silently.
#pragma once

#include <map>
#include <string>

#include "core/tensor.h"
#include "model/config.h"
#include "model/gguf.h"
#include "tokenizer/gguf_vocab.h"

namespace opd {

// config.json fields from the GGUF metadata ({arch}.embedding_length, ...). Errors name the key.
ModelConfig gguf_model_config(const GgufFile& file);

// Inverse of llama.cpp's LlamaModel.permute on the rows of a [n_head*D, H] weight (any dtype).
Tensor unpermute_qk_rows(const Tensor& w, int64_t n_head);

// All model tensors, by Hugging Face name, dequantized to `dtype` (F32 or BF16).
std::map<std::string, Tensor> gguf_model_tensors(const GgufFile& file, const ModelConfig& config,
                                                 DType dtype);

// tokenizer.json and tokenizer_config.json from the file's tokenizer.ggml.* metadata
// (tokenizer/gguf_vocab.h), checked against the config's vocabulary size.
HfTokenizerFiles gguf_tokenizer_files(const GgufFile& file, const ModelConfig& config);

struct GgufConvertSummary {
  ModelConfig config;
  std::map<std::string, int64_t> tensor_types;  // ggml type name -> count
  int64_t num_tensors = 0;
};

// Writes the directory out_dir (which must not exist or be empty) through a temporary sibling
// directory renamed into place at the end, so an interrupted conversion leaves no half model.
GgufConvertSummary convert_gguf_to_hf(const std::string& gguf_path, const std::string& out_dir,
                                      DType dtype);

}  // namespace opd
