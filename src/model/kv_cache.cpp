// Paged KV cache: block pool, reference counts and copy-on-write copies (design in kv_cache.h).
#include "model/kv_cache.h"

#ifdef OPD_WITH_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/allocator.h"  // current_stream
#include "core/cuda/stream.h"     // OPD_CUDA_CHECK
#endif

namespace opd {

KvCache::KvCache(const ModelConfig& config, int64_t block_size, int64_t num_blocks, DType dtype,
                 Device device)
    : block_size_(block_size) {
  OPD_CHECK(block_size >= 1, InvalidArgument, "KvCache: block_size must be >= 1, got ",
            block_size);
  OPD_CHECK(num_blocks >= 1 && num_blocks <= INT32_MAX, InvalidArgument,
            "KvCache: num_blocks must be in [1, 2^31), got ", num_blocks);
  const Shape shape = {num_blocks, block_size, config.num_key_value_heads, config.head_dim};
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    k_.push_back(Tensor::empty(shape, dtype, device));
    v_.push_back(Tensor::empty(shape, dtype, device));
  }
  ref_counts_.assign(static_cast<size_t>(num_blocks), 0);
  for (int64_t b = num_blocks; b-- > 0;) free_.push_back(static_cast<int32_t>(b));
}

int64_t KvCache::block_bytes(const ModelConfig& config, int64_t block_size, DType dtype) {
  return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads *
         config.head_dim * static_cast<int64_t>(dtype_size(dtype));
}

int64_t KvCache::bytes() const {
  int64_t total = 0;
  for (size_t l = 0; l < k_.size(); ++l)
    total += static_cast<int64_t>(k_[l].nbytes() + v_[l].nbytes());
  return total;
}

void KvCache::check_block(const char* what, int32_t block) const {
  OPD_CHECK(block >= 0 && block < num_blocks(), Internal, "KvCache::", what, ": block ", block,
            " is outside [0, ", num_blocks(), ")");
  OPD_CHECK(ref_counts_[static_cast<size_t>(block)] > 0, Internal, "KvCache::", what,
            ": block ", block, " is not allocated");
}

int32_t KvCache::allocate() {
  if (free_.empty()) return -1;
  int32_t b = free_.back();
  free_.pop_back();
  ref_counts_[static_cast<size_t>(b)] = 1;
  return b;
}

void KvCache::retain(int32_t block) {
  check_block("retain", block);
  ++ref_counts_[static_cast<size_t>(block)];
}

void KvCache::release(int32_t block) {
  check_block("release", block);
  if (--ref_counts_[static_cast<size_t>(block)] == 0) free_.push_back(block);
}

int32_t KvCache::ref_count(int32_t block) const {
  OPD_CHECK(block >= 0 && block < num_blocks(), InvalidArgument, "KvCache::ref_count: block ",
            block, " is outside [0, ", num_blocks(), ")");
  return ref_counts_[static_cast<size_t>(block)];
}

void KvCache::copy_block(int32_t src, int32_t dst) {
  check_block("copy_block", src);
  check_block("copy_block", dst);
#ifdef OPD_WITH_CUDA
  if (!k_.empty() && k_[0].device() == Device::CUDA) {
    // Stream-ordered device copies, no host sync: the step that writes into dst comes later on
    // the same stream (Tensor::copy_from would synchronize twice per layer).
    const size_t bytes = k_[0].nbytes() / static_cast<size_t>(num_blocks());
    for (size_t l = 0; l < k_.size(); ++l) {
      for (Tensor* t : {&k_[l], &v_[l]}) {
        char* base = static_cast<char*>(t->raw());
        OPD_CUDA_CHECK(cudaMemcpyAsync(base + static_cast<size_t>(dst) * bytes,
                                       base + static_cast<size_t>(src) * bytes, bytes,
                                       cudaMemcpyDeviceToDevice, cuda::current_stream()));
      }
    }
    return;
  }
#endif
  for (size_t l = 0; l < k_.size(); ++l) {
    Tensor kd = k_[l].slice_rows(dst, dst + 1), vd = v_[l].slice_rows(dst, dst + 1);
    kd.copy_from(k_[l].slice_rows(src, src + 1));
    vd.copy_from(v_[l].slice_rows(src, src + 1));
  }
}

}  // namespace opd
