// weights_fingerprint (weights_fingerprint.h): config.json, then per safetensors file its name,
// size, header and evenly spaced data samples, all into one SHA-256.
#include "model/weights_fingerprint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/sha256.h"
#include "core/text_io.h"

namespace opd {

namespace {

namespace fs = std::filesystem;

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // safetensors' own limit

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Reads exactly `n` bytes at `offset` (a short file is an error: the size was checked first).
void pread_exact(int fd, void* buf, size_t n, int64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    OPD_CHECK(got > 0, Io, "weights fingerprint: cannot read ", path, " at byte ", offset, ": ",
              got < 0 ? std::strerror(errno) : "unexpected end of file");
    p += got;
    n -= static_cast<size_t>(got);
    offset += got;
  }
}

void add_u64(Sha256& h, uint64_t v) {
  unsigned char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
  h.update(b, 8);
}

void add_string(Sha256& h, const std::string& s) {  // length-prefixed: no ambiguous joins
  add_u64(h, s.size());
  h.update(s);
}

}  // namespace

WeightsFingerprint weights_fingerprint(const std::string& dir) {
  std::error_code ec;
  OPD_CHECK(fs::is_directory(dir, ec), Io, "weights fingerprint: ", dir, " is not a directory");
  WeightsFingerprint out;
  Sha256 h;
  h.update("opd weights fingerprint v1");
  const std::string config = read_text_file(dir + "/config.json");
  add_string(h, config);
  out.bytes_read += static_cast<int64_t>(config.size());

  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".safetensors") names.push_back(e.path().filename().string());
  OPD_CHECK(!ec, Io, "weights fingerprint: cannot list ", dir, ": ", ec.message());
  std::sort(names.begin(), names.end());
  add_u64(h, names.size());
  std::vector<char> buf;
  for (const std::string& name : names) {
    const std::string path = dir + "/" + name;
    Fd f;
    f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    OPD_CHECK(f.fd >= 0, Io, "weights fingerprint: cannot open ", path, ": ", std::strerror(errno));
    struct stat st {};
    OPD_CHECK(::fstat(f.fd, &st) == 0, Io, "weights fingerprint: cannot stat ", path, ": ",
              std::strerror(errno));
    const int64_t size = static_cast<int64_t>(st.st_size);
    OPD_CHECK(size >= 8, InvalidData, "weights fingerprint: ", path, " has ", size,
              " bytes, less than a safetensors header length");
    unsigned char len_bytes[8];
    pread_exact(f.fd, len_bytes, 8, 0, path);
    uint64_t header_len = 0;
    for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
    OPD_CHECK(header_len <= kMaxHeaderBytes && header_len <= static_cast<uint64_t>(size - 8),
              InvalidData, "weights fingerprint: ", path, ": header length ", header_len,
              " does not fit the file (", size, " bytes, limit ", kMaxHeaderBytes, ")");
    add_string(h, name);
    add_u64(h, static_cast<uint64_t>(size));
    buf.resize(static_cast<size_t>(header_len));
    pread_exact(f.fd, buf.data(), buf.size(), 8, path);
    add_u64(h, header_len);
    h.update(buf.data(), buf.size());
    out.bytes_read += 8 + static_cast<int64_t>(header_len);
    // Samples of the data region at kSamples evenly spaced offsets, first and last included
    // (the whole region when it is smaller than the samples together).
    const int64_t data0 = 8 + static_cast<int64_t>(header_len), data_len = size - data0;
    const int64_t span = WeightsFingerprint::kSampleBytes;
    const int n = WeightsFingerprint::kSamples;
    if (data_len <= span * n) {
      buf.resize(static_cast<size_t>(data_len));
      if (data_len > 0) pread_exact(f.fd, buf.data(), buf.size(), data0, path);
      h.update(buf.data(), buf.size());
      out.bytes_read += data_len;
    } else {
      buf.resize(static_cast<size_t>(span));
      for (int i = 0; i < n; ++i) {
        const int64_t at = data0 + (data_len - span) * i / (n - 1);
        pread_exact(f.fd, buf.data(), buf.size(), at, path);
        h.update(buf.data(), buf.size());
      }
      out.bytes_read += span * n;
    }
    ++out.files;
    out.total_bytes += size;
  }
  out.sha256 = h.hex_digest();
  return out;
}

}  // namespace opd
