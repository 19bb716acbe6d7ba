// Every rank raises the same error (gradsync/comm/agreement.h).
#include "gradsync/comm/agreement.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <vector>

namespace gradsync::comm {

namespace {
constexpr std::size_t kMaxReason = 4096;
}  // namespace

void agree(Communicator& comm, std::string_view what, const std::string& failure) {
  // A reason raised as an Error on this rank says "rank R: " already; the agreed message says it
  // once.
  const std::string own_prefix = "rank " + std::to_string(comm.rank()) + ": ";
  std::string_view trimmed = failure;
  if (trimmed.starts_with(own_prefix)) trimmed.remove_prefix(own_prefix.size());
  std::string reason = trimmed.size() > kMaxReason ? std::string(trimmed.substr(0, kMaxReason)) + "..." : std::string(trimmed);
  if (!failure.empty() && reason.empty()) reason = "a failure without a reason";  // still a failure
  // Round 1: the longest reason; zero means every rank succeeded (the common case: one word).
  Tensor longest = Tensor::zeros({1}, DType::i64);
  longest.data_as<std::int64_t>()[0] = static_cast<std::int64_t>(reason.size());
  comm.allreduce_host(longest, ReduceOp::max);
  const auto slot_bytes = static_cast<std::size_t>(longest.data_as<std::int64_t>()[0]);
  if (slot_bytes == 0) return;

  // Round 2: every rank's reason in a slot of that size (a length word, then the bytes).
  const std::size_t words = 1 + (slot_bytes + 7) / 8;
  Tensor mine = Tensor::zeros({static_cast<std::int64_t>(words)}, DType::i64);
  mine.data_as<std::int64_t>()[0] = static_cast<std::int64_t>(reason.size());
  std::memcpy(mine.data_as<std::int64_t>() + 1, reason.data(), reason.size());
  Tensor all = Tensor::empty({static_cast<std::int64_t>(words) * comm.size()}, DType::i64);
  comm.allgather_host(mine, all);

  int first = -1;
  std::string first_reason;
  std::vector<int> others;
  for (int rank = 0; rank < comm.size(); ++rank) {
    const std::int64_t* slot = all.data_as<std::int64_t>() + static_cast<std::size_t>(rank) * words;
    const auto length = static_cast<std::size_t>(std::clamp<std::int64_t>(slot[0], 0, static_cast<std::int64_t>(slot_bytes)));
    if (length == 0) continue;
    if (first < 0) {
      first = rank;
      first_reason.assign(reinterpret_cast<const char*>(slot + 1), length);
    } else {
      others.push_back(rank);
    }
  }
  std::ostringstream message;
  message << what << ": rank " << first << ": " << first_reason;
  if (!others.empty()) {
    message << " (rank" << (others.size() > 1 ? "s " : " ");
    for (std::size_t k = 0; k < others.size(); ++k) message << (k ? ", " : "") << others[k];
    message << " failed too)";
  }
  // The same bytes on every rank: without the "rank R: " an Error raised here would add.
  const ThreadRankScope unlabelled(-1);
  throw Error(message.str());
}

void agree(Communicator& comm, std::string_view what, const std::function<void()>& local) {
  std::string failure;
  try {
    local();
  } catch (const std::exception& error) {
    failure = *error.what() != '\0' ? error.what() : "an exception without a message";
  } catch (...) {
    failure = "an exception that is not a std::exception";
  }
  agree(comm, what, failure);
}

}  // namespace gradsync::comm
