// gradsync/optim/lr_schedule.h - learning-rate schedules: small, separate, composable.
//
// A schedule maps a step number t = 0, 1, 2, ... to a factor; an LRScheduler sets each
// group's lr to base_lr * factor(t), base_lr being the group's lr when the scheduler was made.
//
//   constant()                      1
//   step_decay(size, gamma)         gamma^floor(t / size)                  (torch StepLR)
//   cosine(total, min_factor)       min + (1 - min) (1 + cos(pi min(t,total)/total)) / 2
//                                                                          (torch CosineAnnealingLR)
//   linear_warmup(w, after)         (t + 1) / w for t < w, then after(t - w)
//
// Schedules compose: linear_warmup(100, cosine(900)) warms up over 100 steps and then decays
// over 900.
#pragma once

#include <cstdint>
#include <memory>

#include "gradsync/optim/optimizer.h"

namespace gradsync::optim {

// A schedule: step t -> the factor of the base learning rate (the table above).
class LRSchedule {
 public:
  virtual ~LRSchedule() = default;
  virtual double factor(std::int64_t step) const = 0;  // the factor at step t >= 0
};

using Schedule = std::shared_ptr<const LRSchedule>;  // schedules are shared, immutable values

Schedule constant();  // 1
Schedule step_decay(std::int64_t step_size, double gamma);  // torch StepLR (above)
Schedule cosine(std::int64_t total_steps, double min_factor = 0.0);  // torch CosineAnnealingLR (above)
Schedule linear_warmup(std::int64_t warmup_steps, Schedule after = constant());  // (above)

// Sets an optimizer's learning rates from a schedule, step by step (torch's LRScheduler).
class LRScheduler {
 public:
  // Remembers each group's current lr as its base and applies factor(0) at once.
  LRScheduler(Optimizer& optimizer, Schedule schedule);
  // Advances to the next step and sets the learning rates for it. Call after optimizer.step().
  void step();
  std::int64_t current_step() const { return step_; }  // the step whose rates are set now
  // Jump to a step (resuming from a checkpoint).
  void set_step(std::int64_t step);

 private:
  void apply();
  Optimizer& optimizer_;
  Schedule schedule_;
  std::vector<double> base_lrs_;
  std::int64_t step_ = 0;
};

}  // namespace gradsync::optim
