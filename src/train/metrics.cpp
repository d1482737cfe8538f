// metrics.jsonl and TensorBoard event files of a training run (see metrics.h for the formats).
#include "train/metrics.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/file_write.h"
#include "core/error.h"
#include "core/text_io.h"
#include "core/log.h"
#include "train/checkpoint.h"  // fsync_path, remove_stale_temp_files

namespace opd {
namespace fs = std::filesystem;

// --- CRC-32C and protobuf wire encoding -----------------------------------------------------

namespace {

// Reflected CRC-32C table (polynomial 0x1EDC6F41, reversed 0x82F63B78), as TFRecord uses.
const std::array<uint32_t, 256>& crc32c_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_fixed(std::string& out, const void* p, size_t n) {  // little-endian host (x86, arm64)
  out.append(static_cast<const char*>(p), n);
}

void put_tag(std::string& out, uint32_t field, uint32_t wire_type) { put_varint(out, (field << 3) | wire_type); }

void put_bytes_field(std::string& out, uint32_t field, std::string_view bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out.append(bytes);
}

// Event fields shared by every event: wall_time (1, fixed64 double) and step (2, varint int64).
std::string event_header(double wall_time, int64_t step) {
  std::string e;
  put_tag(e, 1, 1);
  put_fixed(e, &wall_time, 8);
  if (step != 0) {  // proto3 default omitted, as protobuf itself does
    put_tag(e, 2, 0);
    put_varint(e, static_cast<uint64_t>(step));
  }
  return e;
}

double unix_now() {
  using namespace std::chrono;
  return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count() * 1e-6;
}

void write_all(int fd, const std::string& bytes, const std::string& path) {
  write_fully(fd, bytes.data(), bytes.size(), path);
}

std::string read_whole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  OPD_CHECK(in.good(), Io, "cannot open ", path, ": ", std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  OPD_CHECK(!in.bad(), Io, "read of ", path, " failed");
  return ss.str();
}

struct JsonlLine {
  std::string text;      // without the newline
  nlohmann::json value;  // discarded (null) when the line does not parse as an object
  bool ok = false;
};

// Splits metrics.jsonl into lines; only the last line may be torn (see MetricsLog::read).
std::vector<JsonlLine> read_lines(const std::string& path, int64_t* torn) {
  const std::string bytes = read_whole(path);
  std::vector<JsonlLine> lines;
  int64_t torn_count = 0;
  size_t pos = 0, lineno = 0;
  while (pos < bytes.size()) {
    size_t nl = bytes.find('\n', pos);
    const bool last = nl == std::string::npos;
    JsonlLine l;
    l.text = bytes.substr(pos, last ? std::string::npos : nl - pos);
    pos = last ? bytes.size() : nl + 1;
    ++lineno;
    if (l.text.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank
    l.value = json_nesting_depth(l.text) > kMaxJsonDepth
                  ? nlohmann::json(nlohmann::json::value_t::discarded)
                  : nlohmann::json::parse(l.text, nullptr, /*allow_exceptions=*/false);
    l.ok = l.value.is_object();
    if (!l.ok) {
      // A crash mid-write leaves a prefix of the last line; anything else is damage.
      OPD_CHECK(last || pos >= bytes.size(), InvalidData, path, ":", lineno,
                ": not a JSON object (metrics.jsonl is damaged): ", l.text.substr(0, 120));
      ++torn_count;
      continue;
    }
    lines.push_back(std::move(l));
  }
  if (torn) *torn = torn_count;
  return lines;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto& t = crc32c_table();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = t[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord_frame(std::string_view data) {
  std::string r;
  const uint64_t len = data.size();
  const uint32_t len_crc = masked_crc32c(&len, 8);
  const uint32_t data_crc = masked_crc32c(data.data(), data.size());
  r.reserve(data.size() + 16);
  put_fixed(r, &len, 8);
  put_fixed(r, &len_crc, 4);
  r.append(data);
  put_fixed(r, &data_crc, 4);
  return r;
}

std::string encode_file_version_event(double wall_time, std::string_view version) {
  std::string e = event_header(wall_time, 0);
  put_bytes_field(e, 3, version);
  return e;
}

std::string encode_scalars_event(double wall_time, int64_t step, const std::vector<ScalarValue>& values) {
  std::string summary;
  for (const ScalarValue& v : values) {
    std::string value;
    put_bytes_field(value, 1, v.tag);
    put_tag(value, 2, 5);
    put_fixed(value, &v.value, 4);
    put_bytes_field(summary, 1, value);
  }
  std::string e = event_header(wall_time, step);
  put_bytes_field(e, 5, summary);
  return e;
}

std::string encode_session_start_event(double wall_time, int64_t step) {
  std::string session_log;
  put_tag(session_log, 1, 0);
  put_varint(session_log, 1);  // SessionLog.START
  std::string e = event_header(wall_time, step);
  put_bytes_field(e, 7, session_log);
  return e;
}

// --- MetricsLog -----------------------------------------------------------------------------

MetricsLog::MetricsLog(const std::string& run_dir, bool tensorboard) : run_dir_(run_dir) {
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  OPD_CHECK(!ec, Io, "cannot create run directory ", run_dir, ": ", ec.message());
  jsonl_path_ = (fs::path(run_dir) / "metrics.jsonl").string();
  remove_stale_temp_files(jsonl_path_);  // a rewrite killed before its rename
  open_jsonl();
  if (!tensorboard) return;

  const fs::path tb_dir = fs::path(run_dir) / "tensorboard";
  fs::create_directories(tb_dir, ec);
  OPD_CHECK(!ec, Io, "cannot create ", tb_dir.string(), ": ", ec.message());
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') std::strcpy(host, "localhost");
  const std::string base = cat("events.out.tfevents.", static_cast<int64_t>(unix_now()), ".", host,
                               ".", ::getpid());
  // Two logs opened by one process within a second would share the name: add a suffix.
  for (int i = 0; event_fd_ < 0; ++i) {
    event_path_ = (tb_dir / (i == 0 ? base : cat(base, ".", i))).string();
    event_fd_ = ::open(event_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
    OPD_CHECK(event_fd_ >= 0 || (errno == EEXIST && i < 1000), Io, "cannot create ", event_path_,
              ": ", std::strerror(errno));
  }
  write_event(encode_file_version_event(unix_now(), "brain.Event:2"));
}

MetricsLog::~MetricsLog() {
  if (jsonl_fd_ >= 0) ::close(jsonl_fd_);
  if (event_fd_ >= 0) ::close(event_fd_);
}

void MetricsLog::open_jsonl() {
  if (jsonl_fd_ >= 0) ::close(jsonl_fd_);
  jsonl_fd_ = ::open(jsonl_path_.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  OPD_CHECK(jsonl_fd_ >= 0, Io, "cannot open ", jsonl_path_, ": ", std::strerror(errno));
  // A previous process that died mid-line left a tail without '\n'; appending to it would glue
  // the next record onto garbage. Cut the tail off (or end it when it is a complete object).
  // Only the tail is read (backwards to its last '\n'): the file grows with the run.
  struct stat st{};
  OPD_CHECK(::fstat(jsonl_fd_, &st) == 0, Io, "stat of ", jsonl_path_, " failed: ", std::strerror(errno));
  if (st.st_size == 0) return;
  char last = 0;
  OPD_CHECK(::pread(jsonl_fd_, &last, 1, st.st_size - 1) == 1, Io, "read of ", jsonl_path_, " failed");
  if (last == '\n') return;
  std::string tail;  // the bytes after the last '\n'
  off_t keep = 0;
  for (off_t end = st.st_size; end > 0;) {
    const off_t begin = std::max<off_t>(0, end - 65536);
    std::string chunk(static_cast<size_t>(end - begin), '\0');
    OPD_CHECK(::pread(jsonl_fd_, chunk.data(), chunk.size(), begin) == static_cast<ssize_t>(chunk.size()),
              Io, "read of ", jsonl_path_, " failed: ", std::strerror(errno));
    const size_t nl = chunk.rfind('\n');
    if (nl != std::string::npos) {
      keep = begin + static_cast<off_t>(nl) + 1;
      tail.insert(0, chunk, nl + 1);
      break;
    }
    tail.insert(0, chunk);
    end = begin;
  }
  if (json_nesting_depth(tail) <= kMaxJsonDepth &&
      nlohmann::json::parse(tail, nullptr, false).is_object()) {
    write_all(jsonl_fd_, "\n", jsonl_path_);
    return;
  }
  log_warn("metrics: dropping a torn last line of ", jsonl_path_, " (", tail.size(),
           " bytes, left by an interrupted run)");
  OPD_CHECK(::ftruncate(jsonl_fd_, keep) == 0, Io, "truncate of ", jsonl_path_,
            " failed: ", std::strerror(errno));
}

// The file behind fd was deleted (it, or the run directory, removed while the run goes on):
// writing on would lose every record without a word. A new file at `path` takes the next ones
// (a TensorBoard file starts with its version event again), with one warning.
void MetricsLog::reopen_deleted(int& fd, const std::string& path) {
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  const bool event = path == event_path_;
  const int nfd = ::open(path.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (nfd < 0) {
    log_warn("metrics: ", path, " was deleted during the run and cannot be created again (",
             std::strerror(errno), "); its records go nowhere until it can");
    return;
  }
  ::close(fd);
  fd = nfd;
  log_warn("metrics: ", path, " was deleted during the run (the file or its folder); the next "
           "records go to a new one (the earlier ones are gone)");
  if (!event) return;
  try {
    write_all(fd, tfrecord_frame(encode_file_version_event(unix_now(), "brain.Event:2")), path);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Io) throw;  // a full disk: the next append reports it
  }
}

void MetricsLog::write_event(const std::string& event_bytes) {
  if (event_fd_ < 0) return;
  append(event_fd_, tfrecord_frame(event_bytes), event_path_, event_lost_);
}

bool MetricsLog::append(int& fd, const std::string& bytes, const std::string& path, int64_t& lost) {
  struct stat st{};
  bool known = ::fstat(fd, &st) == 0;
  if (known && st.st_nlink == 0) {  // deleted under the run: a new file (and its size) first
    reopen_deleted(fd, path);
    known = ::fstat(fd, &st) == 0;
  }
  const off_t before = known ? st.st_size : -1;
  try {
    write_all(fd, bytes, path);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Io) throw;
    // A full disk takes part of a record: cut it off, or every later record would follow a torn
    // one (a torn line before the last makes the file unreadable; TensorBoard stops at a bad CRC).
    if (before >= 0 && ::ftruncate(fd, before) != 0)
      log_warn("metrics: could not cut a partial record off ", path, ": ", std::strerror(errno));
    if (lost++ == 0)
      log_warn("metrics: ", e.what(), "; training continues without these records until writing ",
               "works again");
    return false;
  }
  if (lost > 0) {
    log_warn("metrics: writing to ", path, " works again; ", lost, " record(s) were lost");
    lost = 0;
  }
  return true;
}

void MetricsLog::write(int64_t step, const nlohmann::json& record) {
  OPD_CHECK(record.is_object(), InvalidArgument, "metrics record must be a JSON object, got ",
            record.type_name());
  OPD_CHECK(!record.contains("step") && !record.contains("time"), InvalidArgument,
            "metrics record must not contain the reserved keys \"step\" or \"time\"");
  const double now = unix_now();
  // ordered_json keeps "step" and "time" first on the line, which makes the file readable.
  nlohmann::ordered_json line;
  line["step"] = step;
  line["time"] = now;
  std::vector<ScalarValue> scalars;
  for (const auto& [key, value] : record.items()) {
    line[key] = value;  // NaN/inf dump as null
    if (value.is_number()) scalars.push_back({key, static_cast<float>(value.get<double>())});
  }
  // replace: a key or string with invalid UTF-8 must not stop a training run.
  const std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::lock_guard<std::mutex> lock(mutex_);
  append(jsonl_fd_, text, jsonl_path_, jsonl_lost_);
  if (!scalars.empty()) write_event(encode_scalars_event(now, step, scalars));
}

namespace {

// One pass over metrics.jsonl, line by line (memory: one line): calls on_line(text, offset of
// the line, keep) for every non-blank line, keep = it is a JSON object whose "step" (when it has
// an integer one) is <= step. Only the last line may be torn (keep = false); a malformed line
// before it is InvalidData, as in read().
template <typename OnLine>
void scan_jsonl(const std::string& path, int64_t step, OnLine&& on_line) {
  std::ifstream in(path, std::ios::binary);
  OPD_CHECK(in.good(), Io, "cannot open ", path, ": ", std::strerror(errno));
  std::string text;
  int64_t lineno = 0;
  uint64_t offset = 0;
  while (std::getline(in, text)) {
    ++lineno;
    const uint64_t at = offset;
    offset += text.size() + (in.eof() ? 0 : 1);
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank
    const nlohmann::json value = json_nesting_depth(text) > kMaxJsonDepth
                                     ? nlohmann::json(nlohmann::json::value_t::discarded)
                                     : nlohmann::json::parse(text, nullptr, false);
    bool keep = value.is_object();
    if (!keep) {
      // A crash mid-write leaves a prefix of the last line; anything else is damage.
      OPD_CHECK(in.peek() == std::char_traits<char>::eof(), InvalidData, path, ":", lineno,
                ": not a JSON object (metrics.jsonl is damaged): ", text.substr(0, 120));
    } else {
      const auto it = value.find("step");
      keep = !(it != value.end() && it->is_number_integer() && it->get<int64_t>() > step);
    }
    on_line(text, at, keep);
  }
  OPD_CHECK(!in.bad(), Io, "read of ", path, " failed");
}

}  // namespace

void MetricsLog::truncate_after(int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Streamed, never held whole: metrics.jsonl grows with the run (~0.7 KB a step on the CPU),
  // and reading it into memory as text and parsed lines cost ~6x its size at every resume (a
  // 90 MB file: 785 MB peak RSS). Lines are in step order, so what a resume drops is the file's
  // tail: it is cut off in place (ftruncate: the old or the new length survives a crash).
  // Otherwise (a later line of an earlier step) the kept lines are copied into a temp file that
  // is renamed over the log, so a crash leaves the old or the new file, never half.
  int64_t dropped = 0;
  bool kept_after_drop = false;
  uint64_t first_drop = 0;
  scan_jsonl(jsonl_path_, step, [&](const std::string&, uint64_t at, bool keep) {
    if (!keep && dropped++ == 0) first_drop = at;
    if (keep && dropped > 0) kept_after_drop = true;
  });
  if (dropped > 0 && !kept_after_drop) {
    OPD_CHECK(::ftruncate(jsonl_fd_, static_cast<off_t>(first_drop)) == 0 && ::fsync(jsonl_fd_) == 0,
              Io, "truncate of ", jsonl_path_, " failed: ", std::strerror(errno));
  } else if (dropped > 0) {
    const std::string tmp = jsonl_path_ + ".tmp-" + std::to_string(::getpid());
    int out = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    OPD_CHECK(out >= 0, Io, "cannot create ", tmp, ": ", std::strerror(errno));
    try {
      std::string buf;
      scan_jsonl(jsonl_path_, step, [&](const std::string& text, uint64_t, bool keep) {
        if (!keep) return;
        buf += text;
        buf += '\n';
        if (buf.size() >= (1u << 20)) {
          write_all(out, buf, tmp);
          buf.clear();
        }
      });
      write_all(out, buf, tmp);
      OPD_CHECK(::fsync(out) == 0, Io, "fsync of ", tmp, " failed: ", std::strerror(errno));
      const int fd = out;
      out = -1;
      OPD_CHECK(::close(fd) == 0, Io, "close of ", tmp, " failed: ", std::strerror(errno));
      OPD_CHECK(::rename(tmp.c_str(), jsonl_path_.c_str()) == 0, Io, "rename ", tmp, " -> ",
                jsonl_path_, " failed: ", std::strerror(errno));
    } catch (...) {
      if (out >= 0) ::close(out);
      ::unlink(tmp.c_str());  // a full disk must not leave metrics.jsonl.tmp-PID behind
      throw;
    }
    fsync_path(run_dir_);
    open_jsonl();  // the old descriptor points at the replaced inode
  }
  write_event(encode_session_start_event(unix_now(), step + 1));
  if (dropped) log_info("metrics: resumed at step ", step, ", dropped ", dropped, " later lines of ", jsonl_path_);
}

std::vector<nlohmann::json> MetricsLog::read(const std::string& path, int64_t* torn_lines) {
  std::vector<nlohmann::json> out;
  for (JsonlLine& l : read_lines(path, torn_lines)) out.push_back(std::move(l.value));
  return out;
}

}  // namespace opd
