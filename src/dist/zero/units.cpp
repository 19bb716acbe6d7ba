// ZeRO stage 3's units (units.h): gather, prefetch, release, the replayed prefetch, the
// staging pool, and the errors a released value gives.
#include "units.h"

#include <utility>

#include "core/device_memory.h"

namespace gradsync::dist {

ZeroUnits::ZeroUnits(ZeroShards& shards, const Reducer& reducer, const std::vector<std::vector<Parameter*>>& declared,
                     bool auto_prefetch, StepPhases& phases, int rank)
    : shards_(shards), phases_(phases), rank_(rank), auto_prefetch_(auto_prefetch),
      unit_of_bucket_(reducer.bucket_count(), 0), largest_piece_(shards.largest_piece()) {
  for (std::size_t u = 0; u < declared.size(); ++u) {
    Unit unit;
    unit.bucket = reducer.bucket_of(*declared[u][0]);
    unit.members = declared[u];
    const BucketInfo& info = reducer.bucket(unit.bucket);
    GRADSYNC_CHECK(info.members.size() == unit.members.size(), "ZeroOptimizer: unit ", u, " ('",
                   unit.members[0]->name(), "', ...) is not one bucket of its DataParallel");
    const std::string names = "'" + unit.members[0]->name() + "'" + (unit.members.size() > 1 ? ", ..." : "");
    unit.why_released = std::make_shared<const std::string>(
        "it is in unit " + std::to_string(u) + " (" + names + "), which is released (ZeRO stage 3): gather(" +
        std::to_string(u) + ") first");
    unit_of_bucket_[unit.bucket] = u;
    // Where this rank's piece begins and ends inside a huge page, 4 KiB pages there: writing the
    // piece (initialize, load_model, a step) must not commit the neighbours' part of the window.
    const Tensor values = shards_.bucket_values(unit.bucket);
    const BucketShard& piece = shards_.piece(unit.bucket);
    if (values.device().is_cpu()) {
      const std::size_t element = dtype_size(values.dtype());
      for (const std::int64_t edge : {piece.begin, piece.begin + piece.count}) {
        detail::host_small_pages_around(values.data(), values.nbytes(), static_cast<std::size_t>(edge) * element);
      }
    }
    units_.push_back(std::move(unit));
  }
  release_all();
}

ZeroUnits::Unit& ZeroUnits::at(std::size_t unit, const char* what) {
  GRADSYNC_CHECK(unit < units_.size(), "ZeroOptimizer::", what, ": unit ", unit, " of ", units_.size());
  return units_[unit];
}

const ZeroUnits::Unit& ZeroUnits::at(std::size_t unit, const char* what) const {
  GRADSYNC_CHECK(unit < units_.size(), "ZeroOptimizer::", what, ": unit ", unit, " of ", units_.size());
  return units_[unit];
}

// gather(u): the unit here; in the first step its place in the order is recorded, in later
// ones the next recorded unit is launched behind it.
void ZeroUnits::gather(std::size_t unit) {
  at(unit, "gather");
  launch(unit);
  if (recording_) {
    recorded_order_.push_back(unit);
  } else if (auto_prefetch_) {
    std::size_t position = cursor_;
    while (position < recorded_order_.size() && recorded_order_[position] != unit) ++position;
    if (position < recorded_order_.size()) {
      cursor_ = position + 1;
      if (cursor_ < recorded_order_.size()) launch(recorded_order_[cursor_]);
    } else {
      cursor_ = recorded_order_.size();  // off the recorded order: no more guesses this step
    }
  }
  finish_gather(unit);
}

void ZeroUnits::prefetch(std::size_t unit) {
  at(unit, "prefetch");
  launch(unit);
}

void ZeroUnits::release(std::size_t unit) {
  at(unit, "release");
  release_unit(unit);
}

bool ZeroUnits::gathered(std::size_t unit) const { return at(unit, "gathered").state == State::gathered; }

void ZeroUnits::finish(std::size_t unit) {
  at(unit, "wait_for");
  finish_gather(unit);
}

void ZeroUnits::release_all() {
  for (std::size_t u = 0; u < units_.size(); ++u) release_unit(u);
}

void ZeroUnits::end_step() {
  recording_ = false;
  cursor_ = 0;
}

void ZeroUnits::give_pieces(std::size_t unit) {
  at(unit, "give_pieces");
  launch(unit);  // this rank's pieces go out to the others
  finish_gather(unit);
  release_unit(unit);
}

void ZeroUnits::launch(std::size_t u) {
  Unit& unit = units_[u];
  if (unit.state != State::released) return;  // gathered or on its way: free
  phases_.before_gather(u);  // under Join, the joined ranks' shadow threads learn which unit to give their pieces to
  shards_.launch_gather(unit.bucket, "ZeRO-3 gather of unit " + std::to_string(u),
                        pooled_staging(shards_.bucket_values(unit.bucket)));
  unit.state = State::gathering;
}

void ZeroUnits::finish_gather(std::size_t u) {
  Unit& unit = units_[u];
  if (unit.state != State::gathering) return;
  try {
    shards_.wait(unit.bucket);
  } catch (const std::exception& error) {
    // The unit's values are not whole: it stays released, and the error says which gather.
    unit.state = State::released;
    (void)shards_.take_staging(unit.bucket);  // the failed gather may still hold it: not pooled
    std::string cause = error.what();
    const std::string own = "rank " + std::to_string(rank_) + ": ";
    if (cause.starts_with(own)) cause.erase(0, own.size());  // the rank is said once, in front
    detail::throw_error("ZeRO-3 gather of unit ", u, " ('", unit.members[0]->name(), "'",
                        unit.members.size() > 1 ? ", ..." : "", ") failed: ", cause);
  }
  // A few units are gathered at a time: the staging buffer goes back to the pool.
  staging_pool_.push_back(shards_.take_staging(unit.bucket));
  for (Parameter* member : unit.members) member->set_value_released(nullptr);
  unit.state = State::gathered;
}

// This rank's piece of a unit's values stays; the rest is zeroed and its pages given back.
void ZeroUnits::release_unit(std::size_t u) {
  Unit& unit = units_[u];
  if (unit.state == State::released) return;
  finish_gather(u);
  release_other_pieces(shards_.bucket_values(unit.bucket), shards_.piece(unit.bucket));
  for (Parameter* member : unit.members) member->set_value_released(unit.why_released);
  unit.state = State::released;
}

// A staging buffer for the arena's dtype and device: one from the pool, or a new one the size
// of the largest piece (paged: a pool that is dropped gives its pages back).
Tensor ZeroUnits::pooled_staging(const Tensor& like) {
  for (auto it = staging_pool_.begin(); it != staging_pool_.end(); ++it) {
    if (it->dtype() == like.dtype() && it->device() == like.device()) {
      Tensor buffer = std::move(*it);
      staging_pool_.erase(it);
      return buffer;
    }
  }
  return Tensor::zeros_paged({largest_piece_}, like.dtype(), like.device());
}

}  // namespace gradsync::dist
