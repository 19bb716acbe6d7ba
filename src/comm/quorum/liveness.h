// Internal: who is alive (gradsync/comm/quorum/coordinator.h). Every rank of a group beats: the
// leader under heartbeat_key(group), each other rank under rank_heartbeat_key(group, rank), all
// with the incarnation of the group's leader. A group is alive while its leader's beat is fresh
// and every rank that has beaten for that incarnation still does. Why every rank and not the
// leader alone: a rank stopped or cut off while its leader runs leaves the leader waiting on it
// inside the group, beating and never voting, and the other groups waiting on it across: only
// its own silence says that in a heartbeat. A rank that has not beaten yet for the incarnation
// (still starting) is not counted against it. Not thread-safe: the coordinator's lock guards it.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace gradsync::comm {

class Liveness {
 public:
  using Clock = std::chrono::steady_clock;
  Liveness(int groups, std::chrono::milliseconds timeout) : timeout_(timeout), groups_(static_cast<std::size_t>(groups)) {}

  // A beat of `rank` of `group` (0: the leader, whose requests count as beats too).
  void beat(int group, int rank, const std::string& incarnation, Clock::time_point now);
  // Whether the group's leader of `incarnation` and every rank that beat for it are fresh.
  bool alive(int group, const std::string& incarnation, Clock::time_point now) const;
  // Why the group of `incarnation` is not alive, for the log: "; group 2: rank 1 is silent" ("" when
  // it is alive, or its leader never beat for it).
  std::string why_silent(int group, const std::string& incarnation, Clock::time_point now) const;

 private:
  struct Beat {
    std::string incarnation;
    Clock::time_point seen{};
  };
  std::chrono::milliseconds timeout_;
  std::vector<std::map<int, Beat>> groups_;  // per group: rank -> its last beat
};

}  // namespace gradsync::comm
