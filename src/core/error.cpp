#include "gradsync/core/error.h"

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

}  // namespace gradsync
