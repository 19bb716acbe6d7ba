// Shared by the benchmark programs: a timer that reports the best of several repetitions
// (the least disturbed by the other work on the machine), and table printing.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>

#include "gradsync/core/device.h"

namespace gradsync::bench {

// Best wall time in seconds of `repetitions` runs of fn, after one warm-up run. Device work
// is synchronized before the clock stops.
inline double best_seconds(int repetitions, Device device, const std::function<void()>& fn) {
  fn();
  synchronize(device);
  double best = 1e30;
  for (int rep = 0; rep < repetitions; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    synchronize(device);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

inline double gigabytes_per_second(double bytes, double seconds) { return bytes / seconds / 1e9; }

}  // namespace gradsync::bench
