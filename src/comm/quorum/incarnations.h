// Internal: which process is each replica group's (gradsync/comm/quorum/coordinator.h, "one
// process per group"). A group's process started again while the old one still speaks (a copy
// its launcher did not stop) supersedes it: the incarnation heard last is the group's, the
// earlier ones never count again, so two copies cannot take the group's place in turns. Why
// the newest and not a lease held by the oldest: a replacement's first request is how the others
// learn at once that the old process is dead. Not thread-safe: the coordinator's lock guards it.
#pragma once

#include <string>
#include <vector>

namespace gradsync::comm {

class Incarnations {
 public:
  explicit Incarnations(int groups) : newest_(static_cast<std::size_t>(groups)), superseded_(newest_.size()) {}

  enum class Heard { current, superseding, superseded };
  // What a message of `incarnation` for `group` is: the group's current one; a new one, which
  // supersedes the one before (`fence` is then the line to publish under fence_key(group), which
  // the superseded client reads when it sees another incarnation's answer, and ends); or one
  // already superseded, to be ignored.
  Heard heard(int group, const std::string& incarnation, std::string& fence);

 private:
  std::vector<std::string> newest_;                   // per group: the incarnation heard last
  std::vector<std::vector<std::string>> superseded_;  // per group: the earlier ones (the last 16)
};

}  // namespace gradsync::comm
