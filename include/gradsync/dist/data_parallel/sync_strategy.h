// gradsync/dist/data_parallel/sync_strategy.h - Composer's sync strategies over DataParallel: when, within an
// accumulation window of several microbatches, the gradients are synchronized.
//
//   for (int m = 0; m < microbatches; ++m) {
//     auto sync = dist::ddp_sync_context(ddp, m == microbatches - 1, strategy);
//     ... forward, backward (mark_ready ...), ddp.end_backward() ...
//   }                                   // the final window's guard closes: FORCED reduces now
//   optimizer.step();
//
// The strategies (docs/semantics/ddp.md, docs/data_parallel.md):
//  * SINGLE_AUTO_SYNC: microbatches before the final one run under no_sync; the final one
//    syncs during its backward (overlapped);
//  * MULTI_AUTO_SYNC: every microbatch syncs;
//  * FORCED_SYNC: every microbatch runs under no_sync; when the final one's guard closes, every
//    gradient is reduced (synchronize_all: bucketed, zero-filled where undefined, defined
//    versus undefined from the reduced bitmap, so it cannot hang when ranks differ in which
//    gradients exist, Composer #1086);
//  * AUTO (ours): the first windows try each of the three (two windows each), then the
//    fastest by the ranks' summed window times is kept for the rest of the run; the choice is
//    the same on every rank (it rides on a synchronized step's status) and is logged once.
// With shard_gradients (ZeRO stages 2 and 3) MULTI is FSDP's default accumulation: each
// microbatch is reduce-scattered and added to the sharded gradient (the reduced pieces are set
// aside before each backward: Reducer::set_aside_reduced_pieces); SINGLE and FORCED keep the
// full gradients until the last microbatch (FSDP's no_sync).
#pragma once

#include <optional>
#include <string>

#include "gradsync/dist/data_parallel/data_parallel.h"

namespace gradsync::dist {

// Composer's DDPSyncStrategy (above), and AUTO, which picks one per accumulation window.
enum class DDPSyncStrategy { single_auto_sync, multi_auto_sync, forced_sync, auto_select };
const char* sync_strategy_name(DDPSyncStrategy strategy);  // "single_auto_sync", ...
// "single_auto_sync" | "multi_auto_sync" | "forced_sync" | "auto"; anything else is an error listing them.
DDPSyncStrategy parse_sync_strategy(const std::string& text);
// Composer's trainer default: MULTI when find_unused_parameters, else SINGLE.
DDPSyncStrategy default_sync_strategy(bool find_unused_parameters);

// Composer's ddp_sync_context, as an RAII guard around one microbatch (its forward and backward).
// close() ends the context (and runs FORCED's synchronization, which can throw); the destructor
// calls it unless an exception is already unwinding (then nothing is communicated).
class DDPSyncContext {
 public:
  // Opens the context for one microbatch (the last of its window when is_final_microbatch).
  DDPSyncContext(DataParallel& ddp, bool is_final_microbatch, DDPSyncStrategy strategy);
  ~DDPSyncContext() noexcept(false);
  DDPSyncContext(const DDPSyncContext&) = delete;
  DDPSyncContext& operator=(const DDPSyncContext&) = delete;
  void close();  // (above)
  DDPSyncStrategy strategy() const { return strategy_; }  // AUTO: the one used for this window

 private:
  DataParallel& ddp_;
  bool final_;
  DDPSyncStrategy strategy_;
  bool auto_window_ = false;
  std::optional<DataParallel::NoSync> no_sync_;
  bool closed_ = false;
  int uncaught_ = 0;
};

// Composer's ddp_sync_context(state, is_final_microbatch, sync_strategy), as a guard.
[[nodiscard]] inline DDPSyncContext ddp_sync_context(DataParallel& ddp, bool is_final_microbatch,
                                                     DDPSyncStrategy strategy) {
  return DDPSyncContext(ddp, is_final_microbatch, strategy);
}

}  // namespace gradsync::dist
