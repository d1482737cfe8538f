// safetensors reader (mmap, zero-copy, every header field validated), sharded model
// directories, and the atomic writer. Validation follows the reference implementation
// (huggingface/safetensors, safetensors/src/tensor.rs): header length within the file and at
// most 100 MB, known dtypes, offsets consistent with dtype x shape, tensors tiling the data
// section with no gaps, no overlaps and no trailing bytes; duplicate names are also refused.
#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <tuple>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/file_write.h"
#include "core/text_io.h"
#include "core/log.h"

namespace opd {

using nlohmann::json;

// The format is little-endian; opd only targets little-endian hosts (x86-64, aarch64).
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes little endian");

namespace {

// Same bound as the reference reader: a larger header is a corrupt or hostile file.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

bool dtype_from_name(const std::string& name, DType* out) {
  static const std::pair<const char*, DType> table[] = {
      {"F32", DType::F32}, {"F64", DType::F64}, {"BF16", DType::BF16},
      {"F16", DType::F16}, {"I32", DType::I32}, {"I64", DType::I64}};
  for (const auto& [n, d] : table) {
    if (name == n) {
      *out = d;
      return true;
    }
  }
  return false;
}

// Dtypes the format defines but opd has no element type for.
bool is_other_safetensors_dtype(const std::string& name) {
  static const char* names[] = {"BOOL", "U8",      "I8",      "I16",     "U16",     "U32",
                                "U64",  "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4",      "F6_E2M3",
                                "F6_E3M2", "C64"};
  for (const char* n : names) {
    if (name == n) return true;
  }
  return false;
}

// A JSON value for an error message; containers are described, not dumped (dump recurses).
std::string describe_value(const json& v) {
  if (v.is_object()) return "an object";
  if (v.is_array()) return cat("an array of ", v.size());
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

// Tensor names come from the file; cut very long ones so messages stay readable.
std::string quote_name(const std::string& name) {
  if (name.size() <= 200) return "'" + name + "'";
  return "'" + name.substr(0, 197) + "...'";
}

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
  const char* data() const { return static_cast<const char*>(addr_); }

 private:
  void* addr_;
  size_t bytes_;
};

bool read_u64_checked(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

}  // namespace

const char* safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
  }
  return "?";
}


class SafetensorsParser {
 public:
  // Validates the image [base, base + size) and fills `f` (whose owner_ keeps it alive).
  static void parse(SafetensorsFile& f, const char* base, size_t size) {
    const std::string& src = f.path_;
    if (size < 8) {
      OPD_FAIL(InvalidData, src, ": file is ", size,
               " bytes, shorter than the 8-byte safetensors header length");
    }
    uint64_t n;
    std::memcpy(&n, base, 8);
    if (n > size - 8) {
      OPD_FAIL(InvalidData, src, ": header length ", n, " exceeds the ", size - 8,
               " bytes after the length field (truncated or not a safetensors file)");
    }
    if (n > kMaxHeaderBytes) {
      OPD_FAIL(InvalidData, src, ": header length ", n, " exceeds the limit of ", kMaxHeaderBytes,
               " bytes");
    }

    // nlohmann stops at a NUL as if the input ended there ("{}\0junk" parses); JSON text
    // has no raw NUL anywhere, and the reference reader rejects one, so do we.
    if (const void* nul = std::memchr(base + 8, '\0', n)) {
      OPD_FAIL(InvalidData, src, ": header is not valid JSON: NUL byte at header offset ",
               static_cast<const char*>(nul) - (base + 8));
    }
    // nlohmann keeps the last of duplicate keys silently; a duplicate tensor name would leave
    // the first entry's bytes unaccounted for, so catch it while parsing.
    std::set<std::string> seen;
    std::string duplicate;
    auto on_event = [&](int depth, json::parse_event_t event, json& parsed) {
      if (event == json::parse_event_t::key && depth == 1 && duplicate.empty() &&
          parsed.is_string() && !seen.insert(parsed.get<std::string>()).second) {
        duplicate = parsed.get<std::string>();
      }
      return true;
    };
    json header;
    check_json_depth(std::string_view(base + 8, static_cast<size_t>(n)), src + ": header");
    try {
      header = json::parse(base + 8, base + 8 + n, on_event);
    } catch (const json::exception& e) {
      OPD_FAIL(InvalidData, src, ": header is not valid JSON: ", e.what());
    }
    if (!header.is_object()) {
      OPD_FAIL(InvalidData, src, ": header must be a JSON object, got ", describe_value(header));
    }
    if (!duplicate.empty()) {
      OPD_FAIL(InvalidData, src, ": header names tensor ", quote_name(duplicate), " twice");
    }

    f.data_ = base + 8 + n;
    f.data_size_ = size - 8 - n;
    for (auto& [name, value] : header.items()) {
      if (name == "__metadata__") {
        parse_metadata(f, value);
      } else {
        f.entries_.emplace(name, parse_entry(f, name, value));
      }
    }
    check_layout(f);
  }

