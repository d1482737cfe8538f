// Leveled stderr logging with wall-clock timestamps (see log.h).
#include "core/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <string_view>

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

}  // namespace

void set_log_level(LogLevel level) { g_level = static_cast<int>(level); }
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
}

}  // namespace opd
