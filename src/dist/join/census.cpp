// The census before a Join-aware collective (census.h).
#include "census.h"

#include <memory>
#include <string>

#include "gradsync/comm/records/flight_recorder.h"
#include "dist/reducer/step_status.h"

namespace gradsync::dist {

double JoinCensus::take(comm::Communicator& comm, JoinStep* step, const char* what) {
  const double world = comm.size();
  if (options == nullptr) return 1.0 / world;
  StepStatus status(/*parameters=*/0, comm);
  status.set_flags(shadowing ? (kJoined | (first ? kJoinedThisStep : 0)) : 0);
  first = false;
  {
    const comm::OperationLabel label(std::string("who has joined, before ") + what);
    status.exchange(comm, [] {});
  }
  const Census census = status.census();
  if (step != nullptr) {
    step->synchronized = true;
    step->joined = census.joined;
    step->world = comm.size();
    step->last_joiner = census.last_joiner;
    step->optimizer_step_follows = false;
  }
  if (census.joined > 0 && options->throw_on_early_termination) {
    // Every rank stops here: the active ones raise now, a joined one launches nothing and the
    // join loop raises on it.
    if (!shadowing) throw JoinEarlyTermination("Detected at least one rank that exhausted inputs. Throwing across all ranks.");
    return 0;
  }
  if (census.joined == comm.size()) return 0;
  if (!options->divide_by_initial_world_size && census.joined > 0) return 1.0 / (world - census.joined);
  return 1.0 / world;
}

}  // namespace gradsync::dist
