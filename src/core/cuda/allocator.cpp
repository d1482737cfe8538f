// Caching device allocator (model in allocator.h): size classes, per-(device, stream) free
// lists, statistics, and the cudaMalloc/cudaFree backend of the process-wide instance.
#include "core/cuda/allocator.h"

#include <cuda_runtime_api.h>

#include "core/cuda/cuda_check.h"
#include "core/error.h"

namespace opd::cuda {

size_t allocation_class(size_t bytes) {
  constexpr size_t kGranule = 512;
  constexpr size_t kLarge = size_t{1} << 30;     // above: 2 MiB multiples
  constexpr size_t kLargeStep = size_t{2} << 20;
  if (bytes <= 4096) return bytes == 0 ? kGranule : (bytes + kGranule - 1) / kGranule * kGranule;
  if (bytes > kLarge) return (bytes + kLargeStep - 1) / kLargeStep * kLargeStep;
  // bytes in (2^k, 2^(k+1)]: 8 equal steps of 2^k / 8 (>= 512 since 2^k >= 4096).
  size_t pow2 = 4096;
  while (pow2 * 2 < bytes) pow2 *= 2;
  const size_t step = pow2 / 8;
  return (bytes + step - 1) / step * step;
}

CachingAllocator::CachingAllocator(std::unique_ptr<BlockBackend> backend)
    : backend_(std::move(backend)) {}

CachingAllocator::~CachingAllocator() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [key, by_size] : free_)
    for (auto& [size, ptrs] : by_size)
      for (void* p : ptrs) backend_->release(p);
  free_.clear();
}

void* CachingAllocator::allocate(size_t bytes, cudaStream_t stream) {
  const size_t size = allocation_class(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  const int device = backend_->current_device();
  ++stats_.allocations;
  void* ptr = nullptr;
  auto pool = free_.find(PoolKey{device, stream});
  if (pool != free_.end()) {
    auto it = pool->second.find(size);
    if (it != pool->second.end() && !it->second.empty()) {
      ptr = it->second.back();
      it->second.pop_back();
      ++stats_.cache_hits;
      stats_.cached -= static_cast<int64_t>(size);
    }
  }
  if (!ptr) {
    ptr = backend_->allocate(size);
    if (!ptr) {
      // Out of memory: give every cached block back and try once more.
      ++stats_.oom_retries;
      release_cached_locked(nullptr);
      ptr = backend_->allocate(size);
    }
    if (!ptr) {
      OPD_FAIL(OutOfMemory, "device allocation of ", bytes, " bytes (class ", size,
               ") failed: out of memory with ", stats_.in_use, " bytes in use and ",
               stats_.reserved, " reserved by opd's caching allocator");
    }
    ++stats_.device_mallocs;
    stats_.reserved += static_cast<int64_t>(size);
    if (stats_.reserved > stats_.peak_reserved) stats_.peak_reserved = stats_.reserved;
  }
  live_.emplace(ptr, Block{size, bytes, device, stream});
  stats_.in_use += static_cast<int64_t>(size);
  stats_.requested += static_cast<int64_t>(bytes);
  if (stats_.in_use > stats_.peak_in_use) stats_.peak_in_use = stats_.in_use;
  return ptr;
}

void CachingAllocator::deallocate(void* ptr) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    OPD_FAIL(Internal, "device allocator: free of ", ptr,
             " which is not a live allocation (double free or foreign pointer)");
  }
  const Block b = it->second;
  live_.erase(it);
  stats_.in_use -= static_cast<int64_t>(b.size);
  stats_.requested -= static_cast<int64_t>(b.requested);
  stats_.cached += static_cast<int64_t>(b.size);
  free_[PoolKey{b.device, b.stream}][b.size].push_back(ptr);
}

void CachingAllocator::release_cached_locked(const PoolKey* only) {
  bool any = false;
  for (auto& [key, by_size] : free_) {
    if (only && key != *only) continue;
    for (auto& [size, ptrs] : by_size) any = any || !ptrs.empty();
  }
  if (!any) return;
  // Kernels queued earlier may still read these blocks; cudaFree must not race with them.
  if (only) backend_->synchronize_stream(only->second);
  else backend_->synchronize_device();
  for (auto pool = free_.begin(); pool != free_.end();) {
    if (only && pool->first != *only) {
      ++pool;
      continue;
    }
    for (auto& [size, ptrs] : pool->second) {
      for (void* p : ptrs) {
        backend_->release(p);
        ++stats_.device_frees;
        stats_.reserved -= static_cast<int64_t>(size);
        stats_.cached -= static_cast<int64_t>(size);
      }
    }
    pool = free_.erase(pool);
  }
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  release_cached_locked(nullptr);
}

void CachingAllocator::release_stream(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  const PoolKey key{backend_->current_device(), stream};
  release_cached_locked(&key);
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_in_use = stats_.in_use;
  stats_.peak_reserved = stats_.reserved;
}

namespace {

class CudaBackend final : public BlockBackend {
 public:
  void* allocate(size_t bytes) override {
    void* p = nullptr;
    cudaError_t st = cudaMalloc(&p, bytes);
    if (st == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky: clear it so later checks do not see it
      return nullptr;
    }
    OPD_CUDA_CHECK(st);
    return p;
  }
  void release(void* ptr) override { (void)cudaFree(ptr); }
  int current_device() override {
    int d = 0;
    OPD_CUDA_CHECK(cudaGetDevice(&d));
    return d;
  }
  void synchronize_device() override { OPD_CUDA_CHECK(cudaDeviceSynchronize()); }
  void synchronize_stream(cudaStream_t stream) override {
    OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
};

thread_local cudaStream_t t_current_stream = nullptr;

}  // namespace

CachingAllocator& device_allocator() {
  static CachingAllocator* instance = new CachingAllocator(std::make_unique<CudaBackend>());
  return *instance;
}

cudaStream_t current_stream() { return t_current_stream; }
StreamScope::StreamScope(cudaStream_t stream) : previous_(t_current_stream) {
  t_current_stream = stream;
}
StreamScope::~StreamScope() { t_current_stream = previous_; }

DeviceBuffer::DeviceBuffer(size_t bytes, cudaStream_t stream)
    : ptr_(device_allocator().allocate(bytes, stream)), bytes_(bytes) {}

void DeviceBuffer::release() noexcept {
  if (ptr_) {
    try {
      device_allocator().deallocate(ptr_);
    } catch (...) {  // never throws: the pointer came from allocate()
    }
  }
  ptr_ = nullptr;
  bytes_ = 0;
}

DeviceBuffer::~DeviceBuffer() { release(); }

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    release();
    ptr_ = other.ptr_;
    bytes_ = other.bytes_;
    other.ptr_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

}  // namespace opd::cuda
