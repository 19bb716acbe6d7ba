// gradsync/dist/replicas/replicas.h - making the ranks' replicas the same, and checking that they are.
//
// Data parallelism assumes every rank holds the same model and the same optimizer; both front
// ends (DataParallel, DistributedOptimizer) check it at construction and make rank 0's values
// everyone's. The pieces are here for engines that need them on their own (a resumed run
// broadcasting rank 0's checkpoint, a Join making the last joiner's replica everyone's):
//  * the checks are collective and fail on every rank alike, naming the first difference and
//    both ranks' views ("Parameter #3 is 'fc2.weight' f32[10, 64] on cpu on rank 0 but ...
//    on rank 1"), so a mismatch is an error before anything is reduced, never a hang or
//    silently mixed tensors;
//  * the broadcasts move whole arenas (a few large messages), and optimizer state as the
//    contents of the optimizer's own checkpoint, validated as a file would be.
#pragma once

#include <string>
#include <vector>

#include "gradsync/comm/communicator.h"
#include "gradsync/optim/optimizer.h"
#include "gradsync/registry/parameter_registry.h"

namespace gradsync::dist {

// Every rank's `lines` must be equal; otherwise throws on every rank, naming the first
// differing line (`item` #i) and both ranks' views ("the ranks do not hold the same <what>").
// Collective.
void require_same_lines(comm::Communicator& comm, const std::vector<std::string>& lines, const std::string& who,
                        const std::string& what, const std::string& item = "Line");

// The same parameters (names, shapes, dtypes, device types, in order) on every rank.
// `names[i]` is how parameters[i] is called in messages. Collective.
void require_same_parameters(comm::Communicator& comm, const std::vector<const Parameter*>& parameters,
                             const std::vector<std::string>& names, const std::string& who);

// Every rank's optimizer has the same kind, groups and hyperparameters. The
// DistributedOptimizer checks this at construction; with DataParallel, call it yourself.
// Collective.
void require_same_optimizer(const optim::Optimizer& optimizer, comm::Communicator& comm,
                            const std::string& who = "require_same_optimizer");

// After these, every rank holds root's parameter values (and buffers: frozen parameters), and
// root's optimizer state (buffers, step counts, hyperparameters). Collective.
void broadcast_parameters(ParameterRegistry& registry, comm::Communicator& comm, int root = 0);
void broadcast_optimizer_state(optim::Optimizer& optimizer, comm::Communicator& comm, int root = 0);  // (above)

// Root's checkpoint tensors and metadata (an optimizer's state_tensors / state_metadata, or a
// ZeroOptimizer's consolidated state) on every rank: what broadcast_optimizer_state carries.
// Collective.
void broadcast_state(comm::Communicator& comm, std::vector<io::NamedTensor>& tensors, io::Metadata& metadata, int root);
// Root's byte string on every rank. Collective.
std::string broadcast_bytes(comm::Communicator& comm, const std::string& bytes, int root);

}  // namespace gradsync::dist
