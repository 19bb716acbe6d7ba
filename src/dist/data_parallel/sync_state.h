// Internal: the state Composer's sync strategies keep per DataParallel (sync_strategy.h), and
// its two sides: DDPSyncContext opens and closes windows; DataParallel writes the state into
// each synchronized step's status and reads the summed status back (dist/reducer/step_status.h).
//
// AUTO's schedule: window 0 warms up, windows 1-6 try SINGLE, SINGLE, MULTI, MULTI, FORCED,
// FORCED (each timed from its first microbatch's guard to its final one's close); later windows
// run SINGLE until the decision, which rides on the next synchronized step's status: every rank
// proposes its three summed times, the sums decide, so every rank (a joined one shadowing that
// step included) picks the same strategy.
#pragma once

#include <array>
#include <chrono>
#include <optional>

#include "gradsync/dist/data_parallel/sync_strategy.h"
#include "dist/reducer/step_status.h"

namespace gradsync::dist {

class SyncState {
 public:
  // --- DDPSyncContext's side.
  // AUTO's strategy for the window this microbatch belongs to, opening the window (and its
  // clock) at its first microbatch; the chosen one once AUTO has decided.
  DDPSyncStrategy auto_strategy();
  bool decided() const { return chosen_.has_value(); }
  // A window's final guard closed (with or without an exception): local bookkeeping only, so
  // that every rank counts the same windows whatever it threw and caught inside one.
  void close_auto_window(bool final);
  bool auto_window_open() const { return active_; }
  // This synchronized step's average stays in place for the next synchronized step of the same
  // window (MULTI before the final microbatch): a joined rank then contributes it again instead
  // of zeros, so the part already averaged is not shrunk by the joined ranks (docs/join.md).
  void set_step_carries(bool carries) { step_carries_ = carries; }

  // --- DataParallel's side, around each synchronized step's status.
  void write(StepStatus& status, bool shadow_step) const;
  // Rank 0 logs AUTO's choice.
  void read(const StepStatus& status, int rank);
  bool last_step_carried() const { return last_step_carried_; }
  // A join cut AUTO's trials short on some ranks: start them again, everywhere alike.
  void restart_trials_unless_decided();

 private:
  using Clock = std::chrono::steady_clock;
  int window_ = 0;
  bool active_ = false;
  DDPSyncStrategy current_ = DDPSyncStrategy::single_auto_sync;
  Clock::time_point start_;
  std::array<double, 3> seconds_{};
  bool decision_due_ = false;  // the trial windows are over: send the times with the next status
  std::optional<DDPSyncStrategy> chosen_;
  bool step_carries_ = false;
  bool last_step_carried_ = false;  // as the last status said
};

}  // namespace gradsync::dist
