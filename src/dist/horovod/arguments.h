// Internal: Horovod's DistributedOptimizer arguments turned into what the optimizer reduces
// (docs/semantics/horovod.md): the op as a communicator reduction, the names messages use
// (named_parameters), and the groups whose members share a fusion bucket. Each check and error
// text is Horovod's, in its order.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "gradsync/dist/horovod/distributed_optimizer.h"

namespace gradsync::dist {

// Average is a sum with scale factors, as in Horovod's core; Adasum is a hook over sums.
comm::ReduceOp comm_op(Op op);

// Each wrapped parameter's name: the registry's, or the one named_parameters gives (names must
// be unique and must cover every wrapped parameter).
std::map<const Parameter*, std::string> name_parameters(
    const std::vector<Parameter*>& parameters,
    const std::optional<std::vector<std::pair<std::string, Parameter*>>>& named_parameters);

// Horovod's groups: none; n (the parameters split in order into n nearly equal runs, the first
// size % n one longer: split_list); or explicit lists (filtered to the wrapped parameters, each
// parameter at most once, the rest as singletons).
using Groups = std::variant<std::monostate, int, std::vector<std::vector<Parameter*>>>;
std::vector<std::vector<Parameter*>> form_groups(const std::vector<Parameter*>& parameters, const Groups& option,
                                                const std::map<const Parameter*, std::string>& name_of);

}  // namespace gradsync::dist
