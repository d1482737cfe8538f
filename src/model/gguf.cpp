// GGUF reader: parses and validates the whole header (ggml docs/gguf.md, versions 2 and 3) of
// an mmapped file or an in-memory image. Rules beyond the spec's own: at most 4 dims (ggml's
// GGML_MAX_DIMS), every dim >= 1, nested arrays at most 8 deep, no duplicate keys or tensor
// names, tensors inside the data section without overlaps. Every count is bounded by the bytes
// left before anything is reserved, so a hostile count cannot make opd allocate.
#include "model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "model/dequant.h"

namespace opd {

static_assert(std::endian::native == std::endian::little, "GGUF reader assumes a little-endian host");

std::string_view gguf_type_name(GgufType type) {
  switch (type) {
    case GgufType::U8: return "uint8";
    case GgufType::I8: return "int8";
    case GgufType::U16: return "uint16";
    case GgufType::I16: return "int16";
    case GgufType::U32: return "uint32";
    case GgufType::I32: return "int32";
    case GgufType::F32: return "float32";
    case GgufType::Bool: return "bool";
    case GgufType::String: return "string";
    case GgufType::Array: return "array";
    case GgufType::U64: return "uint64";
    case GgufType::I64: return "int64";
    case GgufType::F64: return "float64";
  }
  return "?";
}

const GgmlTypeInfo* ggml_type_info(uint32_t type) {
  // Block sizes from ggml's block definitions: QK = 32 for the legacy quants, QK_K = 256 for
  // the k-quants; bytes = scales + quants of one block.
  static const GgmlTypeInfo kF32{"F32", 1, 4}, kF16{"F16", 1, 2}, kQ4_0{"Q4_0", 32, 18},
      kQ4_1{"Q4_1", 32, 20}, kQ5_0{"Q5_0", 32, 22}, kQ5_1{"Q5_1", 32, 24}, kQ8_0{"Q8_0", 32, 34},
      kQ8_1{"Q8_1", 32, 36}, kQ2_K{"Q2_K", 256, 84}, kQ3_K{"Q3_K", 256, 110},
      kQ4_K{"Q4_K", 256, 144}, kQ5_K{"Q5_K", 256, 176}, kQ6_K{"Q6_K", 256, 210},
      kQ8_K{"Q8_K", 256, 292}, kI8{"I8", 1, 1}, kI16{"I16", 1, 2}, kI32{"I32", 1, 4},
      kI64{"I64", 1, 8}, kF64{"F64", 1, 8}, kBF16{"BF16", 1, 2};
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::F32: return &kF32;
    case GgmlType::F16: return &kF16;
    case GgmlType::Q4_0: return &kQ4_0;
    case GgmlType::Q4_1: return &kQ4_1;
    case GgmlType::Q5_0: return &kQ5_0;
    case GgmlType::Q5_1: return &kQ5_1;
    case GgmlType::Q8_0: return &kQ8_0;
    case GgmlType::Q8_1: return &kQ8_1;
    case GgmlType::Q2_K: return &kQ2_K;
    case GgmlType::Q3_K: return &kQ3_K;
    case GgmlType::Q4_K: return &kQ4_K;
    case GgmlType::Q5_K: return &kQ5_K;
    case GgmlType::Q6_K: return &kQ6_K;
    case GgmlType::Q8_K: return &kQ8_K;
    case GgmlType::I8: return &kI8;
    case GgmlType::I16: return &kI16;
    case GgmlType::I32: return &kI32;
    case GgmlType::I64: return &kI64;
    case GgmlType::F64: return &kF64;
    case GgmlType::BF16: return &kBF16;
  }
  return nullptr;
}

bool GgufValue::is_integer() const {
  switch (type) {
    case GgufType::U8: case GgufType::I8: case GgufType::U16: case GgufType::I16:
    case GgufType::U32: case GgufType::I32: case GgufType::U64: case GgufType::I64:
      return true;
    default:
      return false;
  }
}

