// The coordinator's high-water mark (high_water.h).
#include "high_water.h"

#include <filesystem>
#include <fstream>

#include "gradsync/core/error.h"
#include "io/atomic_file.h"
#include "lines.h"

namespace gradsync::comm {

using namespace quorum_lines;

HighWaterMark::HighWaterMark(std::string state_file, bool accept_lost_steps, std::chrono::milliseconds join_timeout)
    : state_file_(std::move(state_file)), accept_lost_steps_(accept_lost_steps), join_timeout_(join_timeout) {}

std::string HighWaterMark::load() {
  std::error_code error;
  const auto status = std::filesystem::symlink_status(state_file_, error);
  if (state_file_.empty() || status.type() == std::filesystem::file_type::not_found) return {};
  // Only a regular file, and only its first 256 bytes: a FIFO would block the coordinator's start,
  // a link could point anywhere, and a huge file would be read whole.
  GRADSYNC_CHECK(status.type() == std::filesystem::file_type::regular, "Coordinator: its state file ", state_file_,
                 " is not a regular file (a link, a folder, a FIFO or a device): refused");
  std::ifstream in(state_file_);
  std::string line(256, '\0');
  in.read(line.data(), static_cast<std::streamsize>(line.size()));
  GRADSYNC_CHECK(in.gcount() > 0, "Coordinator: cannot read its state file ", state_file_);
  line.resize(static_cast<std::size_t>(in.gcount()));
  line = line.substr(0, line.find('\n'));
  const Fields fields = parse_fields(line);
  const std::int64_t mark = field_int(fields, "high_water");
  GRADSYNC_CHECK(mark >= 0, "Coordinator: ", state_file_, " is not a coordinator's state file (no high_water=N on its ",
                 "first line; it holds '", line.substr(0, 80), "')");
  step_ = mark;
  try {
    groups_ = split_ints(fields.count("groups") ? fields.at("groups") : "");
  } catch (const std::exception&) {
    groups_.clear();
  }
  return "the high-water mark from " + state_file_ + ": step " + std::to_string(mark) + " (groups " + join_ints(groups_) +
         ")";
}

// Never backwards: a quorum below the mark would throw committed steps away (its members would
// train them again while the state that holds them is gone or elsewhere). While a group that held
// the mark lives (hung in a rendezvous, slow), it is waited for: it comes back as a newcomer that
// holds the mark. Once none does, the groups asking get join_timeout for one to return; then the
// mark is lost, or with accept_lost_steps (the groups restarted from a checkpoint, on purpose) it
// goes down to the quorum's step. Even then a holder that lives is waited for first: a group that
// restarted from a checkpoint while another still held later steps recovers from that one.
HighWaterMark::Verdict HighWaterMark::check(const std::vector<int>& next, std::int64_t step, Clock::time_point now,
                                            bool holder_alive) {
  Verdict verdict;
  if (step >= step_) {
    behind_since_ = Clock::time_point{};
    return verdict;
  }
  if (behind_since_ == Clock::time_point{}) {
    verdict.say = "groups " + join_ints(next) + " hold at most step " + std::to_string(step) + ", below the high-water mark " +
                  std::to_string(step_) + " (last held by groups " + join_ints(groups_) +
                  "): no quorum forms below it; waiting for a group that holds it";
  }
  if (behind_since_ == Clock::time_point{} || holder_alive) behind_since_ = now;
  verdict.kind = Verdict::wait;
  if (now - behind_since_ < join_timeout_) return verdict;
  behind_since_ = Clock::time_point{};
  if (accept_lost_steps_) {
    verdict.kind = Verdict::form;
    verdict.say = "groups " + join_ints(next) + " go on from step " + std::to_string(step) + ", below the high-water mark " +
                  std::to_string(step_) + ": no group holding it came back within " +
                  std::to_string(join_timeout_.count()) + " ms (accept_lost_steps: a restart from a checkpoint)";
    step_ = step;
    groups_.clear();
    holders_.clear();
    unsaved_ = true;
    return verdict;
  }
  verdict.kind = Verdict::lost;
  verdict.why = "step " + std::to_string(step_) + " is lost: it is the highest step this job's quorums reached (last held by " +
                "groups " + join_ints(groups_) + ", all gone), and " + std::to_string(join_timeout_.count()) +
                " ms later the groups asking (" + join_ints(next) + ") hold at most step " + std::to_string(step) +
                "; a quorum of them would go back " + std::to_string(step_ - step) +
                " steps, so none is formed (to go on from a checkpoint on purpose: the coordinator's --accept-lost-steps)";
  return verdict;
}

void HighWaterMark::reached(std::int64_t step, const std::map<int, std::string>& members) {
  if (step > step_) unsaved_ = true;
  if (step < step_) return;
  step_ = step;
  groups_.clear();
  for (const auto& [group, incarnation] : members) groups_.push_back(group);
  holders_ = members;
}

std::optional<std::string> HighWaterMark::due(Clock::time_point now) {
  if (state_file_.empty() || !unsaved_ || now - saved_ < std::chrono::milliseconds(100)) return std::nullopt;
  unsaved_ = false;
  saved_ = now;
  return "high_water=" + std::to_string(step_) + " groups=" + join_ints(groups_) + "\n";
}

void HighWaterMark::write(const std::string& path, const std::string& line) {
  io::AtomicFileWriter file(path);
  file.write(line.data(), line.size());
  file.commit();
}

std::map<int, int> HighWaterMark::recovery_sources(const std::map<int, std::int64_t>& steps, std::int64_t step) {
  std::vector<int> sources;
  for (const auto& [group, at] : steps) {
    if (at == step) sources.push_back(group);
  }
  std::map<int, int> source_of;
  std::size_t turn = 0;
  for (const auto& [group, at] : steps) {
    if (at < step) source_of[group] = sources[turn++ % sources.size()];
  }
  return source_of;
}

}  // namespace gradsync::comm
