// Tensor: a contiguous, row-major n-d array (shape, dtype, device) over shared storage.
// No strides on purpose: every op in opd consumes and produces contiguous data, views are
// contiguous sub-ranges (reshape, leading-dimension slices), and kernels stay simple.
// Storage is host memory (aligned heap), a read-only file mapping (safetensors), or device
// memory (CUDA builds); a Tensor keeps its storage alive.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace opd {

enum class Device : uint8_t { CPU, CUDA };

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& shape);
std::string shape_str(const Shape& shape);  // "[2, 3]"

// Memory owned by someone; freed by the derived destructor.
class Storage {
 public:
  virtual ~Storage() = default;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  bool writable() const { return writable_; }

 protected:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_ = Device::CPU;
  bool writable_ = true;
};

// Bytes of host/device tensor storage allocated by opd and not yet freed, and the peak since
// the last reset: tests assert memory bounds with these (e.g. the fused loss's O(tokens x K)).
struct MemoryStats {
  int64_t in_use = 0;
  int64_t peak = 0;
};
MemoryStats memory_stats(Device device);
void reset_peak_memory(Device device);  // peak := in_use

// 64-byte aligned host memory.
std::shared_ptr<Storage> host_storage(size_t bytes);
// Device memory on the current CUDA device (throws Unsupported in builds without CUDA).
std::shared_ptr<Storage> device_storage(size_t bytes);
// Storage that views memory kept alive by `owner` (e.g. an mmap); read-only unless stated.
std::shared_ptr<Storage> borrowed_storage(void* data, size_t bytes, std::shared_ptr<void> owner,
                                          bool writable = false);

class Tensor {
 public:
  Tensor() = default;
  Tensor(std::shared_ptr<Storage> storage, size_t byte_offset, Shape shape, DType dtype);

  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::CPU);
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::CPU);
  // Host tensor filled with NaN (floats) or 0x7f.. bytes (ints): poison for tests.
  static Tensor poisoned(const Shape& shape, DType dtype);
  template <typename T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const;  // negative i counts from the end
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::CPU; }
  bool writable() const { return storage_ && storage_->writable(); }

  void* raw() const;
  template <typename T> T* data() const {
    OPD_CHECK(dtype_of<T>() == dtype_, InvalidArgument, "tensor of dtype ", dtype_name(dtype_),
              " accessed as ", dtype_name(dtype_of<T>()));
    return static_cast<T*>(raw());
  }

  Tensor reshape(const Shape& shape) const;           // same elements, new shape (one -1 allowed)
  Tensor slice_rows(int64_t begin, int64_t end) const;  // rows [begin, end) of dim 0, a view
  Tensor clone() const;                               // deep copy on the same device
  Tensor to(Device device) const;                     // copy to device (self if already there)
  Tensor to_dtype(DType dtype) const;                 // host conversion between float types
  void fill_zero();
  void copy_from(const Tensor& src);                  // same shape and dtype, any devices

  std::string describe() const;  // "f32[2, 3] cpu"

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes
  Shape shape_;
  DType dtype_ = DType::F32;
};

// Device-side hooks implemented by core/cuda (or stubs in CPU-only builds).
namespace device_hooks {
bool cuda_compiled();
int cuda_device_count();  // usable CUDA devices (0 without a driver, a GPU or a CUDA build)
// Memory of the current CUDA device: `free` = what the driver can still give out, `reserved` =
// what this process's caching allocator holds (in use or cached), so free + reserved is what
// the process can use. All 0 without a device or a CUDA build.
struct CudaMemoryInfo {
  int64_t total = 0, free = 0, reserved = 0;
};
CudaMemoryInfo cuda_memory_info();
void* cuda_malloc(size_t bytes);
void cuda_free(void* ptr);
void cuda_memcpy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
void cuda_memset_zero(void* ptr, size_t bytes);
}  // namespace device_hooks

template <typename T>
Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape) {
  OPD_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape), InvalidArgument,
            "from_vector: ", values.size(), " values for shape ", shape_str(shape));
  Tensor t = empty(shape, dtype_of<T>());
  std::copy(values.begin(), values.end(), t.data<T>());
  return t;
}

}  // namespace opd