std::string GgufValue::describe() const {
  switch (type) {
    case GgufType::String: {
      std::string shown = s.size() > 60 ? s.substr(0, 57) + "..." : s;
      return cat("string '", shown, "'");
    }
    case GgufType::Array:
      return cat("array[", array.size(), "] of ", gguf_type_name(elem_type));
    case GgufType::Bool:
      return cat("bool ", b ? "true" : "false");
    case GgufType::F32: case GgufType::F64:
      return cat(gguf_type_name(type), " ", f);
    case GgufType::I8: case GgufType::I16: case GgufType::I32: case GgufType::I64:
      return cat(gguf_type_name(type), " ", i);
    default:
      return cat(gguf_type_name(type), " ", u);
  }
}

int64_t GgufTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;  // overflow excluded at parse time
  return n;
}

Shape GgufTensorInfo::shape() const { return Shape(ne.rbegin(), ne.rend()); }

namespace {

constexpr int kMaxArrayDepth = 8;
// Array elements in the whole header. A parsed value is ~100 bytes while a uint8 element takes
// one byte of file, so the byte bound on counts alone would let a 100 MB file allocate 10 GB.
// Real files hold ~1.5M (tokens, scores, token types and merges of a 256k vocabulary).
constexpr uint64_t kMaxArrayElements = uint64_t{1} << 23;
constexpr int kMaxDims = 4;  // GGML_MAX_DIMS

class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

class Mapping {
 public:
  Mapping(void* addr, size_t bytes) : addr_(addr), bytes_(bytes) {}
  ~Mapping() { ::munmap(addr_, bytes_); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  const uint8_t* data() const { return static_cast<const uint8_t*>(addr_); }

 private:
  void* addr_;
  size_t bytes_;
};

// Smallest encoding of one value of a type: bounds how many array elements the bytes left can hold.
uint64_t min_value_bytes(GgufType t) {
  switch (t) {
    case GgufType::U8: case GgufType::I8: case GgufType::Bool: return 1;
    case GgufType::U16: case GgufType::I16: return 2;
    case GgufType::U32: case GgufType::I32: case GgufType::F32: return 4;
    case GgufType::U64: case GgufType::I64: case GgufType::F64: return 8;
    case GgufType::String: return 8;   // the length
    case GgufType::Array: return 12;   // element type + count
  }
  return 1;
}

bool valid_gguf_type(uint32_t t) { return t <= 12; }

std::string shown_name(const std::string& name) {
  if (name.size() <= 120) return "'" + name + "'";
  return "'" + name.substr(0, 117) + "...'";
}

}  // namespace

// Reads the header with a cursor; every read says what it reads so a short file names the field.
class GgufParser {
 public:
  GgufParser(GgufFile& f) : f_(f), base_(f.base_), size_(f.size_) {}

