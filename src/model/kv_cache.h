// Paged KV cache for generation (the PagedAttention layout of Kwon et al., SOSP 2023): per
// layer, keys and values live in a pool of fixed-size blocks, k/v [num_blocks, block_size, Hkv,
// D]; a sequence owns a block table (block ids, in position order) instead of a contiguous
// range, so sequences grow without copying and the n samples of one prompt share the prompt's
// blocks. Blocks are reference-counted: a fork retains the parent's blocks, and a writer
// copies a shared block before writing into it (copy-on-write, copy_block).
// Memory: num_blocks * block_bytes(), block_bytes = 2 * layers * block_size * Hkv * D * dtype size.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace opd {

class KvCache {
 public:
  // Allocates num_blocks blocks for every layer of `config` (dtype f32/f64 on the CPU).
  KvCache(const ModelConfig& config, int64_t block_size, int64_t num_blocks,
          DType dtype = DType::F32, Device device = Device::CPU);

  // Bytes of one block across all layers, keys and values.
  static int64_t block_bytes(const ModelConfig& config, int64_t block_size, DType dtype);

  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return static_cast<int64_t>(ref_counts_.size()); }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_layers() const { return static_cast<int64_t>(k_.size()); }
  int64_t bytes() const;

  // A free block with reference count 1, or -1 when none is free.
  int32_t allocate();
  // Another holder of `block` (a forked sequence).
  void retain(int32_t block);
  // Drops one reference; the block is free again when none remain.
  void release(int32_t block);
  int32_t ref_count(int32_t block) const;
  // Copies every layer's keys and values of block src into block dst (copy-on-write).
  void copy_block(int32_t src, int32_t dst);

  Tensor& k(int64_t layer) { return k_[static_cast<size_t>(layer)]; }
  Tensor& v(int64_t layer) { return v_[static_cast<size_t>(layer)]; }

 private:
  void check_block(const char* what, int32_t block) const;

  int64_t block_size_;
  std::vector<Tensor> k_, v_;        // per layer [num_blocks, block_size, Hkv, D]
  std::vector<int32_t> ref_counts_;  // per block; 0 = free
  std::vector<int32_t> free_;        // stack of free blocks (lowest id on top)
};

}  // namespace opd
