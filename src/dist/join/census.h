// Internal: the census a Joinable without synchronized steps of its own takes before each of its
// collectives while a dist::Join is open (LocalSGD's averages, DiLoCo's outer reductions). The
// status word DataParallel ends its synchronized steps with (dist/reducer/step_status.h), with no usage words:
// who has joined, who joined just now.
#pragma once

#include "gradsync/comm/communicator.h"
#include "gradsync/dist/join/join.h"

namespace gradsync::dist {

struct JoinCensus {
  const JoinOptions* options = nullptr;  // the Join this rank is inside, or null
  bool shadowing = false;                // this rank has joined
  bool first = false;                    // ... and has not been counted since

  // The factor each rank's contribution to the sum is scaled by: 1 / W outside a Join. Inside
  // one, after the census (written into `step` on a joined rank): 0 when every rank has joined
  // (nothing is to be reduced), 1 / (W - J) when dividing by the J ranks not joined, else 1 / W.
  // With throw_on_early_termination, as soon as one rank has joined the active ranks raise
  // JoinEarlyTermination and a joined one gets 0 (its join loop raises).
  double take(comm::Communicator& comm, JoinStep* step, const char* what);
};

}  // namespace gradsync::dist