  void parse() {
    const std::string& src = f_.path_;
    if (size_ < 4)
      OPD_FAIL(InvalidData, src, ": file is ", size_, " bytes, too short for the GGUF magic");
    if (std::memcmp(base_, "GGUF", 4) != 0)
      OPD_FAIL(InvalidData, src, ": bad magic ", hex_bytes(base_, 4),
               ", expected 47 47 55 46 (\"GGUF\"); not a GGUF file");
    pos_ = 4;
    const uint32_t version = read<uint32_t>("header.version");
    if (version == 1)
      OPD_FAIL(Unsupported, src, ": GGUF version 1 (32-bit counts, 2023) is not supported; "
                                 "re-save the file with a current llama.cpp (version 2 or 3)");
    if ((version & 0xFFFFu) == 0 && version != 0)
      OPD_FAIL(Unsupported, src, ": header.version reads ", version,
               ", which is a byte-swapped small number: a big-endian GGUF, not supported");
    if (version != 2 && version != 3)
      OPD_FAIL(Unsupported, src, ": header.version = ", version, ", opd reads versions 2 and 3");
    f_.version_ = version;
    const uint64_t n_tensors = read<uint64_t>("header.tensor_count");
    const uint64_t n_kv = read<uint64_t>("header.metadata_kv_count");
    // A key/value takes at least 13 bytes (key length, value type, 1 value byte); a tensor info
    // at least 24 (name length, n_dims, type, offset).
    check_count("header.metadata_kv_count", n_kv, 13);
    check_count("header.tensor_count", n_tensors, 24);

    f_.kv_.reserve(n_kv);
    for (uint64_t k = 0; k < n_kv; ++k) {
      const std::string where = cat("metadata[", k, "]");
      std::string key = read_string(where + ".key");
      const std::string kw = cat("metadata key ", shown_name(key));
      const uint32_t t = read<uint32_t>(kw + " value type");
      if (!valid_gguf_type(t))
        OPD_FAIL(InvalidData, src, ": ", kw, " has value type ", t,
                 ", not a GGUF type (0..12) [at offset ", pos_ - 4, "]");
      GgufValue v = read_value(static_cast<GgufType>(t), kw, 0);
      if (f_.kv_index_.count(key))
        OPD_FAIL(InvalidData, src, ": ", kw, " appears twice");
      f_.kv_index_.emplace(key, f_.kv_.size());
      f_.kv_.emplace_back(std::move(key), std::move(v));
    }

    if (const GgufValue* a = f_.find("general.alignment")) {
      if (a->type != GgufType::U32)
        OPD_FAIL(InvalidData, src, ": general.alignment is ", a->describe(), ", the spec says uint32");
      if (a->u == 0 || (a->u & (a->u - 1)) != 0)
        OPD_FAIL(InvalidData, src, ": general.alignment = ", a->u, " is not a power of two");
      f_.alignment_ = a->u;
    }

    f_.tensors_.reserve(n_tensors);
    for (uint64_t n = 0; n < n_tensors; ++n) parse_tensor_info(n);

    // The data section starts at the next multiple of the alignment after the header.
    const uint64_t al = f_.alignment_;
    const uint64_t pad = (al - pos_ % al) % al;
    f_.data_offset_ = pos_ + pad;
    if (n_tensors > 0 && f_.data_offset_ > size_)
      OPD_FAIL(InvalidData, src, ": the data section would start at offset ", f_.data_offset_,
               " (header end ", pos_, " aligned to ", al, "), past the end of the file (",
               size_, " bytes)");
    const uint64_t data_size = n_tensors > 0 ? size_ - f_.data_offset_ : 0;
    std::vector<const GgufTensorInfo*> by_offset;
    for (const GgufTensorInfo& t : f_.tensors_) {
      if (t.offset > data_size || t.nbytes > data_size - t.offset)
        OPD_FAIL(InvalidData, src, ": tensor ", shown_name(t.name), " data [", t.offset, ", ",
                 t.offset + t.nbytes, ") (offset + ", t.nbytes, " bytes of ",
                 ggml_type_info(static_cast<uint32_t>(t.type))->name,
                 ") ends past the data section, which has ", data_size, " bytes (file ", size_,
                 " bytes, data at ", f_.data_offset_, ")");
      by_offset.push_back(&t);
    }
    std::sort(by_offset.begin(), by_offset.end(),
              [](const GgufTensorInfo* a, const GgufTensorInfo* b) { return a->offset < b->offset; });
    for (size_t i = 1; i < by_offset.size(); ++i) {
      const GgufTensorInfo& a = *by_offset[i - 1];
      const GgufTensorInfo& b = *by_offset[i];
      if (a.offset + a.nbytes > b.offset)
        OPD_FAIL(InvalidData, src, ": tensors ", shown_name(a.name), " [", a.offset, ", ",
                 a.offset + a.nbytes, ") and ", shown_name(b.name), " [", b.offset, ", ",
                 b.offset + b.nbytes, ") overlap");
    }
  }

 private:
  static std::string hex_bytes(const uint8_t* p, size_t n) {
    static const char* digits = "0123456789abcdef";
    std::string out;
    for (size_t i = 0; i < n; ++i) {
      if (i) out += ' ';
      out += digits[p[i] >> 4];
      out += digits[p[i] & 15];
    }
    return out;
  }

  uint64_t left() const { return size_ - pos_; }

  void need(uint64_t n, const std::string& what) const {
    if (n > left())
      OPD_FAIL(InvalidData, f_.path_, ": ", what, " needs ", n, " bytes at offset ", pos_,
               " but only ", left(), " remain (file size ", size_, "): truncated or corrupt");
  }