 private:
  static void parse_metadata(SafetensorsFile& f, const json& value) {
    if (value.is_null()) return;  // the reference reader accepts null (an Option)
    if (!value.is_object()) {
      OPD_FAIL(InvalidData, f.path_, ": __metadata__ must be an object of strings, got ",
               describe_value(value));
    }
    for (auto& [key, v] : value.items()) {
      if (!v.is_string()) {
        OPD_FAIL(InvalidData, f.path_, ": __metadata__ value for key ", quote_name(key),
                 " must be a string, got ", describe_value(v));
      }
      f.metadata_[key] = v.get<std::string>();
    }
  }

  static SafetensorsFile::Entry parse_entry(const SafetensorsFile& f, const std::string& name,
                                            const json& value) {
    const std::string where = cat(f.path_, ": tensor ", quote_name(name));
    if (!value.is_object()) {
      OPD_FAIL(InvalidData, where, ": entry must be an object, got ", describe_value(value));
    }
    auto field = [&](const char* key) -> const json& {
      auto it = value.find(key);
      if (it == value.end()) OPD_FAIL(InvalidData, where, ": entry has no '", key, "'");
      return *it;
    };

    SafetensorsFile::Entry e{};
    const json& dtype = field("dtype");
    if (!dtype.is_string()) {
      OPD_FAIL(InvalidData, where, ": dtype must be a string, got ", describe_value(dtype));
    }
    const std::string dtype_str = dtype.get<std::string>();
    if (!dtype_from_name(dtype_str, &e.dtype)) {
      if (is_other_safetensors_dtype(dtype_str)) {
        OPD_FAIL(Unsupported, where, ": dtype ", dtype_str,
                 " is not supported (opd reads F32, F64, BF16, F16, I32, I64)");
      }
      OPD_FAIL(InvalidData, where, ": unknown dtype ", describe_value(dtype));
    }

    const json& shape = field("shape");
    if (!shape.is_array()) {
      OPD_FAIL(InvalidData, where, ": shape must be a list of non-negative integers, got ",
               describe_value(shape));
    }
    // numel and byte size in uint64 with overflow checks; each dim must also fit int64
    // (Shape's element type) and the product must fit int64 (Tensor::numel).
    uint64_t numel = 1;
    bool overflow = false;
    for (const json& d : shape) {
      uint64_t dim;
      if (!read_u64_checked(d, &dim) || dim > static_cast<uint64_t>(INT64_MAX)) {
        OPD_FAIL(InvalidData, where, ": shape must be a list of non-negative integers, found ",
                 describe_value(d));
      }
      e.shape.push_back(static_cast<int64_t>(dim));
      overflow = overflow || __builtin_mul_overflow(numel, dim, &numel);
    }
    uint64_t bytes = 0;
    overflow = overflow || numel > static_cast<uint64_t>(INT64_MAX) ||
               __builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(e.dtype)), &bytes);
    if (overflow) {
      OPD_FAIL(InvalidData, where, ": shape ", shape_str(e.shape), " of ", dtype_str,
               " overflows 64-bit byte counts");
    }

    const json& offsets = field("data_offsets");
    uint64_t begin = 0, end = 0;
    if (!offsets.is_array() || offsets.size() != 2 || !read_u64_checked(offsets[0], &begin) ||
        !read_u64_checked(offsets[1], &end)) {
      OPD_FAIL(InvalidData, where, ": data_offsets must be [begin, end] of non-negative integers, got ",
               offsets.is_array() && offsets.size() == 2
                   ? cat("[", describe_value(offsets[0]), ", ", describe_value(offsets[1]), "]")
                   : describe_value(offsets));
    }
    if (begin > end) {
      OPD_FAIL(InvalidData, where, ": data_offsets [", begin, ", ", end, "] has begin > end");
    }
    if (end - begin != bytes) {
      OPD_FAIL(InvalidData, where, ": data_offsets [", begin, ", ", end, "] span ", end - begin,
               " bytes but ", dtype_str, shape_str(e.shape), " needs ", bytes);
    }
    e.begin = begin;
    e.end = end;
    return e;
  }

  // In offset order: each tensor within the data section and starting where the previous one
  // ended, the last ending at the end of the file. Checking bounds in offset order makes a
  // truncated file name the tensor whose bytes were cut.
  static void check_layout(const SafetensorsFile& f) {
    std::vector<std::pair<const std::string*, const SafetensorsFile::Entry*>> order;
    order.reserve(f.entries_.size());
    for (const auto& [name, e] : f.entries_) order.emplace_back(&name, &e);
    std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
      return std::tie(a.second->begin, a.second->end, *a.first) <
             std::tie(b.second->begin, b.second->end, *b.first);
    });
    size_t expected = 0;
    const std::string* previous = nullptr;
    for (const auto& [name, e] : order) {
      if (e->end > f.data_size_) {
        OPD_FAIL(InvalidData, f.path_, ": tensor ", quote_name(*name), ": data_offsets [", e->begin,
                 ", ", e->end, "] end past the data section of ", f.data_size_,
                 " bytes (file truncated?)");
      }
      if (e->begin < expected) {
        OPD_FAIL(InvalidData, f.path_, ": tensor ", quote_name(*name), ": data_offsets [", e->begin,
                 ", ", e->end, "] overlap tensor ", quote_name(*previous), " which ends at ",
                 expected);
      }
      if (e->begin > expected) {
        OPD_FAIL(InvalidData, f.path_, ": tensor ", quote_name(*name), ": data_offsets [", e->begin,
                 ", ", e->end, "] leave a gap after byte ", expected);
      }
      expected = e->end;
      previous = name;
    }
    if (expected != f.data_size_) {
      OPD_FAIL(InvalidData, f.path_, ": tensors cover ", expected, " bytes of a data section of ",
               f.data_size_, " bytes (trailing bytes after the last tensor)");
    }
  }
};

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) OPD_FAIL(Io, "cannot open ", path, ": ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) OPD_FAIL(Io, "cannot stat ", path, ": ", std::strerror(errno));
  if (!S_ISREG(st.st_mode)) OPD_FAIL(InvalidData, path, ": not a regular file");
  SafetensorsFile f;
  f.path_ = path;
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    // Checked before mmap, which rejects a zero-length mapping.
    OPD_FAIL(InvalidData, path, ": file is ", size,
             " bytes, shorter than the 8-byte safetensors header length");
  }
  void* addr = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (addr == MAP_FAILED) OPD_FAIL(Io, "cannot mmap ", path, ": ", std::strerror(errno));
  auto mapping = std::make_shared<Mapping>(addr, size);
  f.owner_ = mapping;
  SafetensorsParser::parse(f, mapping->data(), size);
  return f;
}

