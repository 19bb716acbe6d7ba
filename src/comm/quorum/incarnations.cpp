// Which process is each replica group's (incarnations.h).
#include "incarnations.h"

#include <algorithm>

namespace gradsync::comm {

Incarnations::Heard Incarnations::heard(int group, const std::string& incarnation, std::string& fence) {
  std::vector<std::string>& old = superseded_[static_cast<std::size_t>(group)];
  if (std::find(old.begin(), old.end(), incarnation) != old.end()) return Heard::superseded;
  std::string& last = newest_[static_cast<std::size_t>(group)];
  if (last == incarnation) return Heard::current;
  const bool first = last.empty();
  if (!first) {
    old.push_back(last);
    if (old.size() > 16) old.erase(old.begin());
    std::string listed;
    for (const std::string& one : old) listed += (listed.empty() ? "" : ",") + one;
    fence = "newest=" + incarnation + " superseded=" + listed;
  }
  last = incarnation;
  return first ? Heard::current : Heard::superseding;
}

}  // namespace gradsync::comm
