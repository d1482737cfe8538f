// Caching device allocator: every device buffer of opd (Tensor storage, GEMM workspaces, kernel
// scratch) comes from here, so the steady-state step loop never calls cudaMalloc/cudaFree.
//
// Model (the stream-ordered scheme of PyTorch's CUDA caching allocator, without splitting):
// - A request of b bytes is served by a block of allocation_class(b) bytes: 512-byte granules
//   up to 4 KiB, then 8 classes per power of two (worst-case waste 12.5%), 2 MiB multiples
//   above 1 GiB. A step that repeats the same shapes therefore hits the same classes.
// - Each block belongs to the (device, stream) that allocated it. A freed block goes back to
//   that stream's free list and is handed out again only to that stream: stream order makes
//   reuse safe without any event, even while kernels that used the block are still queued.
//   Using a buffer on another stream requires the user to synchronize before freeing it.
// - When the device is out of memory, the cached free blocks of every stream are released
//   (after a device synchronize) and the request is retried once; then OutOfMemory is thrown.
// Only the backend touches CUDA, so the bookkeeping is unit-tested on the CPU with a fake one.
// C++17-clean: .cu files include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

typedef struct CUstream_st* cudaStream_t;

namespace opd::cuda {

// Bytes actually reserved for a request of `bytes` (>= bytes; 512 for 0).
size_t allocation_class(size_t bytes);

struct AllocatorStats {
  int64_t requested = 0;       // bytes asked for by live allocations
  int64_t in_use = 0;          // class bytes of live allocations
  int64_t peak_in_use = 0;     // max of in_use since the last reset_peak()
  int64_t reserved = 0;        // bytes obtained from the device (in use + cached)
  int64_t peak_reserved = 0;
  int64_t cached = 0;          // reserved - in_use: free blocks waiting for reuse
  int64_t allocations = 0;     // allocate() calls
  int64_t cache_hits = 0;      // ... served from a free list
  int64_t device_mallocs = 0;  // backend allocations (cudaMalloc)
  int64_t device_frees = 0;    // backend releases (cudaFree)
  int64_t oom_retries = 0;     // out-of-memory recoveries by releasing the cache
};

// Where raw blocks come from: cudaMalloc/cudaFree on the device, a fake in tests.
class BlockBackend {
 public:
  virtual ~BlockBackend() = default;
  virtual void* allocate(size_t bytes) = 0;  // nullptr when out of memory (no throw)
  virtual void release(void* ptr) = 0;       // never throws
  virtual int current_device() = 0;
  virtual void synchronize_device() = 0;     // before cached blocks are released
  virtual void synchronize_stream(cudaStream_t stream) = 0;
};

class CachingAllocator {
 public:
  explicit CachingAllocator(std::unique_ptr<BlockBackend> backend);
  ~CachingAllocator();  // releases cached blocks; live ones are the owners' problem
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // A block of at least `bytes` for use on `stream` (nullptr = the legacy default stream).
  // Throws OutOfMemory (with the stats) when the device cannot provide it.
  void* allocate(size_t bytes, cudaStream_t stream);
  // Returns a block from allocate() to its stream's free list. nullptr is ignored; an unknown
  // pointer throws Internal (a double free or a foreign pointer).
  void deallocate(void* ptr);
  // Releases every cached (free) block of every stream back to the device.
  void empty_cache();
  // A stream is about to be destroyed: wait for it and release its cached blocks, so that a
  // later stream that reuses the handle value cannot inherit blocks with pending work.
  void release_stream(cudaStream_t stream);

  AllocatorStats stats() const;
  void reset_peak();  // peaks := current values

 private:
  struct Block {
    size_t size = 0;       // class bytes
    size_t requested = 0;  // bytes asked for
    int device = 0;
    cudaStream_t stream = nullptr;
  };
  using PoolKey = std::pair<int, cudaStream_t>;
  void release_cached_locked(const PoolKey* only);

  std::unique_ptr<BlockBackend> backend_;
  mutable std::mutex mutex_;
  std::unordered_map<void*, Block> live_;
  // Free blocks per (device, stream), by class size.
  std::map<PoolKey, std::map<size_t, std::vector<void*>>> free_;
  AllocatorStats stats_;
};

// The process-wide allocator over cudaMalloc/cudaFree. Never destroyed (its blocks may outlive
// static destructors that still hold tensors; the driver reclaims memory at exit).
CachingAllocator& device_allocator();

// The stream the ops of this host thread are issued on (nullptr = legacy default stream,
// which orders with the synchronous copies Tensor does). StreamScope sets it for a scope.
cudaStream_t current_stream();
class StreamScope {
 public:
  explicit StreamScope(cudaStream_t stream);
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  cudaStream_t previous_;
};

// RAII scratch memory from the device allocator, for one op on one stream: freed at scope
// exit, which is safe while the op's kernels are still queued (same-stream reuse).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(size_t bytes, cudaStream_t stream);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept : ptr_(other.ptr_), bytes_(other.bytes_) {
    other.ptr_ = nullptr;
    other.bytes_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  template <typename T> T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void release() noexcept;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace opd::cuda
