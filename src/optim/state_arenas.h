// Internal: an optimizer's state buffers (optim/optimizer.h). One tensor per (arena, buffer):
// momentum, exp_avg, ..., and the f32 master copy, each created zero-filled the first time an
// update asks for it, laid out exactly like the registry's arena, so that one fused pass covers
// the arena. Sharded (ZeRO, dist/zero.h), a buffer holds only this rank's element ranges of the
// arena, packed in range order: a rank holds (owned / total) of the memory, and an element's
// place in the state is its range's packed offset plus its distance into the range.
#pragma once

#include <cstdint>
#include <vector>

#include "gradsync/optim/optimizer.h"

namespace gradsync::optim::internal {

class StateArenas {
 public:
  using ElementRange = Optimizer::ElementRange;

  // `dtypes`: each arena's state dtype (f32 for a 16-bit arena stepped through a master copy).
  StateArenas(const ParameterRegistry& registry, std::size_t buffers, std::vector<DType> dtypes);

  // The buffer, created zero-filled on first request.
  Tensor& get(std::size_t arena, std::size_t buffer);
  // The buffer, or an undefined Tensor while it has never been requested.
  const Tensor& find(std::size_t arena, std::size_t buffer) const { return buffers_.at(arena).at(buffer); }
  // Every buffer, [arena][buffer] (undefined where never requested).
  const std::vector<std::vector<Tensor>>& all() const { return buffers_; }
  DType dtype(std::size_t arena) const { return dtypes_[arena]; }
  void zero();  // every existing buffer back to zeros
  std::int64_t bytes() const;

  // --- Sharding: from now on only `ranges` ([arena] -> sorted, disjoint, within the arena) are
  // held; state that exists (a loaded checkpoint) is cut down to them. Errors name the range.
  void shard(std::vector<std::vector<ElementRange>> ranges, const char* optimizer);
  bool sharded() const { return sharded_; }
  const std::vector<ElementRange>& ranges(std::size_t arena) const { return ranges_.at(arena); }
  std::int64_t packed_offset(std::size_t arena, std::size_t range) const { return packed_[arena][range]; }
  // Elements one buffer of `arena` holds: the arena's, or the owned ranges' total.
  std::int64_t elements(std::size_t arena) const;

  // The parts of a parameter this state holds: the whole parameter unsharded, else its overlap
  // with each owned range. begin: arena element; state_offset: where it sits in the buffers.
  struct Piece {
    std::int64_t begin;
    std::int64_t count;
    std::int64_t state_offset;
  };
  std::vector<Piece> pieces(const Parameter& parameter) const;

 private:
  const ParameterRegistry& registry_;
  std::vector<DType> dtypes_;
  std::vector<std::vector<Tensor>> buffers_;  // [arena][buffer]
  bool sharded_ = false;
  std::vector<std::vector<ElementRange>> ranges_;  // [arena], when sharded
  std::vector<std::vector<std::int64_t>> packed_;  // [arena][range]: its first packed element
};

}  // namespace gradsync::optim::internal
