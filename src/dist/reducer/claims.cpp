// One synchronizer per gradient (claims.h).
#include "claims.h"

#include <map>
#include <mutex>

#include "gradsync/core/error.h"

namespace gradsync::dist {

namespace {

std::mutex claims_mutex;
std::map<const Parameter*, std::string>& claims() {  // parameter -> who reduces it
  static std::map<const Parameter*, std::string> held;
  return held;
}

}  // namespace

ReductionClaim::ReductionClaim(const std::vector<Parameter*>& parameters, std::string who) {
  std::lock_guard<std::mutex> lock(claims_mutex);
  for (const Parameter* parameter : parameters) {
    const auto held = claims().find(parameter);
    if (held == claims().end()) continue;
    detail::throw_error(who, ": parameter '", parameter->name(), "' is already reduced by ", held->second,
                        " over the same registry; two synchronizers would reduce each gradient twice (wrap the model "
                        "in one: DataParallel, or a DistributedOptimizer, not both)");
  }
  for (const Parameter* parameter : parameters) {
    claims().emplace(parameter, who);
    claimed_.push_back(parameter);
  }
}

void ReductionClaim::release() {
  std::lock_guard<std::mutex> lock(claims_mutex);
  for (const Parameter* parameter : claimed_) claims().erase(parameter);
  claimed_.clear();
}

}  // namespace gradsync::dist
