#include "gradsync/core/error.h"

#include <cstdio>
#include <mutex>

namespace gradsync {

namespace {
thread_local int current_thread_rank = -1;

std::string with_rank_prefix(const std::string& message) {
  if (current_thread_rank < 0) return message;
  return "rank " + std::to_string(current_thread_rank) + ": " + message;
}
}  // namespace

Error::Error(const std::string& message) : std::runtime_error(with_rank_prefix(message)) {}

int set_thread_rank(int rank) {
  const int previous = current_thread_rank;
  current_thread_rank = rank;
  return previous;
}

int thread_rank() { return current_thread_rank; }

namespace {
std::mutex warning_mutex;
WarningHandler& warning_handler() {
  static WarningHandler handler;
  return handler;
}
}  // namespace

void warn(const std::string& message) {
  const std::string text = with_rank_prefix(message);
  std::lock_guard<std::mutex> lock(warning_mutex);
  if (warning_handler()) {
    warning_handler()(text);
  } else {
    std::fprintf(stderr, "gradsync warning: %s\n", text.c_str());
  }
}

WarningHandler set_warning_handler(WarningHandler handler) {
  std::lock_guard<std::mutex> lock(warning_mutex);
  WarningHandler previous = std::move(warning_handler());
  warning_handler() = std::move(handler);
  return previous;
}

}  // namespace gradsync
