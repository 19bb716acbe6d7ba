// gradsync/core/error.h - the one exception type, and the check macro every layer uses.
//
// Every failure in gradsync is a gradsync::Error whose message says what went wrong, on
// which object (parameter, tensor, file) and, once a communicator exists, on which rank.
// The rank comes from a thread-local label set by the communication layer, so that a
// message raised deep inside a kernel still says "rank 3: ..." without every function
// having to carry the rank around. Ranks-as-threads tests get one label per thread.
#pragma once

#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>

namespace gradsync {

// Every error gradsync raises: a message naming the operation, the object and the rank.
class Error : public std::runtime_error {
 public:
  // The message is prefixed with "rank R: " when the calling thread has a rank label.
  explicit Error(const std::string& message);
};

// Labels the calling thread with its rank (-1 clears the label). Returns the previous label.
int set_thread_rank(int rank);
int thread_rank();  // the calling thread's rank label (-1: none)

// RAII form of set_thread_rank, for threads that act for one rank for a while.
class ThreadRankScope {
 public:
  explicit ThreadRankScope(int rank) : previous_(set_thread_rank(rank)) {}  // labels until it goes
  ~ThreadRankScope() { set_thread_rank(previous_); }
  ThreadRankScope(const ThreadRankScope&) = delete;
  ThreadRankScope& operator=(const ThreadRankScope&) = delete;

 private:
  int previous_;
};

// Warnings (not errors): by default printed to stderr as "gradsync warning: rank R: ...".
// A program or a test can route them elsewhere; set_warning_handler returns the previous one.
using WarningHandler = std::function<void(const std::string&)>;
void warn(const std::string& message);  // hands a warning to the handler
WarningHandler set_warning_handler(WarningHandler handler);  // (above)

namespace detail {
template <typename... Parts>
[[noreturn]] void throw_error(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw Error(message.str());
}
}  // namespace detail

}  // namespace gradsync

// GRADSYNC_CHECK(condition, "message parts", value, ...): throws gradsync::Error with the
// parts streamed together when the condition is false. The parts are only evaluated on
// failure, so checks on hot paths cost one branch.
#define GRADSYNC_CHECK(condition, ...)                      \
  do {                                                      \
    if (!(condition)) ::gradsync::detail::throw_error(__VA_ARGS__); \
  } while (0)