SafetensorsFile SafetensorsFile::from_bytes(std::shared_ptr<const std::string> bytes,
                                            const std::string& source) {
  OPD_CHECK(bytes != nullptr, InvalidArgument, "from_bytes(", source, "): null buffer");
  SafetensorsFile f;
  f.path_ = source;
  const char* base = bytes->data();
  const size_t size = bytes->size();
  // Aliasing constructor: shares ownership of the string, points at its bytes.
  f.owner_ = std::shared_ptr<void>(bytes, const_cast<char*>(base));
  SafetensorsParser::parse(f, base, size);
  return f;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& [name, e] : entries_) out.push_back(name);
  return out;
}

bool SafetensorsFile::contains(const std::string& name) const { return entries_.count(name) > 0; }

Tensor SafetensorsFile::get(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    OPD_FAIL(InvalidArgument, path_, ": no tensor ", quote_name(name));
  }
  const Entry& e = it->second;
  const char* p = data_ + e.begin;
  const size_t bytes = e.end - e.begin;
  // A view must be aligned for its dtype (misaligned loads are UB). Files from the reference
  // writer always are (8-byte padded header, tensors ordered by alignment); copy otherwise.
  if (bytes == 0 || reinterpret_cast<uintptr_t>(p) % dtype_size(e.dtype) != 0) {
    Tensor t = Tensor::empty(e.shape, e.dtype);
    if (bytes) std::memcpy(t.raw(), p, bytes);
    return t;
  }
  return Tensor(borrowed_storage(const_cast<char*>(p), bytes, owner_), 0, e.shape, e.dtype);
}

