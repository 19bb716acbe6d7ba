// gradsync/optim/grad_scaler.h - dynamic loss scaling with torch.amp.GradScaler's semantics.
//
// f16 has 5 exponent bits: gradients below 2^-24 flush to zero, and most gradients of a deep
// network live down there. Multiplying the loss by a large scale S moves every gradient up by
// S (the backward is linear in the loss), out of the flush-to-zero range; the optimizer then
// divides by S in f32 before it uses them. When S is too large some gradient overflows to inf:
// that step is skipped (parameters and optimizer state untouched) and S shrinks. After
// `growth_interval` clean steps in a row S grows again. bf16 has f32's exponent range and
// needs none of this (the scaler works with it, and says once that it is pointless).
//
//   optim::GradScaler scaler;                   // options as torch.amp.GradScaler's
//   engine.backward(loss_gradient * scaler.scale());
//   scaler.unscale(adam);                       // optional: before clipping
//   optim::clip_grad_norm(adam, 1.0);
//   scaler.step(adam);                          // adam.step() unless inf/NaN on any rank
//   scaler.update();                            // the next scale
//
// Nothing is rewritten in place: unscale() hands 1/S to the optimizer, which applies it inside
// its fused step (rounded as torch's in-place unscale_ rounds). The inf/NaN check reuses the
// pass clip_grad_norm already made over the gradients when there was one, else makes its own;
// with a communicator it then takes one 4-byte MAX allreduce, so every rank decides alike.
// The scale is an f32 number and grows and shrinks exactly as torch's _amp_update_scale_.
#pragma once

#include <cstdint>
#include <functional>
#include <map>

#include "gradsync/io/safetensors.h"
#include "gradsync/optim/optimizer.h"

namespace gradsync::comm {
class Communicator;
}

namespace gradsync::optim {

// torch.amp.GradScaler's arguments, under its names and defaults.
struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;   // the scale grows by this after growth_interval clean steps
  double backoff_factor = 0.5;  // and shrinks by this after a step with inf or NaN
  std::int64_t growth_interval = 2000;  // clean steps before it grows
  bool enabled = true;  // disabled: scale() is 1, step() just steps, update() does nothing
};

// Dynamic loss scaling for fp16 (torch.amp.GradScaler): the loss scaled up so small gradients
// survive f16, the optimizer handed 1/scale, a step skipped on every rank when any gradient
// overflowed, and the scale adjusted.
class GradScaler {
 public:
  // `communicator`: the ranks that must agree on skipping (null: this process alone, enough
  // when the gradients are already identical everywhere and nobody shards them).
  explicit GradScaler(GradScalerOptions options = {}, comm::Communicator* communicator = nullptr);

  const GradScalerOptions& options() const { return options_; }  // as given
  // The factor to multiply the loss (or the loss gradient) by; 1 when disabled.
  double scale() const;
  std::int64_t growth_tracker() const { return growth_tracker_; }  // clean steps since the last change

  // Hands 1/scale to the optimizer's next step. At most once per optimizer between updates.
  void unscale(Optimizer& optimizer);
  // Unscales if not done yet, checks the gradients for inf/NaN (on every rank), then runs
  // `step` (by default optimizer.step()) unless one was found. Returns whether it stepped.
  // With a DistributedOptimizer, reduce first and step without reducing again (Horovod's
  // pattern), so a skipped step leaves no reduction half done:
  //   distributed.synchronize();
  //   auto guard = distributed.skip_synchronize();
  //   scaler.step(inner, [&] { distributed.step(); });
  //   scaler.update();
  bool step(Optimizer& optimizer);
  bool step(Optimizer& optimizer, const std::function<void()>& step);  // `step` instead of optimizer.step()
  // The next scale: backoff after a skipped step, growth after growth_interval clean ones.
  // update(new_scale) sets it instead. Either starts the next iteration.
  void update();
  void update(double new_scale);  // (above)
  // Whether the last step() of this iteration found inf or NaN (false before any step()).
  bool found_inf() const;

  // Checkpoints: scale, growth tracker and options as metadata ("grad_scaler.*"), to store
  // next to the optimizer state; load_state() restores what state_metadata() wrote.
  io::Metadata state_metadata() const;
  void load_state(const io::Metadata& metadata);  // (above); an error naming a missing or bad entry

 private:
  enum class Stage { ready, unscaled, stepped };
  struct PerOptimizer {
    Stage stage = Stage::ready;
    bool found_inf = false;
  };
  PerOptimizer& track(Optimizer& optimizer);

  GradScalerOptions options_;
  comm::Communicator* communicator_;
  float scale_;  // as torch: an f32 tensor
  std::int64_t growth_tracker_ = 0;
  std::map<const Optimizer*, PerOptimizer> optimizers_;
  bool warned_bf16_ = false;
};

}  // namespace gradsync::optim
