// Who is alive (liveness.h).
#include "liveness.h"

namespace gradsync::comm {

void Liveness::beat(int group, int rank, const std::string& incarnation, Clock::time_point now) {
  groups_[static_cast<std::size_t>(group)][rank] = {incarnation, now};
}

bool Liveness::alive(int group, const std::string& incarnation, Clock::time_point now) const {
  const std::map<int, Beat>& ranks = groups_[static_cast<std::size_t>(group)];
  const auto leader = ranks.find(0);
  if (leader == ranks.end() || leader->second.incarnation != incarnation) return false;
  return why_silent(group, incarnation, now).empty();
}

std::string Liveness::why_silent(int group, const std::string& incarnation, Clock::time_point now) const {
  for (const auto& [rank, beat] : groups_[static_cast<std::size_t>(group)]) {
    if (beat.incarnation != incarnation || now - beat.seen < timeout_) continue;
    return "; group " + std::to_string(group) + ": " + (rank == 0 ? "its leader" : "rank " + std::to_string(rank)) +
           " is silent";
  }
  return {};
}

}  // namespace gradsync::comm
