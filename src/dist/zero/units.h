// Internal: ZeRO's second room, stage 3's units (gradsync/dist/zero/zero.h).
//
// Contract. A unit is one bucket of the DataParallel (DataParallelOptions::units made it so)
// whose values the engine gathers before its forward or backward and releases after. Between
// uses a rank holds only its piece of a unit's values: the rest is zeroed and its pages given
// back, and each member's value() is an error naming the unit ("gather(u) first"). ZeroUnits:
//  * gather(u): launches the unit's gather (ZeroShards::launch_gather) unless it is gathered or
//    on its way, and waits for it; in the first step it records the order of gathers, in later
//    ones (auto prefetch) it launches the next recorded unit behind the one asked for, FSDP2's
//    replayed prefetch; prefetch(u) launches and returns; release(u) waits for a gather in
//    flight, then gives the other pieces back;
//  * keeps a pool of staging buffers, each the size of the largest piece: only as many as
//    gathers in flight at once, since a fresh one per gather costs its page faults on the
//    caller's thread every time;
//  * on a failed gather leaves the unit released and raises an error naming the unit.
// Each launch is announced to the StepPhases first (under Join the joined ranks' shadow threads
// must hand over their pieces); give_pieces is the joined rank's side of one such gather.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "shards.h"

namespace gradsync::dist {

class ZeroUnits {
 public:
  // `declared`: the DataParallel's units, each exactly one bucket of `reducer` (or an error
  // naming the unit). Every unit ends released.
  ZeroUnits(ZeroShards& shards, const Reducer& reducer, const std::vector<std::vector<Parameter*>>& declared,
            bool auto_prefetch, StepPhases& phases, int rank);
  ZeroUnits(const ZeroUnits&) = delete;
  ZeroUnits& operator=(const ZeroUnits&) = delete;

  std::size_t count() const { return units_.size(); }
  std::size_t unit_of_bucket(std::size_t bucket) const { return unit_of_bucket_[bucket]; }

  void gather(std::size_t unit);
  void prefetch(std::size_t unit);
  void release(std::size_t unit);
  bool gathered(std::size_t unit) const;
  // Waits for a unit's gather in flight (ZeroOptimizer::wait_for).
  void finish(std::size_t unit);
  // Every unit back to its pieces (before a step, or a load, makes the other pieces stale).
  void release_all();
  // A step is over: the first step's order is recorded, and replay starts from its beginning.
  void end_step();
  // A joined rank's part in an active rank's gather of `unit`: its piece goes out, and the unit
  // is released again (unannounced: the shadow thread answers an announcement).
  void give_pieces(std::size_t unit);

 private:
  enum class State { released, gathering, gathered };
  struct Unit {
    std::size_t bucket = 0;
    std::vector<Parameter*> members;
    std::shared_ptr<const std::string> why_released;  // what a released member's value() says
    State state = State::gathered;  // until the constructor releases it
  };

  Unit& at(std::size_t unit, const char* what);
  const Unit& at(std::size_t unit, const char* what) const;
  void launch(std::size_t unit);
  void finish_gather(std::size_t unit);
  void release_unit(std::size_t unit);
  Tensor pooled_staging(const Tensor& like);

  ZeroShards& shards_;
  StepPhases& phases_;
  int rank_;
  bool auto_prefetch_;
  std::vector<Unit> units_;
  std::vector<std::size_t> unit_of_bucket_;
  std::vector<Tensor> staging_pool_;
  std::int64_t largest_piece_ = 0;
  // Auto prefetch: the first step's order of gathers, replayed from a cursor in later steps.
  std::vector<std::size_t> recorded_order_;
  bool recording_ = true;
  std::size_t cursor_ = 0;
};

}  // namespace gradsync::dist
