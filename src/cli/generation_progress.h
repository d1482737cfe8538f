// Progress of a long generation in a CLI command (`opd generate`, `opd eval`): the rollout
// engine's per-step report (EngineOptions::on_progress) shown with train/progress.h's display:
// on a terminal a bar redrawn in place (finished samples / all, generated tok/s, ETA), otherwise
// a log line when it starts, every 10 s, and at the end.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "rollout/engine.h"
#include "train/progress.h"

namespace opd::cli {

class GenerationProgressDisplay {
 public:
  // `label` names the phase in every line ("exact-match", "agreement: teacher").
  explicit GenerationProgressDisplay(std::string label);
  ~GenerationProgressDisplay();
  GenerationProgressDisplay(const GenerationProgressDisplay&) = delete;
  GenerationProgressDisplay& operator=(const GenerationProgressDisplay&) = delete;

  // For EngineOptions::on_progress (and the eval options that pass it on). Valid while this
  // object lives. A report whose step count went down starts a new display (the next
  // generate() call).
  std::function<void(const GenerationProgress&)> callback();
  // Ends the display (a newline on a terminal; the last state logged otherwise).
  void finish();

 private:
  void update(const GenerationProgress& p);

  std::string label_;
  std::unique_ptr<Progress> bar_;
  double start_ = 0, last_draw_ = -1;
  int64_t last_steps_ = 0;
  bool interactive_ = false;
};

}  // namespace opd::cli
