// The status word of a synchronized step (step_status.h).
#include "step_status.h"

#include <algorithm>
#include <memory>
#include <string>

#include "gradsync/comm/records/flight_recorder.h"

namespace gradsync::dist {

namespace {
// After the usage words and the flags words: the carry flag, AUTO's flag and its three times.
constexpr std::size_t kCarry = 0;
constexpr std::size_t kAutoFlag = 1;
constexpr std::size_t kAutoTimes = 2;
constexpr std::size_t kTailWords = 5;
}  // namespace

int StepStatus::job_rank(const comm::Communicator& comm, const comm::Communicator* replicas) {
  return replicas == nullptr ? comm.rank() : replicas->rank() * comm.size() + comm.rank();
}

int StepStatus::job_size(const comm::Communicator& comm, const comm::Communicator* replicas) {
  return replicas == nullptr ? comm.size() : replicas->size() * comm.size();
}

StepStatus::StepStatus(std::size_t parameters, const comm::Communicator& comm, const comm::Communicator* replicas)
    : parameters_(parameters), world_(job_size(comm, replicas)), rank_(job_rank(comm, replicas)),
      words_(Tensor::zeros({static_cast<std::int64_t>(parameters + static_cast<std::size_t>(world_) + kTailWords)},
                           DType::f64)) {}

double* StepStatus::words() { return words_.data_as<double>(); }
const double* StepStatus::words() const { return words_.data_as<double>(); }

void StepStatus::set_used(std::size_t parameter) { words()[parameter] = 1; }
void StepStatus::set_flags(int flags) { words()[parameters_ + static_cast<std::size_t>(rank_)] = flags; }

void StepStatus::set_carried() { words()[parameters_ + static_cast<std::size_t>(world_) + kCarry] = 1; }

void StepStatus::propose_auto(const std::array<double, 3>& trial_seconds) {
  double* tail = words() + parameters_ + static_cast<std::size_t>(world_);
  tail[kAutoFlag] = 1;
  std::copy(trial_seconds.begin(), trial_seconds.end(), tail + kAutoTimes);
}

void StepStatus::exchange(comm::Communicator& comm, const std::function<void()>& meanwhile,
                          comm::Communicator* replicas) {
  static const auto kLabel = std::make_shared<const std::string>("step status (used parameters, join flags)");
  comm::WorkHandle work;
  {
    const comm::OperationLabel label(kLabel);
    work = comm.allreduce_host_async(words_, comm::ReduceOp::sum);
  }
  comm::FirstError errors;
  errors.run(meanwhile);
  errors.wait(work);
  errors.rethrow();
  if (replicas == nullptr || replicas->size() == 1) return;
  GRADSYNC_CHECK(world_ == job_size(comm, replicas), "StepStatus: exchanged across shard groups it was not made for");
  const comm::OperationLabel label("step status across shard groups");
  replicas->allreduce_host(words_, comm::ReduceOp::sum);
}

int StepStatus::used_count(std::size_t parameter) const { return static_cast<int>(words()[parameter]); }

Census StepStatus::census() const {
  Census census;
  const double* flags = words() + parameters_;
  for (int r = 0; r < world_; ++r) {
    const int bits = static_cast<int>(flags[r]);
    if (bits & kMissedGradients) census.missed.push_back(r);
    if (bits & kJoined) census.joined_ranks.push_back(r);
    if (bits & kJoinedThisStep) census.last_joiner = r;
  }
  census.joined = static_cast<int>(census.joined_ranks.size());
  return census;
}

bool StepStatus::carried() const { return words()[parameters_ + static_cast<std::size_t>(world_) + kCarry] > 0; }

std::optional<std::array<double, 3>> StepStatus::auto_times() const {
  const double* tail = words() + parameters_ + static_cast<std::size_t>(world_);
  if (tail[kAutoFlag] <= 0) return std::nullopt;
  return std::array<double, 3>{tail[kAutoTimes], tail[kAutoTimes + 1], tail[kAutoTimes + 2]};
}

}  // namespace gradsync::dist
