// Internal: ZeRO's first room, ownership and the sharded step (gradsync/dist/zero/zero.h).
//
// Contract. Every bucket of the Reducer is a run of one gradient arena; rank r owns the r-th
// of W equal pieces of it (shard_bucket), the same computation on every rank. ZeroShards:
//  * lays that out once (ShardLayout: this rank's ranges per arena and every rank's), after
//    checking that every rank has the same stage and buckets, and hands this rank's ranges to
//    the optimizer (Optimizer::shard), which from then on keeps state for them only and steps
//    only them;
//  * makes the optimizer's gradient statistics (clipping, the GradScaler's finite check) the
//    world's: each rank's owned pieces summed over ranks, one small allreduce, the same on every
//    rank;
//  * puts a bucket's values back together after a step: this rank's updated piece allgathered
//    into the value arena (launch_gather / wait), on the ZeroOptimizer's own communicator;
//  * zero_grad at stage 2 and 3 gives the gradient pages back instead of writing zeros.
// It knows nothing of units (units.h) or of Join (join.h): before each collective phase
// that joined ranks must answer it tells its StepPhases, and a stage-3 gather brings its own
// staging buffer and label.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/dist/reducer/reducer.h"
#include "gradsync/optim/optimizer.h"
#include "checkpoint.h"

namespace gradsync::dist {

// The collective phases of a ZeRO step that a joined rank must take part in, announced before
// each begins (ZeroJoin implements it; outside a Join an announcement sends nothing).
class StepPhases {
 public:
  virtual void before_statistics() = 0;
  virtual void before_step() = 0;
  virtual void before_gather(std::size_t unit) = 0;

 protected:
  ~StepPhases() = default;
};

class ZeroShards {
 public:
  // Collective over `comm`: every rank the same stage and buckets, or an error on every rank
  // naming the first difference. Then `optimizer` (not stepped yet) is sharded.
  ZeroShards(optim::Optimizer& optimizer, const Reducer& reducer, comm::Communicator& comm, int stage,
             StepPhases& phases);
  ZeroShards(const ZeroShards&) = delete;
  ZeroShards& operator=(const ZeroShards&) = delete;

  const ShardLayout& layout() const { return layout_; }
  // The largest piece this rank owns of any bucket (stage 3 sizes its staging buffers by it).
  std::int64_t largest_piece() const;
  // A bucket's values: its run of the value arena (every rank's pieces of it).
  Tensor bucket_values(std::size_t bucket) const;
  const BucketShard& piece(std::size_t bucket) const { return gathers_[bucket].shard; }

  // One bucket's pieces of the values allgathered into the arena. `staging` (undefined: a
  // buffer of the piece's size, made once and kept) holds this rank's piece on the way out,
  // since the input must not alias the output.
  void launch_gather(std::size_t bucket, const std::string& label, Tensor staging = Tensor());
  // Waits for a bucket's gather (nothing when none is in flight); its error if it failed.
  void wait(std::size_t bucket);
  // Takes a bucket's staging buffer back (stage 3 pools them) and forgets it.
  Tensor take_staging(std::size_t bucket);
  // Every bucket's gather (stages 1 and 2), and waiting for all of them.
  void launch_all();
  void wait_all();
  void drain() noexcept;  // waits, reporting nothing (destruction)

  void zero_grad(bool set_to_undefined);

 private:
  // Every rank's statistics of its owned pieces, made the world's: sums, and the largest.
  void combine(optim::GradientStatistics& statistics);

  struct Gather {
    std::size_t arena = 0;
    std::int64_t begin = 0;  // the bucket's first element in the arena
    std::int64_t numel = 0;
    BucketShard shard;
    Tensor staging;
    comm::WorkHandle work;
  };

  optim::Optimizer& optimizer_;
  comm::Communicator& comm_;
  int stage_;
  StepPhases& phases_;
  ShardLayout layout_;
  std::vector<Gather> gathers_;  // by bucket index
};

}  // namespace gradsync::dist
