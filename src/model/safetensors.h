// safetensors I/O (https://huggingface.co/docs/safetensors): an 8-byte little-endian header
// length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
// {str: str}}, then the data. The reader mmaps the file and returns zero-copy tensors; every
// header field is validated (length within the file, offsets within the data, offsets
// consistent with dtype x shape, no overlaps, known dtype) so a corrupt or hostile file gives
// an InvalidData error naming the file and tensor, never a crash. Sharded checkpoints are read
// through model.safetensors.index.json. The writer is atomic: temp file, fsync, rename, fsync dir.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace opd {

class SafetensorsFile {
 public:
  // mmaps `path` and validates the header; throws InvalidData / Io.
  static SafetensorsFile open(const std::string& path);
  // Validates a header+data image already in memory (used by the fuzz test).
  static SafetensorsFile from_bytes(std::shared_ptr<const std::string> bytes,
                                    const std::string& source);

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  // Zero-copy, read-only host tensor (dtype as stored: f32, bf16, f16, f64, i32, i64).
  Tensor get(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  struct Entry {
    DType dtype;
    Shape shape;
    size_t begin, end;  // byte offsets into the data section
  };
  std::string path_;
  std::shared_ptr<void> owner_;  // the mapping (or bytes) kept alive by every returned Tensor
  const char* data_ = nullptr;   // start of the data section
  size_t data_size_ = 0;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
  friend class SafetensorsParser;
};

// All tensors of a model directory: model.safetensors, or the shards named by
// model.safetensors.index.json (each shard validated; a name mapped to a missing shard or
// missing from its shard is an error naming both).
class WeightStore {
 public:
  static WeightStore open_dir(const std::string& model_dir);
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  Tensor get(const std::string& name) const;  // error names the tensor and the directory
  // get() plus checks: shape must equal `shape`; returns a host f32 copy converted from
  // f32/bf16/f16. Errors name the tensor, the expected and the found shape/dtype.
  Tensor get_f32(const std::string& name, const Shape& shape) const;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> index_;  // tensor name -> files_ index
};

// Atomically write tensors (host, any dtype above) to `path` with optional metadata.
// Tensor names are written sorted, data 8-byte aligned as the reference writer does.
void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// The safetensors header name of a dtype ("F32", "BF16", ...).
const char* safetensors_dtype_name(DType dtype);

}  // namespace opd
