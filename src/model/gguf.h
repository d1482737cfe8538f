// GGUF reader (ggml's model file format, versions 2 and 3; spec: ggml docs/gguf.md): a header
// ("GGUF", version, tensor count, metadata count), metadata key/values of the 13 value types
// (arrays nest), tensor infos (name, dims with ne[0] fastest, ggml type, offset), then the tensor
// data at general.alignment (default 32). The file is mmapped; every count, length, dimension and
// offset is checked against the bytes that remain before anything is allocated or read, so a
// truncated, corrupt or hostile file gives an InvalidData error naming the field, the value and
// the limit, never a crash or an allocation the file cannot back.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace opd {

// Metadata value types, numbered as in the spec.
enum class GgufType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, Bool = 7, String = 8,
  Array = 9, U64 = 10, I64 = 11, F64 = 12,
};
std::string_view gguf_type_name(GgufType type);  // "uint32", "string", "array", ...

// ggml tensor types that opd knows the block layout of (numbered as in ggml.h). Only the ones
// dequant.h lists can be converted; the others are recognized so errors can name them.
enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9, Q2_K = 10,
  Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15, I8 = 24, I16 = 25, I32 = 26, I64 = 27,
  F64 = 28, BF16 = 30,
};
struct GgmlTypeInfo {
  const char* name;        // "Q4_K"
  int64_t block_elems;     // elements per block (1 for plain types)
  int64_t block_bytes;     // bytes per block
};
// nullptr for a number that is not one of the types above.
const GgmlTypeInfo* ggml_type_info(uint32_t type);

struct GgufValue {
  GgufType type = GgufType::U8;
  // Scalars: integers in u (unsigned) / i (signed), floats in f, bool in b.
  uint64_t u = 0;
  int64_t i = 0;
  double f = 0;
  bool b = false;
  std::string s;                  // String
  GgufType elem_type = GgufType::U8;  // Array
  std::vector<GgufValue> array;   // Array

  bool is_integer() const;        // one of the 8 integer types
  std::string describe() const;   // short text for error messages: `uint32 3`, `array[49152] of string`
};

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> ne;  // dims as stored: ne[0] is the fastest-varying (row length)
  GgmlType type = GgmlType::F32;
  uint64_t offset = 0;      // from the start of the data section
  uint64_t nbytes = 0;      // ne product / block_elems * block_bytes
  int64_t numel() const;
  // Row-major shape (PyTorch/HF order): ne reversed, e.g. token_embd ne [576, 49152] -> [49152, 576].
  Shape shape() const;
};

class GgufFile {
 public:
  // mmaps `path` and validates header, metadata and tensor infos; throws InvalidData / Io /
  // Unsupported (version 1, big-endian files).
  static GgufFile open(const std::string& path);
  // The same checks on an image in memory (the mutation test uses it).
  static GgufFile from_bytes(std::shared_ptr<const std::string> bytes, const std::string& source);

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // absolute file offset of the data
  uint64_t file_size() const { return size_; }

  // Metadata in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return kv_; }
  const GgufValue* find(std::string_view key) const;  // nullptr when absent
  // Typed accessors: the key must be present (unless a default is given) with a compatible
  // type; errors name the file, key, the type found and the type wanted.
  uint64_t get_uint(std::string_view key) const;                 // any non-negative integer type
  uint64_t get_uint(std::string_view key, uint64_t fallback) const;
  double get_float(std::string_view key) const;                  // f32/f64 (or an integer)
  double get_float(std::string_view key, double fallback) const;
  bool get_bool(std::string_view key, bool fallback) const;
  std::string get_string(std::string_view key) const;
  std::optional<std::string> find_string(std::string_view key) const;
  std::vector<std::string> get_string_array(std::string_view key) const;
  std::vector<int64_t> get_int_array(std::string_view key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(std::string_view name) const;  // nullptr when absent
  const GgufTensorInfo& tensor(std::string_view name) const;       // error names the file
  // The tensor's raw bytes (validated to lie inside the file at open()).
  std::span<const uint8_t> tensor_bytes(const GgufTensorInfo& info) const;
  // Dequantized host tensor, row-major shape info.shape(), dtype F32 or BF16 (dequant.h).
  Tensor dequantize(const GgufTensorInfo& info, DType out = DType::F32) const;

 private:
  friend class GgufParser;
  std::string path_;
  std::shared_ptr<void> owner_;  // the mapping or the bytes
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, GgufValue>> kv_;
  std::map<std::string, size_t, std::less<>> kv_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

}  // namespace opd
