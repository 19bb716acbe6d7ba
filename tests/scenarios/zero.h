// ZeRO (dist/zero.h), written once against a Communicator: run on Gloo ranks-as-threads
// (multirank/test_zero.cpp, 2-4 ranks), on MPI processes (multirank/test_mpi.cpp) and with the
// parameters on a GPU (test_devices.cpp). Each scenario trains the same model twice, unsharded
// and sharded, on the same data, and compares the weights.
#pragma once

#include <optional>
#include <string>

#include "gradsync/comm/communicator.h"
#include "gradsync/dist/data_parallel/sync_strategy.h"

namespace gradsync::testing {

struct ZeroCase {
  int stage = 1;
  std::string optimizer = "adam";  // sgd (momentum, weight decay) | adam | adamw
  dist::DDPSyncStrategy strategy = dist::DDPSyncStrategy::single_auto_sync;
  bool find_unused_parameters = false;  // then "bias" is skipped by some ranks at some steps
  std::optional<double> bucket_cap_mb = 1e-6;  // unset: DDP's default buckets (one here)
  DType dtype = DType::f32;  // bf16: 16-bit model with f32 master weights
  double clip = 0;           // clip to this global norm before each step (0: off)
  int steps = 6;
  Device device = Device::cpu();  // where the parameters live (devices.h runs cuda too)
  std::string describe() const {
    return "stage " + std::to_string(stage) + " " + optimizer + " " + dist::sync_strategy_name(strategy) +
           (find_unused_parameters ? " unused" : "") + (bucket_cap_mb ? " small buckets" : " one bucket") + " " +
           dtype_name(dtype) + (clip > 0 ? " clip" : "") + " on " + device.str();
  }
};

// The DistributedOptimizer front end (zero_stage) against itself unsharded.
struct HorovodZeroCase {
  std::string optimizer = "sgd";  // sgd | adam
  int passes = 1;                 // backward_passes_per_step
  dist::Compression compression = dist::Compression::none;
  std::string describe() const {
    return optimizer + " passes " + std::to_string(passes) + " " + dist::compression_name(compression);
  }
};

// ZeRO's weights equal unsharded DataParallel's: bitwise for stage 1 without clipping or AUTO (AUTO
// may time its trials differently in the two runs and pick another strategy; the same
// allreduce, an element-wise update), within 1e-6 relative otherwise; every replica the same.
// Stage 3 makes each parameter a unit (the first two one unit), gathered for the backward.
void zero_matches_unsharded(comm::Communicator& comm, const ZeroCase& c);

// Stages 1 and 2 against unsharded, clipping before each step: within 1e-6 (the clipping norm
// sums its pieces in another order, even at stage 1), 1e-3 with fp16 compression.
void horovod_zero_matches_unsharded(comm::Communicator& comm, const HorovodZeroCase& c);

}  // namespace gradsync::testing
