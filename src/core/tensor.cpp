// Tensor storage, views and copies (see tensor.h for the model: contiguous, shared storage).
#include "core/tensor.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>

namespace opd {

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    OPD_CHECK(d >= 0, InvalidArgument, "negative dimension in shape ", shape_str(shape));
    // Shapes can come from files (config.json, GGUF, safetensors): a product past int64 is an
    // error, not a wrapped (small) element count.
    OPD_CHECK(!__builtin_mul_overflow(n, d, &n), InvalidArgument, "element count of shape ",
              shape_str(shape), " overflows int64");
  }
  return n;
}

std::string shape_str(const Shape& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

namespace {

struct Counter {
  std::atomic<int64_t> in_use{0};
  std::atomic<int64_t> peak{0};
  void add(int64_t bytes) {
    int64_t now = in_use.fetch_add(bytes) + bytes;
    int64_t p = peak.load();
    while (now > p && !peak.compare_exchange_weak(p, now)) {
    }
  }
  void sub(int64_t bytes) { in_use.fetch_sub(bytes); }
};
Counter g_counters[2];  // indexed by Device
Counter& counter(Device d) { return g_counters[static_cast<int>(d)]; }

class HostStorage final : public Storage {
 public:
  explicit HostStorage(size_t bytes) {
    // A byte count near 2^64 would round up to a tiny allocation.
    if (bytes > (size_t{1} << 62)) OPD_FAIL(OutOfMemory, "host allocation of ", bytes, " bytes is impossible");
    size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
    data_ = std::aligned_alloc(64, rounded);
    if (!data_) OPD_FAIL(OutOfMemory, "host allocation of ", bytes, " bytes failed");
    bytes_ = bytes;
    device_ = Device::CPU;
    counter(Device::CPU).add(static_cast<int64_t>(bytes_));
  }
  ~HostStorage() override {
    std::free(data_);
    counter(Device::CPU).sub(static_cast<int64_t>(bytes_));
  }
};

class DeviceStorage final : public Storage {
 public:
  explicit DeviceStorage(size_t bytes) {
    data_ = device_hooks::cuda_malloc(std::max<size_t>(bytes, 1));
    bytes_ = bytes;
    device_ = Device::CUDA;
    counter(Device::CUDA).add(static_cast<int64_t>(bytes_));
  }
  ~DeviceStorage() override {
    device_hooks::cuda_free(data_);
    counter(Device::CUDA).sub(static_cast<int64_t>(bytes_));
  }
};

class BorrowedStorage final : public Storage {
 public:
  BorrowedStorage(void* data, size_t bytes, std::shared_ptr<void> owner, bool writable)
      : owner_(std::move(owner)) {
    data_ = data;
    bytes_ = bytes;
    device_ = Device::CPU;
    writable_ = writable;
  }

 private:
  std::shared_ptr<void> owner_;
};

}  // namespace

MemoryStats memory_stats(Device device) {
  return {counter(device).in_use.load(), counter(device).peak.load()};
}
void reset_peak_memory(Device device) { counter(device).peak = counter(device).in_use.load(); }

std::shared_ptr<Storage> host_storage(size_t bytes) { return std::make_shared<HostStorage>(bytes); }
std::shared_ptr<Storage> device_storage(size_t bytes) {
  return std::make_shared<DeviceStorage>(bytes);
}
std::shared_ptr<Storage> borrowed_storage(void* data, size_t bytes, std::shared_ptr<void> owner,
                                          bool writable) {
  return std::make_shared<BorrowedStorage>(data, bytes, std::move(owner), writable);
}

Tensor::Tensor(std::shared_ptr<Storage> storage, size_t byte_offset, Shape shape, DType dtype)
    : storage_(std::move(storage)), offset_(byte_offset), shape_(std::move(shape)), dtype_(dtype) {
  OPD_CHECK(storage_ != nullptr, InvalidArgument, "tensor without storage");
  OPD_CHECK(offset_ + nbytes() <= storage_->bytes(), InvalidArgument, "tensor ",
            shape_str(shape_), " ", dtype_name(dtype_), " at byte offset ", offset_,
            " exceeds its storage of ", storage_->bytes(), " bytes");
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  size_t bytes = 0;
  OPD_CHECK(!__builtin_mul_overflow(static_cast<size_t>(shape_numel(shape)), dtype_size(dtype), &bytes),
            OutOfMemory, "tensor of shape ", shape_str(shape), " (", dtype_name(dtype),
            ") has a byte size past 2^64");
  auto storage = device == Device::CPU ? host_storage(bytes) : device_storage(bytes);
  return Tensor(std::move(storage), 0, shape, dtype);
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_zero();
  return t;
}

Tensor Tensor::poisoned(const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  int64_t n = t.numel();
  switch (dtype) {
    case DType::F32: std::fill_n(t.data<float>(), n, std::numeric_limits<float>::quiet_NaN()); break;
    case DType::F64: std::fill_n(t.data<double>(), n, std::numeric_limits<double>::quiet_NaN()); break;
    case DType::BF16: std::fill_n(reinterpret_cast<uint16_t*>(t.raw()), n, uint16_t{0x7fc0}); break;
    case DType::F16: std::fill_n(reinterpret_cast<uint16_t*>(t.raw()), n, uint16_t{0x7e00}); break;
    default: std::memset(t.raw(), 0x7f, t.nbytes()); break;
  }
  return t;
}

int64_t Tensor::dim(int i) const {
  int n = ndim();
  int j = i < 0 ? i + n : i;
  OPD_CHECK(j >= 0 && j < n, InvalidArgument, "dim ", i, " of a ", n, "-d tensor");
  return shape_[static_cast<size_t>(j)];
}

void* Tensor::raw() const {
  OPD_CHECK(storage_ != nullptr, InvalidArgument, "access to an undefined tensor");
  return static_cast<char*>(storage_->data()) + offset_;
}

Tensor Tensor::reshape(const Shape& shape) const {
  Shape s = shape;
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      OPD_CHECK(infer < 0, InvalidArgument, "reshape ", shape_str(shape), ": two -1 dims");
      infer = static_cast<int>(i);
    } else {
      known *= s[i];
    }
  }
  if (infer >= 0) {
    OPD_CHECK(known > 0 && numel() % known == 0, InvalidArgument, "cannot reshape ",
              shape_str(shape_), " to ", shape_str(shape));
    s[static_cast<size_t>(infer)] = numel() / known;
  }
  OPD_CHECK(shape_numel(s) == numel(), InvalidArgument, "cannot reshape ", shape_str(shape_),
            " to ", shape_str(shape));
  return Tensor(storage_, offset_, s, dtype_);
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  OPD_CHECK(ndim() >= 1 && 0 <= begin && begin <= end && end <= shape_[0], InvalidArgument,
            "slice_rows [", begin, ", ", end, ") of ", shape_str(shape_));
  int64_t row = shape_[0] ? numel() / shape_[0] : 0;
  Shape s = shape_;
  s[0] = end - begin;
  return Tensor(storage_, offset_ + static_cast<size_t>(begin * row) * dtype_size(dtype_), s,
                dtype_);
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device());
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(Device device) const {
  if (device == this->device()) return *this;
  Tensor t = empty(shape_, dtype_, device);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to_dtype(DType dtype) const {
  OPD_CHECK(device() == Device::CPU, Unsupported, "to_dtype on ", describe(), " (host only)");
  if (dtype == dtype_) return clone();
  OPD_CHECK(dtype_is_float(dtype) && dtype_is_float(dtype_), Unsupported, "conversion ",
            dtype_name(dtype_), " -> ", dtype_name(dtype));
  int64_t n = numel();
  std::vector<double> tmp(static_cast<size_t>(n));
  const void* src = raw();
  for (int64_t i = 0; i < n; ++i) {
    switch (dtype_) {
      case DType::F32: tmp[i] = static_cast<const float*>(src)[i]; break;
      case DType::F64: tmp[i] = static_cast<const double*>(src)[i]; break;
      case DType::BF16: tmp[i] = bf16_to_float(static_cast<const uint16_t*>(src)[i]); break;
      case DType::F16: tmp[i] = f16_to_float(static_cast<const uint16_t*>(src)[i]); break;
      default: break;
    }
  }
  Tensor out = empty(shape_, dtype);
  void* dst = out.raw();
  for (int64_t i = 0; i < n; ++i) {
    switch (dtype) {
      case DType::F32: static_cast<float*>(dst)[i] = static_cast<float>(tmp[i]); break;
      case DType::F64: static_cast<double*>(dst)[i] = tmp[i]; break;
      case DType::BF16:
        static_cast<uint16_t*>(dst)[i] = float_to_bf16(static_cast<float>(tmp[i]));
        break;
      case DType::F16:
        static_cast<uint16_t*>(dst)[i] = float_to_f16(static_cast<float>(tmp[i]));
        break;
      default: break;
    }
  }
  return out;
}

void Tensor::fill_zero() {
  if (nbytes() == 0) return;
  if (device() == Device::CPU) {
    std::memset(raw(), 0, nbytes());
  } else {
    device_hooks::cuda_memset_zero(raw(), nbytes());
  }
}

void Tensor::copy_from(const Tensor& src) {
  OPD_CHECK(src.shape_ == shape_ && src.dtype_ == dtype_, InvalidArgument, "copy_from ",
            src.describe(), " into ", describe());
  if (nbytes() == 0) return;
  if (device() == Device::CPU && src.device() == Device::CPU) {
    std::memcpy(raw(), src.raw(), nbytes());
  } else {
    device_hooks::cuda_memcpy(raw(), device(), src.raw(), src.device(), nbytes());
  }
}

std::string Tensor::describe() const {
  return cat(dtype_name(dtype_), shape_str(shape_), device() == Device::CPU ? " cpu" : " cuda");
}

}  // namespace opd
