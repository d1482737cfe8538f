// LR schedules (formulas in schedule.h).
#include "train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace opd {

LrScheduleKind parse_lr_schedule(const std::string& name) {
  if (name == "constant") return LrScheduleKind::Constant;
  if (name == "linear") return LrScheduleKind::Linear;
  if (name == "cosine") return LrScheduleKind::Cosine;
  OPD_FAIL(InvalidArgument, "unknown learning-rate schedule '", name,
           "' (expected constant, linear or cosine)");
}

double LrSchedule::lr_at(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps)
    return base_lr * static_cast<double>(step) / static_cast<double>(warmup_steps);
  if (kind == LrScheduleKind::Constant) return base_lr;
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
  const double progress = std::clamp(static_cast<double>(step - warmup_steps) / span, 0.0, 1.0);
  double factor = kind == LrScheduleKind::Linear
                      ? 1.0 - progress
                      : 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return base_lr * std::max(factor, min_lr_ratio);
}

}  // namespace opd
