// Whole-buffer writes and the OPD_TEST_WRITE_FAULT seam (contract in file_write.h).
#include "core/file_write.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "core/log.h"

namespace opd {
namespace {

struct FaultSpec {
  std::string substr;
  int64_t nth = 0;  // 0: every match
  bool and_later = false;
  int64_t seen = 0;
};

struct FaultState {
  std::mutex mutex;
  bool loaded = false;
  std::vector<FaultSpec> specs;
};

FaultState& fault_state() {
  static FaultState s;
  return s;
}

std::vector<FaultSpec> parse_specs(const std::string& text) {
  std::vector<FaultSpec> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find(';', pos);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(pos, end - pos);
    pos = end + 1;
    if (item.empty()) continue;
    FaultSpec f;
    const size_t at = item.rfind('@');
    if (at != std::string::npos) {
      std::string n = item.substr(at + 1);
      if (!n.empty() && n.back() == '+') {
        f.and_later = true;
        n.pop_back();
      }
      char* stop = nullptr;
      f.nth = std::strtoll(n.c_str(), &stop, 10);
      if (n.empty() || *stop != '\0' || f.nth < 1) {
        log_warn("OPD_TEST_WRITE_FAULT item '", item, "' is not SUBSTR[@N[+]]; ignored");
        continue;
      }
      item.resize(at);
    }
    f.substr = item;
    out.push_back(f);
  }
  return out;
}

// True when this write to `path` is to fail (counts the match).
bool injected_fault(const std::string& path) {
  FaultState& s = fault_state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.loaded) {
    s.loaded = true;
    if (const char* v = std::getenv("OPD_TEST_WRITE_FAULT")) s.specs = parse_specs(v);
  }
  bool fail = false;
  for (FaultSpec& f : s.specs) {
    if (path.find(f.substr) == std::string::npos) continue;
    ++f.seen;
    fail = fail || f.nth == 0 || f.seen == f.nth || (f.and_later && f.seen > f.nth);
  }
  return fail;
}

// write(2) or pwrite(2) until n bytes are written; offset < 0: write at the file position.
void write_loop(int fd, const char* p, size_t n, int64_t offset, const std::string& path) {
  while (n > 0) {
    // Linux writes at most ~2 GiB per call; larger buffers take several.
    const size_t chunk = std::min<size_t>(n, size_t{1} << 30);
    const ssize_t w = offset < 0 ? ::write(fd, p, chunk) : ::pwrite(fd, p, chunk, offset);
    if (w < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      OPD_FAIL(Io, "write to ", path, " failed: ", std::strerror(e));
    }
    p += w;
    n -= static_cast<size_t>(w);
    if (offset >= 0) offset += w;
  }
}

void checked_write(int fd, const char* p, size_t n, int64_t offset, const std::string& path) {
  if (n > 0 && injected_fault(path)) {
    // As a disk that fills mid-write: half the bytes land, then ENOSPC.
    write_loop(fd, p, n / 2, offset, path);
    OPD_FAIL(Io, "write to ", path, " failed: ", std::strerror(ENOSPC), " (OPD_TEST_WRITE_FAULT)");
  }
  write_loop(fd, p, n, offset, path);
}

}  // namespace

void write_fully(int fd, const void* data, size_t n, const std::string& path) {
  checked_write(fd, static_cast<const char*>(data), n, -1, path);
}

void pwrite_fully(int fd, const void* data, size_t n, uint64_t offset, const std::string& path) {
  checked_write(fd, static_cast<const char*>(data), n, static_cast<int64_t>(offset), path);
}

void set_write_fault_for_tests(const std::string& spec) {
  FaultState& s = fault_state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.loaded = true;
  s.specs = parse_specs(spec);
}

}  // namespace opd
