// MPI: the same collective checks as Gloo's, on processes started by mpirun (registered
// with -np 2 and -np 4), plus the debug-mode mismatch path.
#include "gradsync/comm/mpi.h"

#include "comm_checks.h"
#include "device_scenarios.h"
#include "dist_scenarios.h"
#include "gradsync/comm/connect.h"
#include "gradsync/comm/nccl.h"
#include "join_scenarios.h"
#include "zero_scenarios.h"

namespace gradsync {
namespace {

comm::Communicator& world() {
  static std::unique_ptr<comm::Communicator> communicator = comm::mpi_world();
  return *communicator;
}

TEST(Mpi, LaunchedByMpirun) {
  EXPECT_TRUE(comm::launched_by_mpi());
  EXPECT_STREQ(world().backend(), "mpi");
  EXPECT_GE(world().size(), 1);
}

// 100003 elements: chunks of unequal size in the ring allreduce.
TEST(Mpi, EveryCollectiveEveryDType) { testing::check_collectives(world(), {0, 1, 7, 100003, 1 << 20}); }

TEST(Mpi, ManyInFlightOperationsCompleteInOrder) {
  comm::Communicator& comm = world();
  std::vector<Tensor> tensors;
  std::vector<comm::WorkHandle> works;
  for (int k = 0; k < 32; ++k) {
    tensors.push_back(testing::filled(100 + k, DType::f64, [&](std::int64_t) { return comm.rank() + k; }));
    works.push_back(comm.allreduce_async(tensors.back(), comm::ReduceOp::max));
  }
  works.back()->wait();
  for (int k = 0; k < 32; ++k) {
    works[static_cast<std::size_t>(k)]->wait();
    EXPECT_EQ(tensors[static_cast<std::size_t>(k)].to_double_vector()[0], comm.size() - 1 + k);
  }
}

// The device-parameterised suite (device_scenarios.h): host parameters, and CUDA parameters
// staged through MPI (every rank on the GPU of its local rank; 2 to 4 ranks may share one).
TEST(MpiDevices, HostParameters) { testing::all_device_scenarios(world(), Device::cpu()); }

Device my_gpu() {
  const int devices = cuda_device_count();
  return Device::cuda(devices > 0 ? comm::local_rank_from_environment(world().rank()) % devices : 0);
}

TEST(MpiDevices, CudaParametersStagedThroughMpi) {
  GRADSYNC_SKIP_UNLESS_USABLE(Device::cuda(0));
  testing::all_device_scenarios(world(), my_gpu());
  testing::check_collectives(world(), {0, 1, 7, 100003}, {DType::f32, DType::bf16, DType::i64}, my_gpu());
}

// NCCL with one rank per GPU, bootstrapped over MPI: registered as `mpirun -np 2`, and run by
// scripts/gpu_check.sh with -np G on a machine with G >= 2 GPUs. NCCL refuses two ranks on
// one GPU, so with fewer GPUs than ranks this skips, saying so.
TEST(NcclOverMpi, EveryScenarioWithOneRankPerGpu) {
  const int devices = cuda_device_count();
  if (devices < world().size() || !comm::nccl_available()) {
    GTEST_SKIP() << "skipped: NCCL needs one GPU per rank: " << world().size() << " ranks, " << devices
                 << " usable GPU(s)" << (devices == 0 ? " (" + cuda_unavailable_reason() + ")" : std::string());
  }
  auto nccl = comm::nccl_communicator(world(), {.timeout = std::chrono::milliseconds(60000)}, -1);
  const Device gpu = nccl->device_type();
  testing::check_collectives(*nccl, {0, 1, 7, 100003, 1 << 20});
  testing::all_device_scenarios(*nccl, gpu);
}

TEST(NcclOverMpi, ARankThatSkipsACollectiveTimesOutAndAborts) {
  const int devices = cuda_device_count();
  if (devices < world().size() || !comm::nccl_available()) {
    GTEST_SKIP() << "skipped: NCCL needs one GPU per rank: " << world().size() << " ranks, " << devices << " usable GPU(s)";
  }
  auto nccl = comm::nccl_communicator(world(), {.timeout = std::chrono::milliseconds(10000)}, -1);
  testing::a_rank_that_skips_a_collective(*nccl);
  world().barrier();  // the MPI world is untouched
}

// Runs last (gtest keeps declaration order): the mismatch leaves this communicator broken.
TEST(Mpi, ZZDebugModeReportsAMismatch) {
  auto comm = comm::mpi_world({.timeout = std::chrono::milliseconds(20000), .check_agreement = true});
  if (comm->size() < 2) GTEST_SKIP() << "skipped: needs two ranks";
  Tensor t = Tensor::zeros({comm->rank() == 0 ? 5 : 6}, DType::f32);
  EXPECT_GRADSYNC_ERROR(comm->allreduce(t, comm::ReduceOp::sum), "collective mismatch", "allreduce #0 (sum), f32 x 5",
                        "allreduce #0 (sum), f32 x 6");
}

// Without debug mode too: the always-on fingerprint check turns what would be MPI_ERR_TRUNCATE
// (a job abort) into our error on every rank.
TEST(Mpi, ZZDefaultPathReportsAMismatch) {
  auto comm = comm::mpi_world({.timeout = std::chrono::milliseconds(20000)});
  if (comm->size() < 2) GTEST_SKIP() << "skipped: needs two ranks";
  Tensor t = Tensor::zeros({comm->rank() == 0 ? 5 : 6}, DType::f32);
  EXPECT_GRADSYNC_ERROR(comm->allreduce(t, comm::ReduceOp::sum), "collective mismatch", "allreduce #0 (sum), f32 x 5",
                        "allreduce #0 (sum), f32 x 6");
}

}  // namespace
// Reducers sharing one MPI communicator, random per-rank ready orders.
TEST(MpiDist, RandomReadyOrdersAcrossReducers) { testing::random_ready_orders_across_reducers(world(), 3, 100); }
// The dist layer's main scenarios, on processes (docs/semantics/horovod.md items 19, 39-42, and
// the N-ranks-equal-one-process equivalence).
TEST(MpiDist, EquivalenceWithSingleProcessTraining) { testing::equivalence_with_single_process(world()); }
TEST(MpiDist, ForceAllreduceWhenARankSkipsAParameter) { testing::force_allreduce_when_a_rank_skips_a_parameter(world()); }
TEST(MpiDist, AdasumMath) { testing::adasum_math(world()); }
TEST(MpiDist, DataParallelEquivalence) { testing::data_parallel_equivalence(world()); }
TEST(MpiDist, DataParallelMissingGradient) { testing::data_parallel_missing_gradient(world()); }
// Uneven inputs on processes (docs/join.md): every strategy, both division rules.
TEST(MpiJoin, DataParallelUnevenInputs) {
  for (const dist::DDPSyncStrategy strategy : {dist::DDPSyncStrategy::single_auto_sync, dist::DDPSyncStrategy::multi_auto_sync,
                                               dist::DDPSyncStrategy::forced_sync, dist::DDPSyncStrategy::auto_select}) {
    testing::uneven_data_parallel(world(), {.optimizer = "adam", .strategy = strategy, .find_unused_parameters = true});
    testing::uneven_data_parallel(world(), {.strategy = strategy, .divide_by_initial_world_size = false});
  }
}
TEST(MpiJoin, DistributedOptimizerJoin) { testing::uneven_distributed_optimizer(world(), 2, /*sparse_bias=*/true); }
TEST(MpiJoin, ThrowOnEarlyTermination) { testing::join_throws_on_early_termination(world()); }
TEST(MpiZero, DistributedOptimizerFrontEnd) { testing::horovod_zero_matches_unsharded(world()); }
// ZeRO on processes (docs/zero.md): both stages against unsharded DataParallel.
TEST(MpiZero, MatchesUnshardedDataParallel) {
  for (const int stage : {1, 2}) {
    for (const std::string optimizer : {"sgd", "adamw"}) {
      testing::zero_matches_unsharded(world(), {.stage = stage, .optimizer = optimizer, .find_unused_parameters = true});
      testing::zero_matches_unsharded(world(), {.stage = stage, .optimizer = optimizer,
                                                .strategy = dist::DDPSyncStrategy::forced_sync, .dtype = DType::bf16});
    }
  }
}

}  // namespace gradsync
