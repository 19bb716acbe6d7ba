// Horovod's process sets (gradsync/dist/horovod/process_set.h).
#include "gradsync/dist/horovod/process_set.h"

#include <algorithm>
#include <cstdint>

#include "gradsync/core/error.h"
#include "gradsync/io/checksum.h"

namespace gradsync::dist {

namespace {

std::string listed(const std::vector<int>& ranks) {
  std::string text = "{";
  for (std::size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text + "}";
}

// What the ranks compare to agree on the set: a digest of the sorted list.
std::int64_t digest(const std::vector<int>& ranks) {
  return static_cast<std::int64_t>(io::xxh64(ranks.data(), ranks.size() * sizeof(int)) >> 1);
}

}  // namespace

ProcessSet::ProcessSet(comm::Communicator& world, std::vector<int> ranks)
    : ranks_(std::move(ranks)), world_rank_(world.rank()) {
  std::sort(ranks_.begin(), ranks_.end());
  // Checked before anything collective, alike on every rank that passed the same list.
  GRADSYNC_CHECK(!ranks_.empty(), "process set: rank ", world_rank_, " passes an empty set");
  GRADSYNC_CHECK(std::adjacent_find(ranks_.begin(), ranks_.end()) == ranks_.end(), "process set ", listed(ranks_),
                 ": rank ", world_rank_, " lists a rank twice");
  GRADSYNC_CHECK(ranks_.front() >= 0 && ranks_.back() < world.size(), "process set ", listed(ranks_), ": rank ",
                 world_rank_, " lists a rank outside the world of ", world.size());
  // Every rank must pass the same set: compare (size, digest) across the world first, so that a
  // rank with another list fails everywhere, named, instead of meeting the wrong group.
  Tensor mine = Tensor::empty({2}, DType::i64);
  mine.data_as<std::int64_t>()[0] = static_cast<std::int64_t>(ranks_.size());
  mine.data_as<std::int64_t>()[1] = digest(ranks_);
  Tensor all = Tensor::empty({2 * world.size()}, DType::i64);
  world.allgather(mine, all);
  const std::int64_t* words = all.data_as<std::int64_t>();
  for (int r = 0; r < world.size(); ++r) {
    if (words[2 * r] != mine.data_as<std::int64_t>()[0] || words[2 * r + 1] != mine.data_as<std::int64_t>()[1]) {
      detail::throw_error("process set ", listed(ranks_), " of rank ", world_rank_, ": rank ", r,
                          " passes a different set (of ", words[2 * r],
                          " ranks); every rank must add the same process sets in the same order");
    }
  }
  const auto place = std::find(ranks_.begin(), ranks_.end(), world_rank_);
  const bool member = place != ranks_.end();
  communicator_ = world.split(member ? 0 : comm::Communicator::kNoColor, static_cast<int>(place - ranks_.begin()));
}

bool ProcessSet::includes(int world_rank) const {
  return std::binary_search(ranks_.begin(), ranks_.end(), world_rank);
}

comm::Communicator& ProcessSet::communicator() {
  GRADSYNC_CHECK(communicator_ != nullptr, describe(), ": rank ", world_rank_,
                 " is not a member (only its ranks run its collectives)");
  return *communicator_;
}

std::string ProcessSet::describe() const { return "process set " + listed(ranks_); }

}  // namespace gradsync::dist
