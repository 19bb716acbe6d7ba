// Internal: a reduce hook run off the caller's thread (PowerSGD's; powersgd.h). A hook that
// blocks (PowerSGD's three collectives with products between them) would hold the engine's
// backward while each bucket reduces; here the Reducer launches the bucket and goes on, and the
// hook runs on a thread of its own, one bucket at a time in launch order, over a duplicate of
// the Reducer's communicator (its collectives then never interleave with the caller's on the
// original). The duplicate is made at the first bucket, collectively: every rank launches that
// bucket at the same point of its first synchronized step. The bucket's Work completes when the
// hook has returned and its own Work has completed; the hook's error is rethrown by its wait.
#pragma once

#include "gradsync/dist/reducer/reducer.h"

namespace gradsync::dist {

// `hook` off the caller's thread (above), for buckets on the host; a bucket on a device runs
// `hook` on the caller's thread (its kernels belong to the caller's stream).
ReduceHook off_thread(ReduceHook hook);

}  // namespace gradsync::dist
