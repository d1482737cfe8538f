// Helpers for the observability tests: per-process temp dirs, an independent TFRecord reader
// and protobuf wire decoder for TensorBoard event files, and a runner for external oracles
// (python3 + tensorboard, headless chromium) that skips when the tool is absent, except under
// CI (env CI set), where scripts/deps.sh installs them and a missing tool is a broken setup.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace opd::test {

namespace mfs = std::filesystem;

// Unique per process and per instance: the plain and _asan suites run concurrently.
struct MetricsTempDir {
  mfs::path path;
  explicit MetricsTempDir(const std::string& tag = "m") {
    static int counter = 0;
    path = mfs::temp_directory_path() /
           ("opd_metrics_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    mfs::remove_all(path);
    mfs::create_directories(path);
  }
  ~MetricsTempDir() {
    std::error_code ec;
    mfs::remove_all(path, ec);
  }
  std::string str() const { return path.string(); }
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void spit(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

inline std::string sh_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

inline bool metrics_in_ci() { return std::getenv("CI") != nullptr; }

// First executable of `names` found in $PATH (or the value of env `env_var` when set).
inline std::string find_program(const char* env_var, const std::vector<std::string>& names) {
  if (const char* e = std::getenv(env_var); e && *e) return e;
  const char* path = std::getenv("PATH");
  if (!path) return "";
  for (const std::string& name : names) {
    std::stringstream ss(path);
    for (std::string dir; std::getline(ss, dir, ':');) {
      if (dir.empty()) continue;
      const std::string p = dir + "/" + name;
      if (::access(p.c_str(), X_OK) == 0) return p;
    }
  }
  return "";
}

struct ToolRun {
  int exit_code = -1;
  std::string out, err;
};

// Runs a shell command with stdout/stderr captured in per-process files.
inline ToolRun run_tool(const std::string& cmd, const std::string& scratch_dir) {
  ToolRun r;
  const std::string out = scratch_dir + "/tool.stdout", err = scratch_dir + "/tool.stderr";
  const int status = std::system((cmd + " >" + sh_quote(out) + " 2>" + sh_quote(err) + " </dev/null").c_str());
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

#define OPD_SKIP_OR_FAIL_MISSING_TOOL(why)                                                     \
  do {                                                                                         \
    if (::opd::test::metrics_in_ci()) FAIL() << "oracle unavailable under CI: " << (why);      \
    GTEST_SKIP() << "\n*** ORACLE UNAVAILABLE: " << (why)                                       \
                 << "\n*** install it with scripts/deps.sh --oracles; NOT checked";            \
  } while (0)

// --- TFRecord + protobuf, written independently of src/train/metrics.cpp --------------------

// CRC-32C bit by bit (no table), so a wrong table in the library cannot hide here.
inline uint32_t ref_crc32c(const std::string& s) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char c : s) {
    crc ^= c;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}
inline uint32_t ref_masked_crc(const std::string& s) {
  const uint32_t c = ref_crc32c(s);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

template <typename T> T load_le(const std::string& s, size_t off) {
  T v{};
  std::memcpy(&v, s.data() + off, sizeof(T));
  return v;
}

// Splits a TFRecord file into its payloads; every length and data CRC must match.
inline ::testing::AssertionResult read_tfrecords(const std::string& bytes, std::vector<std::string>* records) {
  size_t off = 0;
  while (off < bytes.size()) {
    if (bytes.size() - off < 12) return ::testing::AssertionFailure() << "truncated header at " << off;
    const uint64_t len = load_le<uint64_t>(bytes, off);
    if (load_le<uint32_t>(bytes, off + 8) != ref_masked_crc(bytes.substr(off, 8)))
      return ::testing::AssertionFailure() << "length CRC mismatch at " << off;
    if (bytes.size() - off - 12 < len + 4) return ::testing::AssertionFailure() << "truncated record at " << off;
    std::string data = bytes.substr(off + 12, len);
    if (load_le<uint32_t>(bytes, off + 12 + len) != ref_masked_crc(data))
      return ::testing::AssertionFailure() << "data CRC mismatch at " << off;
    records->push_back(std::move(data));
    off += 12 + len + 4;
  }
  return ::testing::AssertionSuccess();
}

struct PbField {
  uint32_t number = 0, wire = 0;
  uint64_t varint = 0;  // wire 0; also the raw bits of wire 1 / 5
  std::string bytes;    // wire 2
};

// Decodes one message level; returns false on malformed input.
inline bool decode_pb(const std::string& s, std::vector<PbField>* out) {
  size_t i = 0;
  auto varint = [&](uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (i >= s.size()) return false;
      const uint8_t b = static_cast<uint8_t>(s[i++]);
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  };
  while (i < s.size()) {
    uint64_t key = 0;
    if (!varint(&key)) return false;
    PbField f;
    f.number = static_cast<uint32_t>(key >> 3);
    f.wire = static_cast<uint32_t>(key & 7);
    if (f.wire == 0) {
      if (!varint(&f.varint)) return false;
    } else if (f.wire == 1 || f.wire == 5) {
      const size_t n = f.wire == 1 ? 8 : 4;
      if (s.size() - i < n) return false;
      std::memcpy(&f.varint, s.data() + i, n);
      i += n;
    } else if (f.wire == 2) {
      uint64_t n = 0;
      if (!varint(&n) || s.size() - i < n) return false;
      f.bytes = s.substr(i, n);
      i += n;
    } else {
      return false;
    }
    out->push_back(std::move(f));
  }
  return true;
}

struct DecodedEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  bool has_summary = false, session_start = false;
  std::vector<std::pair<std::string, float>> scalars;
};

inline ::testing::AssertionResult decode_event(const std::string& data, DecodedEvent* e) {
  std::vector<PbField> fields;
  if (!decode_pb(data, &fields)) return ::testing::AssertionFailure() << "malformed Event";
  for (const PbField& f : fields) {
    if (f.number == 1 && f.wire == 1) std::memcpy(&e->wall_time, &f.varint, 8);
    else if (f.number == 2 && f.wire == 0) e->step = static_cast<int64_t>(f.varint);
    else if (f.number == 3 && f.wire == 2) e->file_version = f.bytes;
    else if (f.number == 5 && f.wire == 2) {
      e->has_summary = true;
      std::vector<PbField> values;
      if (!decode_pb(f.bytes, &values)) return ::testing::AssertionFailure() << "malformed Summary";
      for (const PbField& v : values) {
        if (v.number != 1 || v.wire != 2) return ::testing::AssertionFailure() << "unexpected Summary field";
        std::vector<PbField> vf;
        if (!decode_pb(v.bytes, &vf)) return ::testing::AssertionFailure() << "malformed Value";
        std::string tag;
        float value = 0;
        bool has_value = false;
        for (const PbField& x : vf) {
          if (x.number == 1 && x.wire == 2) tag = x.bytes;
          else if (x.number == 2 && x.wire == 5) {
            const uint32_t bits = static_cast<uint32_t>(x.varint);
            std::memcpy(&value, &bits, 4);
            has_value = true;
          } else return ::testing::AssertionFailure() << "unexpected Value field " << x.number;
        }
        if (!has_value) return ::testing::AssertionFailure() << "Value without simple_value";
        e->scalars.emplace_back(tag, value);
      }
    } else if (f.number == 7 && f.wire == 2) {
      std::vector<PbField> sl;
      if (!decode_pb(f.bytes, &sl)) return ::testing::AssertionFailure() << "malformed SessionLog";
      for (const PbField& x : sl)
        if (x.number == 1 && x.wire == 0 && x.varint == 1) e->session_start = true;
    } else {
      return ::testing::AssertionFailure() << "unexpected Event field " << f.number;
    }
  }
  return ::testing::AssertionSuccess();
}

// All events of one event file, in order.
inline ::testing::AssertionResult read_events(const std::string& path, std::vector<DecodedEvent>* events) {
  std::vector<std::string> records;
  auto r = read_tfrecords(slurp(path), &records);
  if (!r) return r;
  for (const std::string& rec : records) {
    DecodedEvent e;
    auto d = decode_event(rec, &e);
    if (!d) return d;
    events->push_back(std::move(e));
  }
  return ::testing::AssertionSuccess();
}

}  // namespace opd::test
