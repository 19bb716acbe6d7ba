// Composer's sync strategies and AUTO (gradsync/dist/data_parallel/sync_strategy.h, sync_state.h).
#include "gradsync/dist/data_parallel/sync_strategy.h"

#include <cstdio>

#include "sync_state.h"

namespace gradsync::dist {

namespace {
// AUTO's trials: one warm-up window, then each candidate for kTrialWindows windows.
constexpr std::array<DDPSyncStrategy, 3> kCandidates{DDPSyncStrategy::single_auto_sync, DDPSyncStrategy::multi_auto_sync,
                                                     DDPSyncStrategy::forced_sync};
constexpr int kTrialWindows = 2;
constexpr int kLastTrialWindow = kTrialWindows * static_cast<int>(kCandidates.size());

bool trial_window(int window) { return window > 0 && window <= kLastTrialWindow; }
std::size_t candidate_of(int window) { return static_cast<std::size_t>((window - 1) / kTrialWindows); }
}  // namespace

const char* sync_strategy_name(DDPSyncStrategy strategy) {
  switch (strategy) {
    case DDPSyncStrategy::single_auto_sync: return "single_auto_sync";
    case DDPSyncStrategy::multi_auto_sync: return "multi_auto_sync";
    case DDPSyncStrategy::forced_sync: return "forced_sync";
    case DDPSyncStrategy::auto_select: return "auto";
  }
  return "?";
}

DDPSyncStrategy parse_sync_strategy(const std::string& text) {
  for (const DDPSyncStrategy strategy : {DDPSyncStrategy::single_auto_sync, DDPSyncStrategy::multi_auto_sync,
                                         DDPSyncStrategy::forced_sync, DDPSyncStrategy::auto_select}) {
    if (text == sync_strategy_name(strategy)) return strategy;
  }
  detail::throw_error("'", text, "' is not a valid DDPSyncStrategy: expected one of single_auto_sync, multi_auto_sync, ",
                      "forced_sync, auto");
}

DDPSyncStrategy default_sync_strategy(bool find_unused_parameters) {
  return find_unused_parameters ? DDPSyncStrategy::multi_auto_sync : DDPSyncStrategy::single_auto_sync;
}

// ---- SyncState -------------------------------------------------------------------------------

DDPSyncStrategy SyncState::auto_strategy() {
  if (chosen_) return *chosen_;
  if (!active_) {
    active_ = true;
    start_ = Clock::now();
    current_ = trial_window(window_) ? kCandidates[candidate_of(window_)] : DDPSyncStrategy::single_auto_sync;
  }
  return current_;
}

void SyncState::close_auto_window(bool final) {
  if (!final) return;
  const double seconds = std::chrono::duration<double>(Clock::now() - start_).count();
  if (trial_window(window_)) seconds_[candidate_of(window_)] += seconds;
  active_ = false;
  ++window_;
  if (window_ == kLastTrialWindow + 1) decision_due_ = true;
}

void SyncState::write(StepStatus& status, bool shadow_step) const {
  if (!shadow_step && step_carries_) status.set_carried();
  if (decision_due_) status.propose_auto(seconds_);
}

void SyncState::read(const StepStatus& status, int rank) {
  last_step_carried_ = status.carried();
  const std::optional<std::array<double, 3>> summed = status.auto_times();
  if (!summed) return;
  // Every rank decides from the same summed times: the same choice.
  decision_due_ = false;
  std::size_t best = 0;
  for (std::size_t k = 1; k < kCandidates.size(); ++k) {
    if ((*summed)[k] < (*summed)[best]) best = k;
  }
  chosen_ = kCandidates[best];
  if (rank == 0) {
    std::fprintf(stderr,
                 "gradsync: DDPSyncStrategy auto chose %s (mean window ms over %d windows each, summed over ranks: "
                 "single %.2f, multi %.2f, forced %.2f)\n",
                 sync_strategy_name(*chosen_), kTrialWindows, (*summed)[0] * 1e3 / kTrialWindows,
                 (*summed)[1] * 1e3 / kTrialWindows, (*summed)[2] * 1e3 / kTrialWindows);
  }
}

void SyncState::restart_trials_unless_decided() {
  if (chosen_) return;
  const bool carries = step_carries_;
  const bool carried = last_step_carried_;
  *this = SyncState{};
  step_carries_ = carries;
  last_step_carried_ = carried;
}

// ---- DDPSyncContext ----------------------------------------------------------------------------

DDPSyncContext::DDPSyncContext(DataParallel& ddp, bool is_final_microbatch, DDPSyncStrategy strategy)
    : ddp_(ddp), final_(is_final_microbatch), strategy_(strategy), uncaught_(std::uncaught_exceptions()) {
  SyncState& state = ddp_.sync_state();
  if (strategy_ == DDPSyncStrategy::auto_select) {
    auto_window_ = !state.decided();
    strategy_ = state.auto_strategy();
  }
  const bool unsynced = (strategy_ == DDPSyncStrategy::single_auto_sync && !final_) ||
                        strategy_ == DDPSyncStrategy::forced_sync;
  if (unsynced) no_sync_.emplace(ddp_);
  state.set_step_carries(strategy_ == DDPSyncStrategy::multi_auto_sync && !final_);
}

void DDPSyncContext::close() {
  if (closed_) return;
  closed_ = true;
  no_sync_.reset();
  SyncState& state = ddp_.sync_state();
  state.set_step_carries(false);
  if (!final_) return;
  if (strategy_ == DDPSyncStrategy::forced_sync) {
    try {
      ddp_.synchronize_all();
    } catch (...) {
      if (auto_window_) state.close_auto_window(/*final=*/true);
      throw;
    }
  }
  if (auto_window_) state.close_auto_window(/*final=*/true);
}

DDPSyncContext::~DDPSyncContext() noexcept(false) {
  if (std::uncaught_exceptions() > uncaught_) {
    closed_ = true;  // unwinding: restore no_sync, communicate nothing, but count the window
    no_sync_.reset();
    ddp_.sync_state().set_step_carries(false);
    if (auto_window_) ddp_.sync_state().close_auto_window(final_);
    return;
  }
  close();
}

}  // namespace gradsync::dist
