// Internal: the library's thread pool and its one primitive, parallel_for
// (gradsync/core/threads.h says how many threads and why results do not depend on it).
#pragma once

#include <cstdint>
#include <functional>

namespace gradsync::parallel {

// Runs body(begin, end) over [0, n) in chunks of at least `grain` elements (a multiple of
// `align`), on up to num_threads() threads including the caller; returns when every chunk is
// done. Runs inline when the work is small or one thread is configured. The first exception
// thrown by a chunk is rethrown here after every chunk has finished.
void parallel_for(std::int64_t n, std::int64_t grain, std::int64_t align,
                  const std::function<void(std::int64_t begin, std::int64_t end)>& body);

// Runs task(i) for i in [0, count) on the pool (the caller included), in no particular order.
void for_each_task(std::int64_t count, const std::function<void(std::int64_t index)>& task);

}  // namespace gradsync::parallel
