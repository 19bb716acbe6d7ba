// What every replica group of one job must share (settings.h).
#include "settings.h"

#include <optional>

#include "lines.h"

namespace gradsync::comm {

namespace {

std::string difference(int group, const GroupSettings& mine, const GroupSettings& theirs, const std::string& who,
                       bool plural) {
  const std::string self = "replica group " + std::to_string(group);
  if (mine.ranks != theirs.ranks) {
    return self + " has " + std::to_string(mine.ranks) + " ranks, " + who + (plural ? " have " : " has ") +
           std::to_string(theirs.ranks) + " (every replica group has as many ranks)";
  }
  return self + " says '" + mine.agreement + "', " + who + (plural ? " say '" : " says '") + theirs.agreement +
         "' (the groups of one job must agree)";
}

}  // namespace

SettingsCheck check_settings(const std::vector<int>& next, const std::vector<int>& voters,
                             const std::map<int, GroupSettings>& settings) {
  SettingsCheck check;
  if (next.empty()) return check;
  std::optional<GroupSettings> reference;
  if (!voters.empty()) {
    reference = settings.at(voters.front());
  } else {
    std::map<GroupSettings, int> held;
    for (const int group : next) ++held[settings.at(group)];
    for (const auto& [one, count] : held) {
      if (2 * count > static_cast<int>(next.size())) reference = one;
    }
  }
  if (!reference) {  // no running quorum and no majority: two groups differ, nobody can tell which is wrong
    const int first = next.front();
    for (const int group : next) {
      if (check.everyone.empty() && settings.at(group) != settings.at(first)) {
        check.everyone = difference(group, settings.at(group), settings.at(first), "group " + std::to_string(first), false);
      }
    }
    return check;
  }
  for (const int group : next) {
    if (settings.at(group) == *reference) check.agreeing.push_back(group);
  }
  for (const int group : next) {
    if (settings.at(group) == *reference) continue;
    check.refused.emplace_back(group, difference(group, settings.at(group), *reference,
                                                 "the job's groups " + quorum_lines::join_ints(check.agreeing),
                                                 check.agreeing.size() > 1) +
                                          ": this group is refused, the others go on");
  }
  return check;
}

}  // namespace gradsync::comm
