// Uneven inputs (dist/join.h, DistributedOptimizer::join), written once against a
// Communicator: run on Gloo ranks-as-threads (multirank/test_join.cpp, 2-4 ranks), on MPI
// processes (multirank/test_mpi.cpp) and with the model on a GPU (test_devices.cpp). Each rank
// trains on a different number of batches; the reference is computed independently on every
// rank by one model that takes, at every step, the gradients of the ranks still active on the
// same samples, averaged by the same rule.
#pragma once

#include <string>
#include <vector>

#include "gradsync/comm/communicator.h"
#include "gradsync/dist/data_parallel/sync_strategy.h"

namespace gradsync::testing {

struct UnevenCase {
  std::string optimizer = "sgd";  // sgd (momentum 0.9) | adam
  dist::DDPSyncStrategy strategy = dist::DDPSyncStrategy::single_auto_sync;
  int microbatches = 2;
  bool divide_by_initial_world_size = true;
  bool find_unused_parameters = false;  // then ranks skip the bias at some steps
  dist::Compression compression = dist::Compression::none;
  std::vector<int> counts{3, 5, 2, 5};  // batches per rank and epoch; epoch e shifts them by e
  int epochs = 2;
  double tolerance = 2e-5;  // f32 sums in another order; fp16 compression needs more
  int zero_stage = 0;       // ZeRO (dist/zero.h): joined ranks keep stepping their pieces
  double clip = 0;          // clip to this global norm before each step (0: off)
  // A learning rate that changes every step (as a warmup does), set by the active ranks only:
  // joined ranks that step their ZeRO pieces must step with the active ranks' rate.
  bool lr_schedule = false;
  Device device = Device::cpu();  // where the model lives (devices.h runs cuda too)

  int count(int rank, int epoch, int world) const {
    return counts[static_cast<std::size_t>((rank + epoch) % world) % counts.size()];
  }
  std::string describe() const {
    return optimizer + " " + dist::sync_strategy_name(strategy) + " x" + std::to_string(microbatches) +
           (divide_by_initial_world_size ? " /initial" : " /active") + (find_unused_parameters ? " unused" : "") +
           " " + dist::compression_name(compression) + (zero_stage ? " zero " + std::to_string(zero_stage) : "") +
           (clip > 0 ? " clip" : "") + (lr_schedule ? " lr schedule" : "") + " on " + device.str();
  }
};

// DataParallel inside dist::Join: weights equal to the reference after every epoch, on every rank.
void uneven_data_parallel(comm::Communicator& comm, const UnevenCase& c);

// Horovod's join through the DistributedOptimizer: Average divides by the full world size,
// with backward_passes_per_step and (optionally) the bias as a sparse parameter.
void uneven_distributed_optimizer(comm::Communicator& comm, int passes, bool sparse_bias);

// throw_on_early_termination: every rank raises at the same step, the one in which the first
// rank ran out, and the ranks are still in step afterwards.
void join_throws_on_early_termination(comm::Communicator& comm);

}  // namespace gradsync::testing
