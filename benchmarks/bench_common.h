// Shared by the benchmark programs: a timer that reports the best of several repetitions
// (the least disturbed by the other work on the machine), and table printing.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/core/device.h"
#include "gradsync/core/error.h"
#include "gradsync/core/threads.h"

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

// The median of a run's timings (the middle one after sorting; the upper of the two middle
// ones for an even count).
inline double median(std::vector<double> times) {
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Runs fn(begin, end) over [0, n) split across gradsync::num_threads() threads of its own: the
// memory-bandwidth ceilings are measured with as many cores as the library's loops use.
inline void on_all_cores(std::int64_t n, const std::function<void(std::int64_t, std::int64_t)>& fn) {
  const std::int64_t threads = std::max(1, num_threads());
  const std::int64_t chunk = (n + threads - 1) / threads;
  std::vector<std::thread> workers;
  for (std::int64_t t = 1; t < threads; ++t) {
    const std::int64_t begin = std::min(n, t * chunk), end = std::min(n, (t + 1) * chunk);
    workers.emplace_back([&fn, begin, end] { fn(begin, end); });
  }
  fn(0, std::min(n, chunk));
  for (std::thread& worker : workers) worker.join();
}

// A benchmark's command line, checked before anything runs: `--name value` for the flags in
// `valued`, bare `--name` for those in `switches`. --help (or -h) prints `usage` and exits 0;
// an unknown flag, or a valued one without its value, is an error naming it.
class Flags {
 public:
  Flags(int argc, char** argv, const char* usage, std::set<std::string> valued, std::set<std::string> switches = {}) {
    for (int i = 1; i < argc; ++i) {
      const std::string flag = argv[i];
      if (flag == "--help" || flag == "-h") {
        std::printf("%s\n", usage);
        std::exit(0);
      }
      if (switches.contains(flag)) {
        set_.insert(flag);
      } else if (valued.contains(flag)) {
        GRADSYNC_CHECK(i + 1 < argc, "flag ", flag, " needs a value (--help lists the flags)");
        values_[flag] = argv[++i];
      } else {
        detail::throw_error("unknown flag '", flag, "' (--help lists the flags)");
      }
    }
  }
  std::string text(const std::string& name, const std::string& fallback) const {
    const auto found = values_.find(name);
    return found == values_.end() ? fallback : found->second;
  }
  long long integer(const std::string& name, long long fallback) const {
    const auto found = values_.find(name);
    if (found == values_.end()) return fallback;
    try {
      std::size_t used = 0;
      const long long value = std::stoll(found->second, &used);
      if (used == found->second.size()) return value;
    } catch (const std::exception&) {
    }
    detail::throw_error("flag ", name, " '", found->second, "' is not an integer");
  }
  double number(const std::string& name, double fallback) const {
    const auto found = values_.find(name);
    if (found == values_.end()) return fallback;
    try {
      std::size_t used = 0;
      const double value = std::stod(found->second, &used);
      if (used == found->second.size()) return value;
    } catch (const std::exception&) {
    }
    detail::throw_error("flag ", name, " '", found->second, "' is not a number");
  }
  bool flag(const std::string& name) const { return set_.contains(name); }

 private:
  std::map<std::string, std::string> values_;
  std::set<std::string> set_;
};

}  // namespace gradsync::bench
