// Minimal leveled logging to stderr (and optionally a file): "[opd 12:34:56.789 I] message". Level from OPD_LOG_LEVEL
// (debug|info|warn|error, default info) or set_log_level(). Thread-safe line writes.
#pragma once

#include <string>

#include "core/error.h"

namespace opd {

enum class LogLevel { Debug = 0, Info = 1, Warn = 2, Error = 3 };

void set_log_level(LogLevel level);
LogLevel log_level();
void log_line(LogLevel level, const std::string& message);
// Also append every line to `path` (created if needed; "" stops). A training run logs to
// RUN/train.log this way, so its log survives a closed terminal (SIGHUP). Throws Io.
void set_log_file(const std::string& path);

template <typename... Args> void log_debug(const Args&... a) {
  if (log_level() <= LogLevel::Debug) log_line(LogLevel::Debug, cat(a...));
}
template <typename... Args> void log_info(const Args&... a) {
  if (log_level() <= LogLevel::Info) log_line(LogLevel::Info, cat(a...));
}
template <typename... Args> void log_warn(const Args&... a) {
  if (log_level() <= LogLevel::Warn) log_line(LogLevel::Warn, cat(a...));
}
template <typename... Args> void log_error(const Args&... a) { log_line(LogLevel::Error, cat(a...)); }

}  // namespace opd