  template <typename T>
  T read(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  std::string read_string(const std::string& what) {
    const uint64_t len = read<uint64_t>(what + " length");
    if (len > left())
      OPD_FAIL(InvalidData, f_.path_, ": ", what, " length ", len, " at offset ", pos_ - 8,
               " exceeds the ", left(), " bytes left in the file (size ", size_, ")");
    std::string s(reinterpret_cast<const char*>(base_ + pos_), len);
    pos_ += len;
    return s;
  }

  void check_count(const std::string& what, uint64_t count, uint64_t min_bytes) const {
    if (count > left() / min_bytes)
      OPD_FAIL(InvalidData, f_.path_, ": ", what, " = ", count, " cannot fit: each takes at least ",
               min_bytes, " bytes and only ", left(), " remain after offset ", pos_,
               " (file size ", size_, ")");
  }

  GgufValue read_value(GgufType type, const std::string& what, int depth) {
    GgufValue v;
    v.type = type;
    switch (type) {
      case GgufType::U8: v.u = read<uint8_t>(what); v.i = static_cast<int64_t>(v.u); break;
      case GgufType::U16: v.u = read<uint16_t>(what); v.i = static_cast<int64_t>(v.u); break;
      case GgufType::U32: v.u = read<uint32_t>(what); v.i = static_cast<int64_t>(v.u); break;
      case GgufType::U64:
        v.u = read<uint64_t>(what);
        v.i = v.u > static_cast<uint64_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(v.u);
        break;
      case GgufType::I8: v.i = read<int8_t>(what); break;
      case GgufType::I16: v.i = read<int16_t>(what); break;
      case GgufType::I32: v.i = read<int32_t>(what); break;
      case GgufType::I64: v.i = read<int64_t>(what); break;
      case GgufType::F32: v.f = read<float>(what); break;
      case GgufType::F64: v.f = read<double>(what); break;
      case GgufType::Bool: {
        const uint8_t b = read<uint8_t>(what);
        if (b > 1)
          OPD_FAIL(InvalidData, f_.path_, ": ", what, " is a bool with byte value ", int(b),
                   " (must be 0 or 1) at offset ", pos_ - 1);
        v.b = b != 0;
        break;
      }
      case GgufType::String: v.s = read_string(what); break;
      case GgufType::Array: {
        if (depth >= kMaxArrayDepth)
          OPD_FAIL(InvalidData, f_.path_, ": ", what, " nests arrays deeper than ",
                   kMaxArrayDepth, " levels");
        const uint32_t et = read<uint32_t>(what + " array element type");
        if (!valid_gguf_type(et))
          OPD_FAIL(InvalidData, f_.path_, ": ", what, " is an array of type ", et,
                   ", not a GGUF type (0..12) [at offset ", pos_ - 4, "]");
        v.elem_type = static_cast<GgufType>(et);
        const uint64_t n = read<uint64_t>(what + " array length");
        check_count(what + " array length", n, min_value_bytes(v.elem_type));
        if (n > kMaxArrayElements - array_elements_)
          OPD_FAIL(InvalidData, f_.path_, ": ", what, " array length ", n, " at offset ", pos_ - 8,
                   " brings the header's array elements past ", kMaxArrayElements,
                   " (opd's limit; real GGUF files hold about 1.5M)");
        array_elements_ += n;
        v.array.reserve(n);
        for (uint64_t i = 0; i < n; ++i)
          v.array.push_back(read_value(v.elem_type, cat(what, "[", i, "]"), depth + 1));
        break;
      }
    }
    if (v.is_integer() && type != GgufType::U8 && type != GgufType::U16 &&
        type != GgufType::U32 && type != GgufType::U64)
      v.u = v.i < 0 ? 0 : static_cast<uint64_t>(v.i);
    return v;
  }

  void parse_tensor_info(uint64_t n) {
    const std::string& src = f_.path_;
    GgufTensorInfo t;
    t.name = read_string(cat("tensor_info[", n, "].name"));
    const std::string tw = cat("tensor ", shown_name(t.name));
    if (t.name.empty()) OPD_FAIL(InvalidData, src, ": tensor_info[", n, "] has an empty name");
    const uint32_t n_dims = read<uint32_t>(tw + " n_dims");
    if (n_dims == 0 || n_dims > kMaxDims)
      OPD_FAIL(InvalidData, src, ": ", tw, " has n_dims = ", n_dims, " (must be 1..", kMaxDims, ")");
    int64_t numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t ne = read<uint64_t>(cat(tw, " ne[", d, "]"));
      if (ne == 0 || ne > static_cast<uint64_t>(INT64_MAX))
        OPD_FAIL(InvalidData, src, ": ", tw, " has ne[", d, "] = ", ne, " (must be 1..2^63-1)");
      if (__builtin_mul_overflow(numel, static_cast<int64_t>(ne), &numel))
        OPD_FAIL(InvalidData, src, ": ", tw, " element count overflows 64 bits at ne[", d, "] = ", ne);
      t.ne.push_back(static_cast<int64_t>(ne));
    }
    const uint32_t type = read<uint32_t>(tw + " type");
    const GgmlTypeInfo* info = ggml_type_info(type);
    if (!info)
      OPD_FAIL(InvalidData, src, ": ", tw, " has ggml type ", type,
               ", which is unknown (known: 0-3, 6-15, 24-28, 30)");
    t.type = static_cast<GgmlType>(type);
    if (t.ne[0] % info->block_elems != 0)
      OPD_FAIL(InvalidData, src, ": ", tw, " row length ne[0] = ", t.ne[0],
               " is not a multiple of the ", info->name, " block size ", info->block_elems);
    int64_t nbytes = 0;
    if (__builtin_mul_overflow(numel / info->block_elems, info->block_bytes, &nbytes))
      OPD_FAIL(InvalidData, src, ": ", tw, " byte size overflows 64 bits");
    t.nbytes = static_cast<uint64_t>(nbytes);
    t.offset = read<uint64_t>(tw + " offset");
    if (t.offset % f_.alignment_ != 0)
      OPD_FAIL(InvalidData, src, ": ", tw, " offset ", t.offset,
               " is not a multiple of the alignment ", f_.alignment_);
    if (f_.tensor_index_.count(t.name))
      OPD_FAIL(InvalidData, src, ": ", tw, " appears twice in the tensor infos");
    f_.tensor_index_.emplace(t.name, f_.tensors_.size());
    f_.tensors_.push_back(std::move(t));
  }

