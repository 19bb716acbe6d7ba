// Internal: what every replica group of one job must share (gradsync/comm/quorum/coordinator.h,
// "the one that is wrong is refused alone"): as many ranks (place p talks to place p), and
// QuorumClientOptions::agreement (FaultTolerance: the samples a step consumes, the model's size).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace gradsync::comm {

struct GroupSettings {
  int ranks = 0;
  std::string agreement;
  bool operator==(const GroupSettings&) const = default;
  auto operator<=>(const GroupSettings&) const = default;
};

struct SettingsCheck {
  std::vector<int> agreeing;                      // the groups that may form the quorum
  std::vector<std::pair<int, std::string>> refused;  // the others, each with its error
  std::string everyone;  // non-empty: nobody can tell which side is right; every group ends with it
};

// The reference is what the job's groups hold: the voters' (the running quorum's members), else
// what more than half of `next` hold. A group that differs from it is refused alone, naming both
// settings; with no reference (no running quorum, no majority), `everyone` names the first
// difference.
SettingsCheck check_settings(const std::vector<int>& next, const std::vector<int>& voters,
                             const std::map<int, GroupSettings>& settings);

}  // namespace gradsync::comm
