// Generation progress for CLI commands (cli/generation_progress.h).
#include "cli/generation_progress.h"

#include <chrono>

namespace opd::cli {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

GenerationProgressDisplay::GenerationProgressDisplay(std::string label)
    : label_(std::move(label)), interactive_(Progress::stderr_is_tty()) {}

GenerationProgressDisplay::~GenerationProgressDisplay() { finish(); }

std::function<void(const GenerationProgress&)> GenerationProgressDisplay::callback() {
  return [this](const GenerationProgress& p) { update(p); };
}

void GenerationProgressDisplay::update(const GenerationProgress& p) {
  const double now = now_s();
  if (bar_ && p.steps < last_steps_) {  // a new generate() call (opd eval's agreement: the teacher)
    bar_->finish();
    bar_.reset();
    last_draw_ = -1;
  }
  last_steps_ = p.steps;
  if (!bar_) {
    ProgressOptions po;
    po.unit = "samples";
    bar_ = std::make_unique<Progress>(p.total_samples, 0, interactive_, po);
    start_ = now;
  }
  // A redraw per engine step would be thousands a second on a small model: at most 5 per
  // second on a terminal (the log path throttles itself to one line per 10 s), and the last.
  const bool last = p.finished_samples >= p.total_samples;
  if (interactive_ && !last && last_draw_ >= 0 && now - last_draw_ < 0.2) return;
  last_draw_ = now;
  const double elapsed = now - start_;
  bar_->update(p.finished_samples,
               {{label_, "finished"}, {"tokens", std::to_string(p.generated_tokens)}},
               elapsed > 0 ? static_cast<double>(p.generated_tokens) / elapsed : 0.0);
}

void GenerationProgressDisplay::finish() {
  if (bar_) bar_->finish();
}

}  // namespace opd::cli
