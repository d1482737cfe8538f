// Training progress line (terminal) or periodic log lines (see progress.h).
#include "train/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "core/log.h"

namespace opd {
namespace {

int terminal_columns() {
  struct winsize ws{};
  if (::ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  if (const char* c = std::getenv("COLUMNS")) {
    const int v = std::atoi(c);
    if (v > 0) return v;
  }
  return 120;
}

std::string fields_text(const ProgressFields& fields) {
  std::string s;
  for (const auto& [name, value] : fields) s += cat("  ", name, " ", value);
  return s;
}

// Cut to at most n bytes without splitting a UTF-8 sequence.
std::string cut_utf8(const std::string& s, size_t n) {
  if (s.size() <= n) return s;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  return s.substr(0, n);
}

}  // namespace

bool Progress::stderr_is_tty() { return ::isatty(STDERR_FILENO) == 1; }

std::string Progress::format_eta(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "-:--:--";
  // Clamped before the conversion: llround of a huge double is undefined. 99999:59:59 at most.
  const int64_t s = std::llround(std::min(seconds, 359999999.0));
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  return buf;
}

std::string Progress::format_rate(double v) {
  if (!std::isfinite(v) || v < 0) return "-";
  char buf[32];
  if (v < 999.5) std::snprintf(buf, sizeof(buf), "%.0f", v);
  else if (v < 999.95e3) std::snprintf(buf, sizeof(buf), "%.1fk", v / 1e3);
  else if (v < 999.995e6) std::snprintf(buf, sizeof(buf), "%.2fM", v / 1e6);
  else std::snprintf(buf, sizeof(buf), "%.2fG", v / 1e9);
  return buf;
}

std::string Progress::render_bar(int64_t step, int64_t total, int width) {
  if (width <= 0 || total <= 0) return "";
  const double frac = std::clamp(static_cast<double>(step) / static_cast<double>(total), 0.0, 1.0);
  const int filled = static_cast<int>(frac * width);
  std::string bar(static_cast<size_t>(width) + 2, '.');  // built in place: GCC 12 warns
  bar.front() = '[';                                     // falsely on "lit" + string&&
  bar.back() = ']';
  std::fill_n(bar.begin() + 1, filled, '#');
  return bar;
}

std::string Progress::render_line(int64_t step, int64_t total, const ProgressFields& fields,
                                  double tokens_per_s, double eta_s, int bar_width, int columns) {
  std::string s;
  if (total > 0) {
    const std::string t = std::to_string(total);
    std::string st = std::to_string(step);
    if (st.size() < t.size()) st.insert(0, t.size() - st.size(), ' ');  // steady layout
    s = cat(render_bar(step, total, bar_width), bar_width > 0 ? " " : "", st, "/", t);
  } else {
    s = cat("step ", step);
  }
  s += fields_text(fields);
  if (std::isfinite(tokens_per_s) && tokens_per_s > 0) s += cat("  | ", format_rate(tokens_per_s), " tok/s");
  if (total > 0) s += cat("  | ETA ", format_eta(eta_s));
  return columns > 1 ? cut_utf8(s, static_cast<size_t>(columns - 1)) : s;
}

std::string Progress::render_log_line(int64_t step, int64_t total, const ProgressFields& fields,
                                      double tokens_per_s, double eta_s, double elapsed_s,
                                      const std::string& unit) {
  std::string s = cat(unit, " ", step);
  if (total > 0) {
    char pct[16];
    std::snprintf(pct, sizeof(pct), "%.1f", 100.0 * std::clamp(double(step) / double(total), 0.0, 1.0));
    s += cat("/", total, " (", pct, "%)");
  }
  s += fields_text(fields);
  if (std::isfinite(tokens_per_s) && tokens_per_s > 0) s += cat("  | ", format_rate(tokens_per_s), " tok/s");
  s += cat("  | elapsed ", format_eta(elapsed_s));
  if (total > 0) s += cat("  | ETA ", format_eta(eta_s));
  return s;
}

Progress::Progress(int64_t total_steps, int64_t first_step, bool interactive, ProgressOptions options)
    : total_(total_steps), first_(first_step), interactive_(interactive), opt_(std::move(options)) {
  OPD_CHECK(total_steps >= 0 && first_step >= 0, InvalidArgument, "progress: total_steps ",
            total_steps, " and first_step ", first_step, " must be >= 0");
  if (!opt_.clock)
    opt_.clock = [] {
      using namespace std::chrono;
      return duration<double>(steady_clock::now().time_since_epoch()).count();
    };
  if (!opt_.tty_write)
    opt_.tty_write = [](const std::string& s) {
      std::fputs(s.c_str(), stderr);
      std::fflush(stderr);
    };
  if (!opt_.log_write) opt_.log_write = [](const std::string& s) { log_info(s); };
  if (interactive_ && opt_.columns <= 0) opt_.columns = terminal_columns();
  start_ = opt_.clock();
}

Progress::~Progress() {
  try {
    finish();
  } catch (...) {
  }
}

double Progress::eta_seconds(int64_t step, double now) const {
  const int64_t done = step - first_;
  if (done <= 0 || total_ <= 0) return NAN;
  return (now - start_) / static_cast<double>(done) * static_cast<double>(std::max<int64_t>(0, total_ - step));
}

void Progress::update(int64_t step, const ProgressFields& fields, double tokens_per_s) {
  const double now = opt_.clock();
  const double eta = eta_seconds(step, now);
  if (interactive_) {
    // \r returns to column 0, \x1b[K clears what a longer previous line left.
    std::string line = "\r";
    line += render_line(step, total_, fields, tokens_per_s, eta, opt_.bar_width, opt_.columns);
    line += "\x1b[K";
    opt_.tty_write(line);
    drawn_ = true;
    return;
  }
  last_log_line_ = render_log_line(step, total_, fields, tokens_per_s, eta, now - start_, opt_.unit);
  const bool is_last = total_ > 0 && step >= total_;
  if (!logged_any_ || is_last || now - last_log_ >= opt_.log_interval_s) {
    opt_.log_write(last_log_line_);
    logged_any_ = true;
    last_log_ = now;
    last_state_logged_ = true;
  } else {
    last_state_logged_ = false;
  }
}

void Progress::clear() {
  if (interactive_ && drawn_ && !finished_) {
    opt_.tty_write("\r\x1b[K");
    drawn_ = false;
  }
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  if (interactive_) {
    if (drawn_) opt_.tty_write("\n");
  } else if (!last_state_logged_ && !last_log_line_.empty()) {
    opt_.log_write(last_log_line_);
  }
}

}  // namespace opd
