// The values parameterised tests run over, and the names their instances carry, so that a
// failing case has a name of its own and runs alone: --gtest_filter='*/3_ranks_forced_sync_adam*'.
// (gtest names allow letters, digits and underscores only.)
#pragma once

#include <string>
#include <vector>

#include "gradsync/dist/data_parallel/sync_strategy.h"

namespace gradsync::testing {

// Composer's three strategies, and AUTO with them.
inline const std::vector<dist::DDPSyncStrategy>& explicit_strategies() {
  static const std::vector<dist::DDPSyncStrategy> strategies{
      dist::DDPSyncStrategy::single_auto_sync, dist::DDPSyncStrategy::multi_auto_sync, dist::DDPSyncStrategy::forced_sync};
  return strategies;
}
inline const std::vector<dist::DDPSyncStrategy>& every_strategy() {
  static const std::vector<dist::DDPSyncStrategy> strategies{
      dist::DDPSyncStrategy::single_auto_sync, dist::DDPSyncStrategy::multi_auto_sync, dist::DDPSyncStrategy::forced_sync,
      dist::DDPSyncStrategy::auto_select};
  return strategies;
}

inline std::string ranks_name(int world) { return std::to_string(world) + "_ranks"; }
inline std::string strategy_name(dist::DDPSyncStrategy strategy) { return dist::sync_strategy_name(strategy); }

// Joins name parts with underscores: name("3_ranks", "adam", "unused").
template <typename... Parts>
std::string name(const Parts&... parts) {
  std::string joined;
  ((joined += (joined.empty() ? "" : "_") + std::string(parts)), ...);
  return joined;
}

}  // namespace gradsync::testing
