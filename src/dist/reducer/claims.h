// Internal: one synchronizer per gradient (gradsync/dist/reducer/reducer.h). A parameter's
// gradient is reduced by at most one live Reducer: a DataParallel and a DistributedOptimizer over
// the same registry were both accepted, and every gradient was reduced twice (summed twice, or
// averaged over the ranks twice) without a word. Reducers over disjoint parameters of one registry
// (an expert-parallel part beside a data-parallel one) are fine. Process-wide, thread-safe.
#pragma once

#include <string>
#include <vector>

#include "gradsync/registry/parameter.h"

namespace gradsync::dist {

// Claims `parameters` for `who` ("DataParallel"); an error naming the first one another claim
// holds, and whose, with nothing claimed. release() gives them back (the destructor too).
class ReductionClaim {
 public:
  ReductionClaim() = default;
  ReductionClaim(const std::vector<Parameter*>& parameters, std::string who);
  ~ReductionClaim() { release(); }
  ReductionClaim(const ReductionClaim&) = delete;
  ReductionClaim& operator=(const ReductionClaim&) = delete;
  void release();

 private:
  std::vector<const Parameter*> claimed_;
};

}  // namespace gradsync::dist
