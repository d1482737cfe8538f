// Leveled stderr logging with wall-clock timestamps (see log.h).
#include "core/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <filesystem>
#include <string_view>

#include <sys/stat.h>

namespace opd {
namespace {

LogLevel initial_level() {
  const char* env = std::getenv("OPD_LOG_LEVEL");
  if (!env) return LogLevel::Info;
  std::string_view s(env);
  if (s == "debug") return LogLevel::Debug;
  if (s == "warn") return LogLevel::Warn;
  if (s == "error") return LogLevel::Error;
  return LogLevel::Info;
}

std::atomic<int> g_level{static_cast<int>(initial_level())};
std::mutex g_mutex;
std::FILE* g_file = nullptr;  // guarded by g_mutex
std::string g_path;           // g_file's path, guarded by g_mutex

// The log file deleted under a running process (the file or the run directory removed): the lines
// would go nowhere. A new file at the same path takes them, beginning with a line that says so.
// Called with g_mutex held.
void reopen_if_deleted() {
  struct stat st{};
  if (!g_file || ::fstat(fileno(g_file), &st) != 0 || st.st_nlink != 0) return;
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(g_path).parent_path(), ec);
  std::FILE* f = std::fopen(g_path.c_str(), "a");
  if (!f) return;  // keeps writing to the deleted file; stderr has every line
  std::fclose(g_file);
  g_file = f;
  std::fprintf(g_file, "[opd] this log file was deleted while the process ran; the lines before "
                       "this one are gone\n");
}

}  // namespace

void set_log_level(LogLevel level) { g_level = static_cast<int>(level); }
void set_log_file(const std::string& path) {
  std::FILE* f = nullptr;
  if (!path.empty()) {
    f = std::fopen(path.c_str(), "a");
    OPD_CHECK(f != nullptr, Io, "cannot open log file ", path);
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_file) std::fclose(g_file);
  g_file = f;
  g_path = path;
}

LogLevel log_level() { return static_cast<LogLevel>(g_level.load()); }

void log_line(LogLevel level, const std::string& message) {
  using namespace std::chrono;
  auto now = system_clock::now();
  std::time_t t = system_clock::to_time_t(now);
  int ms = static_cast<int>(duration_cast<milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm{};
  localtime_r(&t, &tm);
  static constexpr char kTag[] = {'D', 'I', 'W', 'E'};
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(stderr, "[opd %02d:%02d:%02d.%03d %c] %s\n", tm.tm_hour, tm.tm_min, tm.tm_sec, ms,
               kTag[static_cast<int>(level)], message.c_str());
  std::fflush(stderr);
  reopen_if_deleted();
  if (g_file) {
    std::fprintf(g_file, "[opd %04d-%02d-%02d %02d:%02d:%02d.%03d %c] %s\n", tm.tm_year + 1900,
                 tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ms,
                 kTag[static_cast<int>(level)], message.c_str());
    std::fflush(g_file);
  }
}

}  // namespace opd
