// Internal: the coordinator's high-water mark (gradsync/comm/quorum/coordinator.h, "never
// backwards"): the highest step any quorum of the job reached, which groups held it last (and in
// which incarnation, to tell whether they still live), and its state file. It decides whether a
// quorum at a given step may form; the coordinator acts on the verdict. Not thread-safe: the
// coordinator's lock guards it.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace gradsync::comm {

class HighWaterMark {
 public:
  using Clock = std::chrono::steady_clock;
  // `state_file`: CoordinatorOptions::state_file ("" for none); `join_timeout`: how long groups
  // below the mark wait for one that holds it once none lives.
  HighWaterMark(std::string state_file, bool accept_lost_steps, std::chrono::milliseconds join_timeout);

  // Reads the state file when there is one: what to say about it ("" when nothing was read). An
  // error naming the file when it is not a coordinator's state file.
  std::string load();

  std::int64_t step() const { return step_; }

  // The verdict on a quorum of `next` at `step`: it forms (with `say` set when it goes below the
  // mark on purpose, accept_lost_steps), it waits (for a holder that lives, or for one to come
  // back within join_timeout), or the mark is lost (`why`, for every group asking). `alive(g,
  // incarnation)`: whether group g still lives in that incarnation.
  struct Verdict {
    enum Kind { form, wait, lost } kind = form;
    std::string say;  // a line for the coordinator's log, or ""
    std::string why;  // lost: the error every group asking ends with
  };
  template <typename Alive>
  Verdict check(const std::vector<int>& next, std::int64_t step, Clock::time_point now, Alive&& alive) {
    bool holder_alive = false;
    for (const auto& [group, incarnation] : holders_) holder_alive = holder_alive || alive(group, incarnation);
    return check(next, step, now, holder_alive);
  }

  // Who recovers from whom in a quorum at `step`: each member behind it (`steps`: member -> its
  // step) from a member that holds it, the newcomers dealt to the holders in turn.
  static std::map<int, int> recovery_sources(const std::map<int, std::int64_t>& steps, std::int64_t step);

  // A quorum of `members` (group -> incarnation) formed at `step`.
  void reached(std::int64_t step, const std::map<int, std::string>& members);

  // The state file's line when the mark changed and the last save is 100 ms old, else nothing:
  // the coordinator writes it (write()) outside its lock. again(): the write failed.
  std::optional<std::string> due(Clock::time_point now);
  void again() { unsaved_ = true; }
  static void write(const std::string& path, const std::string& line);
  const std::string& state_file() const { return state_file_; }

 private:
  Verdict check(const std::vector<int>& next, std::int64_t step, Clock::time_point now, bool holder_alive);

  std::string state_file_;
  bool accept_lost_steps_;
  std::chrono::milliseconds join_timeout_;
  std::int64_t step_ = 0;
  std::vector<int> groups_;                 // the groups of the last quorum at the mark
  std::map<int, std::string> holders_;      // and their incarnations
  Clock::time_point behind_since_{};        // a quorum below the mark has been waiting since
  bool unsaved_ = false;
  Clock::time_point saved_{};
};

}  // namespace gradsync::comm
