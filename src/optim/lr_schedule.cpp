#include "gradsync/optim/lr_schedule.h"

#include <cmath>
#include <numbers>

namespace gradsync::optim {

namespace {

class Constant final : public LRSchedule {
 public:
  double factor(std::int64_t) const override { return 1.0; }
};

class StepDecay final : public LRSchedule {
 public:
  StepDecay(std::int64_t step_size, double gamma) : step_size_(step_size), gamma_(gamma) {}
  double factor(std::int64_t step) const override {
    return std::pow(gamma_, static_cast<double>(step / step_size_));
  }

 private:
  std::int64_t step_size_;
  double gamma_;
};

class Cosine final : public LRSchedule {
 public:
  Cosine(std::int64_t total, double min_factor) : total_(total), min_(min_factor) {}
  double factor(std::int64_t step) const override {
    const double progress = static_cast<double>(std::min(step, total_)) / static_cast<double>(total_);
    return min_ + (1.0 - min_) * (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
  }

 private:
  std::int64_t total_;
  double min_;
};

class LinearWarmup final : public LRSchedule {
 public:
  LinearWarmup(std::int64_t warmup, Schedule after) : warmup_(warmup), after_(std::move(after)) {}
  double factor(std::int64_t step) const override {
    if (step < warmup_) return static_cast<double>(step + 1) / static_cast<double>(warmup_);
    return after_->factor(step - warmup_);
  }

 private:
  std::int64_t warmup_;
  Schedule after_;
};

}  // namespace

Schedule constant() { return std::make_shared<Constant>(); }

Schedule step_decay(std::int64_t step_size, double gamma) {
  GRADSYNC_CHECK(step_size > 0, "step_decay: step_size must be positive, got ", step_size);
  GRADSYNC_CHECK(gamma >= 0.0, "step_decay: gamma must be non-negative, got ", gamma);
  return std::make_shared<StepDecay>(step_size, gamma);
}

Schedule cosine(std::int64_t total_steps, double min_factor) {
  GRADSYNC_CHECK(total_steps > 0, "cosine: total_steps must be positive, got ", total_steps);
  GRADSYNC_CHECK(min_factor >= 0.0 && min_factor <= 1.0, "cosine: min_factor must be in [0, 1], got ", min_factor);
  return std::make_shared<Cosine>(total_steps, min_factor);
}

Schedule linear_warmup(std::int64_t warmup_steps, Schedule after) {
  GRADSYNC_CHECK(warmup_steps > 0, "linear_warmup: warmup_steps must be positive, got ", warmup_steps);
  GRADSYNC_CHECK(after != nullptr, "linear_warmup: the schedule after warmup is null");
  return std::make_shared<LinearWarmup>(warmup_steps, std::move(after));
}

LRScheduler::LRScheduler(Optimizer& optimizer, Schedule schedule)
    : optimizer_(optimizer), schedule_(std::move(schedule)) {
  GRADSYNC_CHECK(schedule_ != nullptr, "LRScheduler: null schedule");
  for (std::size_t group = 0; group < optimizer_.group_count(); ++group) base_lrs_.push_back(optimizer_.lr(group));
  apply();
}

void LRScheduler::step() {
  ++step_;
  apply();
}

void LRScheduler::set_step(std::int64_t step) {
  GRADSYNC_CHECK(step >= 0, "LRScheduler: negative step ", step);
  step_ = step;
  apply();
}

void LRScheduler::apply() {
  const double factor = schedule_->factor(step_);
  for (std::size_t group = 0; group < base_lrs_.size(); ++group) optimizer_.set_lr(group, base_lrs_[group] * factor);
}

}  // namespace gradsync::optim
