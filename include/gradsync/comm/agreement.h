// gradsync/comm/agreement.h - every rank raises the same error, at once.
//
// Work that each rank does alone (validating its files, writing its piece of a checkpoint)
// fails on some ranks and not others. If each rank simply threw, the others would walk into
// the next collective and wait there for the communicator's timeout, then report a lost peer
// instead of the reason. So such work ends with an agreement: one small allreduce asks "did
// every rank succeed?"; when one did not, one allgather carries every rank's reason, and every
// rank throws the same Error naming the lowest failing rank and its reason (and the other
// ranks that failed), so a job ends with one message, not W different ones.
//
//   comm::agree(comm, "ZeroOptimizer::load_sharded", [&] { verify_my_files(); });
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "gradsync/comm/communicator.h"

namespace gradsync::comm {

// Collective. `failure` is this rank's reason, empty when it succeeded. Returns when every rank
// succeeded; otherwise throws on every rank "<what>: rank R: <reason>" (a reason is cut at
// 4 KiB).
void agree(Communicator& comm, std::string_view what, const std::string& failure);

// Runs `local` (which must not communicate), turns what it throws into this rank's reason, and
// agrees as above.
void agree(Communicator& comm, std::string_view what, const std::function<void()>& local);

}  // namespace gradsync::comm
