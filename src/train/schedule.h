// Learning-rate schedules with linear warmup, as transformers' get_scheduler defines them:
//   warmup (step < W):   lr = base * step / W
//   constant:            lr = base
//   linear:              lr = base * max(0, (S - step) / (S - W))
//   cosine:              lr = base * max(0, 0.5 * (1 + cos(pi * (step - W) / (S - W))))
// optionally floored at min_lr_ratio * base (linear/cosine). `step` counts optimizer steps
// already taken (the LR used for the update that makes step+1), S = total steps.
#pragma once

#include <cstdint>
#include <string>

namespace opd {

enum class LrScheduleKind { Constant, Linear, Cosine };
LrScheduleKind parse_lr_schedule(const std::string& name);  // "constant" | "linear" | "cosine"

struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::Constant;
  double base_lr = 1e-5;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_lr_ratio = 0.0;
  double lr_at(int64_t step) const;
};

}  // namespace opd