// --- WeightStore ---------------------------------------------------------------------------

namespace {

bool is_file(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_regular_file(path, ec);
}

// Shard names in an index are file names relative to the model directory; refuse anything
// that could point outside it.
bool is_safe_shard_name(const std::string& name) {
  if (name.empty() || name.front() == '/') return false;
  for (const auto& part : std::filesystem::path(name)) {
    if (part == "..") return false;
  }
  return true;
}

}  // namespace

WeightStore WeightStore::open_dir(const std::string& model_dir) {
  WeightStore store;
  store.dir_ = model_dir;
  const std::string single = model_dir + "/model.safetensors";
  const std::string index_path = model_dir + "/model.safetensors.index.json";
  // transformers looks for model.safetensors first, then the index; so do we.
  if (is_file(single)) {
    store.files_.push_back(SafetensorsFile::open(single));
    for (const auto& name : store.files_[0].names()) store.index_[name] = 0;
    return store;
  }
  if (!is_file(index_path)) {
    OPD_FAIL(InvalidData, model_dir,
             ": no model.safetensors or model.safetensors.index.json in this directory");
  }

  json index;
  const std::string index_text = read_text_file(index_path);
  check_json_depth(index_text, index_path);
  try {
    index = json::parse(index_text);
  } catch (const json::exception& e) {
    OPD_FAIL(InvalidData, index_path, ": not valid JSON: ", e.what());
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    OPD_FAIL(InvalidData, index_path, ": expected an object with a 'weight_map' object");
  }
  const json& weight_map = index["weight_map"];
  std::map<std::string, size_t> shard_ids;  // shard file name -> files_ index
  for (auto& [name, shard] : weight_map.items()) {
    if (!shard.is_string() || !is_safe_shard_name(shard.get<std::string>())) {
      OPD_FAIL(InvalidData, index_path, ": weight_map entry for tensor ", quote_name(name),
               " must be a shard file name inside the directory, got ", describe_value(shard));
    }
    shard_ids.emplace(shard.get<std::string>(), 0);
  }
  for (auto& [shard, id] : shard_ids) {
    id = store.files_.size();
    store.files_.push_back(SafetensorsFile::open(model_dir + "/" + shard));
  }
  for (auto& [name, shard] : weight_map.items()) {
    const std::string shard_name = shard.get<std::string>();
    size_t id = shard_ids.at(shard_name);
    if (!store.files_[id].contains(name)) {
      OPD_FAIL(InvalidData, index_path, ": weight_map puts tensor ", quote_name(name),
               " in shard ", shard_name, ", which does not contain it");
    }
    store.index_[name] = id;
  }
  // transformers loads every tensor of every shard, listed or not; a name stored in two
  // shards would make the result depend on load order.
  size_t unlisted = 0;
  for (size_t id = 0; id < store.files_.size(); ++id) {
    for (const auto& name : store.files_[id].names()) {
      auto [it, inserted] = store.index_.emplace(name, id);
      if (inserted) {
        ++unlisted;
      } else if (it->second != id) {
        OPD_FAIL(InvalidData, model_dir, ": tensor ", quote_name(name), " is stored in both ",
                 store.files_[it->second].path(), " and ", store.files_[id].path());
      }
    }
  }
  if (unlisted) {
    log_warn(model_dir, ": ", unlisted, " tensor(s) in the shards are not listed in ",
             "model.safetensors.index.json; loading them anyway");
  }
  return store;
}

std::vector<std::string> WeightStore::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& [name, id] : index_) out.push_back(name);
  return out;
}

bool WeightStore::contains(const std::string& name) const { return index_.count(name) > 0; }

Tensor WeightStore::get(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    OPD_FAIL(InvalidData, dir_, ": tensor ", quote_name(name), " not found in the model (",
             index_.size(), " tensors)");
  }
  return files_[it->second].get(name);
}

