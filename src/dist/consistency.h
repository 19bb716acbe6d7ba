// Internal: checks every rank runs with the same parameters (same names, shapes and dtypes,
// in the same order) before anything is reduced or broadcast. Both front-ends call it at
// construction, so a mismatch is a clear error on every rank instead of a hang or silently
// mixed tensors later.
#pragma once

#include <string>
#include <vector>

#include "gradsync/comm/communicator.h"
#include "gradsync/registry/parameter.h"

namespace gradsync::dist {

// Collective: every rank's `lines` must be equal; otherwise throws on every rank, naming the
// first differing line and both ranks' views ("the ranks do not hold the same <what>").
void require_same_lines(comm::Communicator& comm, const std::vector<std::string>& lines, const std::string& who,
                        const std::string& what, const std::string& item = "Line");

// `names[i]` is how parameters[i] is called in messages (the registry name by default).
// Collective; throws on every rank, naming the first differing parameter and both ranks' views.
void require_same_parameters(comm::Communicator& comm, const std::vector<const Parameter*>& parameters,
                             const std::vector<std::string>& names, const std::string& who);

// Moves a byte string from root to every rank (as i32 words: the dtypes are numeric).
std::string broadcast_bytes(comm::Communicator& comm, const std::string& bytes, int root);

}  // namespace gradsync::dist