  GgufFile& f_;
  const uint8_t* base_;
  uint64_t size_;
  uint64_t pos_ = 0;
  uint64_t array_elements_ = 0;
};

GgufFile GgufFile::open(const std::string& path) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) OPD_FAIL(Io, "cannot open ", path, ": ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) OPD_FAIL(Io, "cannot stat ", path, ": ", std::strerror(errno));
  if (!S_ISREG(st.st_mode)) OPD_FAIL(InvalidData, path, ": not a regular file");
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 4)  // before mmap, which rejects a zero-length mapping
    OPD_FAIL(InvalidData, path, ": file is ", size, " bytes, too short for the GGUF magic");
  void* addr = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (addr == MAP_FAILED) OPD_FAIL(Io, "cannot mmap ", path, ": ", std::strerror(errno));
  auto mapping = std::make_shared<Mapping>(addr, size);
  GgufFile f;
  f.path_ = path;
  f.owner_ = mapping;
  f.base_ = mapping->data();
  f.size_ = size;
  GgufParser(f).parse();
  return f;
}

GgufFile GgufFile::from_bytes(std::shared_ptr<const std::string> bytes, const std::string& source) {
  OPD_CHECK(bytes != nullptr, InvalidArgument, "GgufFile::from_bytes(", source, "): null buffer");
  GgufFile f;
  f.path_ = source;
  f.base_ = reinterpret_cast<const uint8_t*>(bytes->data());
  f.size_ = bytes->size();
  f.owner_ = std::const_pointer_cast<std::string>(bytes);
  GgufParser(f).parse();
  return f;
}

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

namespace {
[[noreturn]] void wrong_type(const std::string& file, std::string_view key, const GgufValue& v,
                             const char* wanted) {
  OPD_FAIL(InvalidData, file, ": metadata key '", key, "' is ", v.describe(), ", expected ", wanted);
}
}  // namespace