Tensor WeightStore::get_f32(const std::string& name, const Shape& shape) const {
  Tensor t = get(name);
  if (t.shape() != shape || !dtype_is_float(t.dtype())) {
    OPD_FAIL(InvalidData, dir_, ": tensor ", quote_name(name), " is ", dtype_name(t.dtype()),
             shape_str(t.shape()), ", expected a float tensor (f32/bf16/f16/f64) of shape ",
             shape_str(shape));
  }
  // Converted here rather than with Tensor::to_dtype, which stages through a double buffer
  // (8 bytes per element on top of the result: gigabytes for an embedding matrix).
  Tensor out = Tensor::empty(shape, DType::F32);
  float* dst = out.data<float>();
  const int64_t n = t.numel();
  const void* src = t.raw();
  switch (t.dtype()) {
    case DType::F32:
      if (n) std::memcpy(dst, src, t.nbytes());
      break;
    case DType::F64:
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(static_cast<const double*>(src)[i]);
      break;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(static_cast<const uint16_t*>(src)[i]);
      break;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_float(static_cast<const uint16_t*>(src)[i]);
      break;
    default:
      OPD_FAIL(Internal, "get_f32: unreachable dtype ", dtype_name(t.dtype()));
  }
  return out;
}

// --- writer --------------------------------------------------------------------------------

namespace {

// The temp file of an atomic write: removed on every path except a completed rename.
class TempFile {
 public:
  explicit TempFile(std::string path) : path_(std::move(path)) {}
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(path_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  const std::string& path() const { return path_; }
  int fd() const { return fd_; }
  void set_fd(int fd) { fd_ = fd; }
  int close_now() {
    int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }
  void commit() { committed_ = true; }

 private:
  std::string path_;
  int fd_ = -1;
  bool committed_ = false;
};


}  // namespace

void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // Data order: descending element size, then name (what the reference writer does), so every
  // tensor starts at a multiple of its own element size with no padding between tensors.
  std::vector<std::pair<const std::string*, const Tensor*>> order;
  for (const auto& [name, t] : tensors) {
    OPD_CHECK(name != "__metadata__", InvalidArgument, "save_safetensors(", path,
              "): '__metadata__' is reserved and cannot name a tensor");
    OPD_CHECK(t.defined(), InvalidArgument, "save_safetensors(", path, "): tensor ",
              quote_name(name), " is undefined");
    order.emplace_back(&name, &t);
  }
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return dtype_size(a.second->dtype()) > dtype_size(b.second->dtype());
  });

  json header = json::object();
  uint64_t offset = 0;
  for (const auto& [name, t] : order) {
    json shape = json::array();
    for (int64_t d : t->shape()) shape.push_back(d);
    header[*name] = {{"dtype", safetensors_dtype_name(t->dtype())},
                     {"shape", std::move(shape)},
                     {"data_offsets", {offset, offset + t->nbytes()}}};
    offset += t->nbytes();
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text;
  try {
    text = header.dump();  // strict: a name that is not UTF-8 cannot be written as JSON
  } catch (const json::exception& e) {
    OPD_FAIL(InvalidArgument, "save_safetensors(", path, "): ", e.what());
  }
  // Pad with spaces so the data section starts 8-byte aligned, as the reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t header_len = text.size();

  TempFile tmp(cat(path, ".tmp.", ::getpid()));
  tmp.set_fd(::open(tmp.path().c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (tmp.fd() < 0) {
    int err = errno;
    tmp.commit();  // nothing was created: do not unlink a file someone else may own
    OPD_FAIL(Io, "cannot create ", tmp.path(), " (writing ", path, "): ", std::strerror(err));
  }
  write_fully(tmp.fd(), &header_len, 8, path);
  write_fully(tmp.fd(), text.data(), text.size(), path);
  for (const auto& [name, t] : order) {
    if (t->nbytes() == 0) continue;
    // Device tensors are copied one at a time, so host memory holds one tensor at most.
    Tensor host = t->device() == Device::CPU ? *t : t->to(Device::CPU);
    write_fully(tmp.fd(), host.raw(), host.nbytes(), path);
  }
  if (::fsync(tmp.fd()) != 0) OPD_FAIL(Io, "cannot fsync ", tmp.path(), ": ", std::strerror(errno));
  if (tmp.close_now() != 0) OPD_FAIL(Io, "cannot close ", tmp.path(), ": ", std::strerror(errno));
  if (::rename(tmp.path().c_str(), path.c_str()) != 0) {
    OPD_FAIL(Io, "cannot rename ", tmp.path(), " to ", path, ": ", std::strerror(errno));
  }
  tmp.commit();
  // The rename is durable only once the directory entry is on disk.
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  FileDescriptor dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.get() < 0 || ::fsync(dfd.get()) != 0) {
    OPD_FAIL(Io, "cannot fsync directory ", dir, " after writing ", path, ": ",
             std::strerror(errno));
  }
}

}  // namespace opd
