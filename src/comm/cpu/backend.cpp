// What every CPU backend shares: the duplicate and split of a group keep knowing which world
// ranks its members are, so that every message can name a peer by the number its user knows.
#include "backend.h"

namespace gradsync::comm {

std::unique_ptr<Backend> Backend::duplicate() {
  std::unique_ptr<Backend> child = make_duplicate();
  child->world_ranks_ = world_ranks_;
  return child;
}

std::unique_ptr<Backend> Backend::split(int color, int key, const SplitPlace& place) {
  std::unique_ptr<Backend> child = make_split(color, key, place);
  if (child == nullptr) return nullptr;
  for (const int member : place.members) {
    child->world_ranks_.push_back(world_ranks_.empty() ? member : world_ranks_[static_cast<std::size_t>(member)]);
  }
  return child;
}

int Backend::world_rank(int r) const {
  return r >= 0 && static_cast<std::size_t>(r) < world_ranks_.size() ? world_ranks_[static_cast<std::size_t>(r)] : r;
}

std::string Backend::rank_name(int r) const {
  std::string name = "rank " + std::to_string(r);
  if (world_rank(r) != r) name += " (world rank " + std::to_string(world_rank(r)) + ")";
  return name;
}

}  // namespace gradsync::comm
