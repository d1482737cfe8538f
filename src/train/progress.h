// Progress display of a training run: on a terminal one line redrawn in place
//   [#########...........]  120/1000  loss 0.412  jsd 0.0310  | 12.3k tok/s | ETA 1:23:45
// and otherwise (a log file, a pipe, nohup) a plain log line at most every `log_interval_s`
// seconds and at the last step. ETA = mean step time since `first_step` x steps left.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace opd {

using ProgressFields = std::vector<std::pair<std::string, std::string>>;

struct ProgressOptions {
  double log_interval_s = 10;  // non-interactive: seconds between log lines
  int bar_width = 20;          // characters inside [ ]
  int columns = 0;             // terminal width; 0 = ask the terminal (ioctl), else $COLUMNS, else 120
  std::string unit = "step";   // what is counted, first word of a log line ("samples" in opd eval)
  // Injection points for tests; defaults: steady_clock seconds, stderr, core/log.h log_info.
  std::function<double()> clock;
  std::function<void(const std::string&)> tty_write;
  std::function<void(const std::string&)> log_write;
};

class Progress {
 public:
  // `first_step`: the step the run starts from (0, or the checkpoint step on resume); steps
  // passed to update() count completed steps, so update(total_steps) is the last one.
  Progress(int64_t total_steps, int64_t first_step, bool interactive, ProgressOptions options = {});
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  static bool stderr_is_tty();

  void update(int64_t step, const ProgressFields& fields, double tokens_per_s);
  // Ends the redrawn line (newline) on a terminal; logs the last state if it was not logged.
  void finish();
  // On a terminal, erases the drawn line so that a log line written next (a checkpoint saved,
  // a warning) starts at column 0 instead of after the bar; the next update() redraws it.
  // Does nothing otherwise.
  void clear();

  // Pure formatting, exposed for tests.
  static std::string format_eta(double seconds);        // h:mm:ss; "-:--:--" when unknown
  static std::string format_rate(double per_second);    // 950, 12.3k, 4.56M
  static std::string render_bar(int64_t step, int64_t total, int width);
  // The line body (no \r): bar, step/total, fields, tok/s, ETA; cut to `columns` - 1 when > 0.
  static std::string render_line(int64_t step, int64_t total, const ProgressFields& fields,
                                 double tokens_per_s, double eta_s, int bar_width, int columns);
  static std::string render_log_line(int64_t step, int64_t total, const ProgressFields& fields,
                                     double tokens_per_s, double eta_s, double elapsed_s,
                                     const std::string& unit = "step");

 private:
  double eta_seconds(int64_t step, double now) const;

  int64_t total_, first_;
  bool interactive_;
  ProgressOptions opt_;
  double start_ = 0, last_log_ = 0;
  bool logged_any_ = false, drawn_ = false, finished_ = false;
  std::string last_log_line_;  // the newest state as a log line, for finish()
  bool last_state_logged_ = true;
};

}  // namespace opd
