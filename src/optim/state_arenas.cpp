// An optimizer's state buffers, whole or sharded (state_arenas.h).
#include "state_arenas.h"

#include <algorithm>

#include "gradsync/kernels/ops.h"

namespace gradsync::optim::internal {

StateArenas::StateArenas(const ParameterRegistry& registry, std::size_t buffers, std::vector<DType> dtypes)
    : registry_(registry), dtypes_(std::move(dtypes)),
      buffers_(registry.arenas().size(), std::vector<Tensor>(buffers)) {}

Tensor& StateArenas::get(std::size_t arena, std::size_t buffer) {
  Tensor& tensor = buffers_.at(arena).at(buffer);
  if (!tensor.defined()) tensor = Tensor::zeros({elements(arena)}, dtypes_[arena], registry_.arenas()[arena].device);
  return tensor;
}

void StateArenas::zero() {
  for (auto& arena : buffers_) {
    for (Tensor& buffer : arena) {
      if (buffer.defined()) ops::fill(buffer, 0.0);
    }
  }
}

std::int64_t StateArenas::bytes() const {
  std::int64_t total = 0;
  for (const auto& arena : buffers_) {
    for (const Tensor& buffer : arena) total += buffer.defined() ? static_cast<std::int64_t>(buffer.nbytes()) : 0;
  }
  return total;
}

void StateArenas::shard(std::vector<std::vector<ElementRange>> ranges, const char* optimizer) {
  GRADSYNC_CHECK(ranges.size() == buffers_.size(), optimizer, ": shard ranges for ", ranges.size(), " arenas, the ",
                 "registry has ", buffers_.size());
  GRADSYNC_CHECK(!sharded_, optimizer, ": already sharded");
  std::vector<std::vector<std::int64_t>> packed(ranges.size());
  for (std::size_t arena = 0; arena < ranges.size(); ++arena) {
    const std::int64_t size = registry_.arenas()[arena].values.numel();
    std::int64_t previous_end = 0, offset = 0;
    for (const ElementRange& range : ranges[arena]) {
      GRADSYNC_CHECK(range.begin >= previous_end && range.begin < range.end && range.end <= size, optimizer,
                     ": shard range [", range.begin, ", ", range.end, ") of arena ", arena, " (", size,
                     " elements) is empty, out of order or out of bounds");
      packed[arena].push_back(offset);
      offset += range.end - range.begin;
      previous_end = range.end;
    }
  }
  // State that exists already (a loaded checkpoint): keep the owned pieces only.
  for (std::size_t arena = 0; arena < buffers_.size(); ++arena) {
    for (Tensor& buffer : buffers_[arena]) {
      if (!buffer.defined()) continue;
      std::int64_t owned = 0;
      for (const ElementRange& range : ranges[arena]) owned += range.end - range.begin;
      Tensor cut = Tensor::zeros({owned}, buffer.dtype(), buffer.device());
      for (std::size_t k = 0; k < ranges[arena].size(); ++k) {
        const ElementRange& range = ranges[arena][k];
        Tensor target = cut.view(static_cast<std::size_t>(packed[arena][k]), {range.end - range.begin});
        target.copy_from(buffer.view(static_cast<std::size_t>(range.begin), {range.end - range.begin}));
      }
      buffer = cut;
    }
  }
  ranges_ = std::move(ranges);
  packed_ = std::move(packed);
  sharded_ = true;
}

std::int64_t StateArenas::elements(std::size_t arena) const {
  if (!sharded_) return registry_.arenas()[arena].values.numel();
  std::int64_t total = 0;
  for (const ElementRange& range : ranges_[arena]) total += range.end - range.begin;
  return total;
}

std::vector<StateArenas::Piece> StateArenas::pieces(const Parameter& parameter) const {
  const auto begin = static_cast<std::int64_t>(parameter.arena_offset());
  const std::int64_t end = begin + parameter.numel();
  if (!sharded_) return {{begin, parameter.numel(), begin}};
  std::vector<Piece> pieces;
  const auto& ranges = ranges_[parameter.arena_index()];
  for (std::size_t k = 0; k < ranges.size(); ++k) {
    const std::int64_t lo = std::max(begin, ranges[k].begin), hi = std::min(end, ranges[k].end);
    if (lo < hi) pieces.push_back({lo, hi - lo, packed_[parameter.arena_index()][k] + (lo - ranges[k].begin)});
  }
  return pieces;
}

}  // namespace gradsync::optim::internal