uint64_t GgufFile::get_uint(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) OPD_FAIL(InvalidData, path_, ": metadata key '", key, "' is required but missing");
  if (!v->is_integer() || (v->i < 0 && v->type != GgufType::U64))
    wrong_type(path_, key, *v, "a non-negative integer");
  return v->u;
}

uint64_t GgufFile::get_uint(std::string_view key, uint64_t fallback) const {
  return find(key) ? get_uint(key) : fallback;
}

double GgufFile::get_float(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) OPD_FAIL(InvalidData, path_, ": metadata key '", key, "' is required but missing");
  if (v->type == GgufType::F32 || v->type == GgufType::F64) return v->f;
  if (v->is_integer()) return static_cast<double>(v->i);
  wrong_type(path_, key, *v, "a number");
}

double GgufFile::get_float(std::string_view key, double fallback) const {
  return find(key) ? get_float(key) : fallback;
}

bool GgufFile::get_bool(std::string_view key, bool fallback) const {
  const GgufValue* v = find(key);
  if (!v) return fallback;
  if (v->type != GgufType::Bool) wrong_type(path_, key, *v, "a bool");
  return v->b;
}

std::string GgufFile::get_string(std::string_view key) const {
  std::optional<std::string> s = find_string(key);
  if (!s) OPD_FAIL(InvalidData, path_, ": metadata key '", key, "' is required but missing");
  return *s;
}

std::optional<std::string> GgufFile::find_string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != GgufType::String) wrong_type(path_, key, *v, "a string");
  return v->s;
}

std::vector<std::string> GgufFile::get_string_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) OPD_FAIL(InvalidData, path_, ": metadata key '", key, "' is required but missing");
  if (v->type != GgufType::Array || v->elem_type != GgufType::String)
    wrong_type(path_, key, *v, "an array of strings");
  std::vector<std::string> out;
  out.reserve(v->array.size());
  for (const GgufValue& e : v->array) out.push_back(e.s);
  return out;
}

std::vector<int64_t> GgufFile::get_int_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) OPD_FAIL(InvalidData, path_, ": metadata key '", key, "' is required but missing");
  GgufValue probe;
  probe.type = v->elem_type;
  if (v->type != GgufType::Array || !probe.is_integer())
    wrong_type(path_, key, *v, "an array of integers");
  std::vector<int64_t> out;
  out.reserve(v->array.size());
  for (const GgufValue& e : v->array) out.push_back(e.i);
  return out;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufTensorInfo& GgufFile::tensor(std::string_view name) const {
  const GgufTensorInfo* t = find_tensor(name);
  if (!t) OPD_FAIL(InvalidData, path_, ": tensor '", name, "' is missing");
  return *t;
}

std::span<const uint8_t> GgufFile::tensor_bytes(const GgufTensorInfo& info) const {
  // info comes from this file, whose bounds were checked at open(); re-check cheaply anyway in
  // case a caller passes an info from another file.
  OPD_CHECK(data_offset_ + info.offset + info.nbytes <= size_, InvalidArgument, path_,
            ": tensor '", info.name, "' does not lie in this file");
  return {base_ + data_offset_ + info.offset, static_cast<size_t>(info.nbytes)};
}

Tensor GgufFile::dequantize(const GgufTensorInfo& info, DType out) const {
  OPD_CHECK(out == DType::F32 || out == DType::BF16, InvalidArgument,
            "GGUF dequantize: output dtype must be f32 or bf16, got ", dtype_name(out));
  if (!dequant_supported(info.type))
    OPD_FAIL(Unsupported, path_, ": tensor '", info.name, "' has type ",
             ggml_type_info(static_cast<uint32_t>(info.type))->name,
             ", which opd cannot dequantize (supported: ", dequant_supported_list(), ")");
  Tensor t = Tensor::empty(info.shape(), DType::F32);
  dequantize_blocks(info.type, tensor_bytes(info), std::span<float>(t.data<float>(), t.numel()));
  return out == DType::F32 ? t : t.to_dtype(out);
}

}  // namespace opd
