// The device-parameterised suite (tests/scenarios/devices.h) on Gloo ranks-as-threads:
// worlds of 1 to 4 ranks, with parameters on the host and on the GPU. CUDA parameters travel
// through Gloo staged in pinned host memory, so 2 to 4 ranks share one GPU here: the only way
// to run the multi-rank logic on device tensors on a machine with one GPU. The cuda instances
// skip, saying why, where no GPU is usable. (NCCL runs the same suite in gpu/test_nccl.cpp,
// MPI in multirank/test_mpi.cpp.)
#include <tuple>

#include "collectives.h"
#include "devices.h"
#include "dist.h"
#include "expectations.h"
#include "gradsync/comm/connect.h"
#include "gradsync/comm/gloo/gloo.h"
#include "gradsync/comm/nccl/nccl.h"
#include "models.h"
#include "optimizers.h"
#include "parameters.h"
#include "ranks_on_device.h"
#include "test_util.h"

namespace gradsync {
namespace {

class DeviceWorld : public testing::RanksOnDevice {};
INSTANTIATE_TEST_SUITE_P(GlooRanks, DeviceWorld,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Values("cpu", "cuda")),
                         testing::RanksOnDevice::name);

class DeviceWorldStrategy : public testing::RanksOnDeviceWith<dist::DDPSyncStrategy> {};
INSTANTIATE_TEST_SUITE_P(GlooRanks, DeviceWorldStrategy,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Values("cpu", "cuda"),
                                            ::testing::ValuesIn(testing::every_strategy())),
                         DeviceWorldStrategy::name);

TEST_P(DeviceWorldStrategy, StrategySet) {
  on_gloo_ranks([strategy = extra()](comm::Communicator& comm, Device device) {
    testing::ddp_strategy_set(comm, device, strategy);
  });
}

class DeviceWorldExplicitStrategy : public testing::RanksOnDeviceWith<dist::DDPSyncStrategy> {};
INSTANTIATE_TEST_SUITE_P(GlooRanks, DeviceWorldExplicitStrategy,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Values("cpu", "cuda"),
                                            ::testing::ValuesIn(testing::explicit_strategies())),
                         DeviceWorldExplicitStrategy::name);

TEST_P(DeviceWorldExplicitStrategy, DataParallelEquivalence) {
  on_gloo_ranks([strategy = extra()](comm::Communicator& comm, Device device) {
    testing::data_parallel_equivalence(comm, strategy, device);
  });
}

TEST_P(DeviceWorld, UnusedNoSyncSynchronizeAllHookCompression) {
  on_gloo_ranks(testing::ddp_unused_no_sync_hook_compression);
}

TEST_P(DeviceWorld, DistributedOptimizerOptions) { on_gloo_ranks(testing::distributed_optimizer_options); }

TEST_P(DeviceWorld, TrainingEquivalence) {
  on_gloo_ranks([](comm::Communicator& comm, Device device) {
    for (const std::string kind : {"sgd", "adam"}) testing::equivalence_with_single_process(comm, kind, device);
  });
}

TEST_P(DeviceWorld, MissingGradientsAndReadyOrders) {
  on_gloo_ranks([](comm::Communicator& comm, Device device) {
    testing::force_allreduce_when_a_rank_skips_a_parameter(comm, device);
    testing::data_parallel_missing_gradient(comm, device);
    testing::random_ready_orders_across_reducers(comm, 3, 20, device);
  });
}

TEST_P(DeviceWorld, ZeroAndJoin) { on_gloo_ranks(testing::zero_and_join); }

// The collectives themselves on device tensors (staged), beside the host ones.
TEST_P(DeviceWorld, EveryCollectiveOnDeviceTensors) {
  on_gloo_ranks([](comm::Communicator& comm, Device device) {
    testing::check_collectives(comm, {0, 1, 7, 1000, 1 << 18}, {DType::f32, DType::bf16, DType::i64}, device);
  });
}

// The failure path with device tensors in flight: a rank skips a collective; the staged
// operations behind the one that timed out fail too, naming it.
TEST_P(DeviceWorld, ARankThatSkipsACollectiveBreaksEveryRankClearly) {
  if (world() < 2) GTEST_SKIP() << "skipped: needs two ranks";
  on_gloo_ranks([](comm::Communicator& comm, Device device) { testing::a_rank_that_skips_a_collective(comm, device); },
                {.timeout = std::chrono::milliseconds(1000)});
}

// NCCL with one rank per GPU, the ranks started by scripts/launch.sh (torchrun-style
// variables; scripts/gpu_check.sh uses it where the machine has no mpirun, and
// multirank/test_mpi.cpp's NcclOverMpi where it has).
TEST(NcclRanks, EveryScenarioWithOneRankPerGpu) {
  if (std::getenv("WORLD_SIZE") == nullptr) GTEST_SKIP() << "skipped: run by scripts/launch.sh G (one rank per GPU)";
  auto bootstrap = comm::connect("gloo");
  const int devices = cuda_device_count();
  if (devices < bootstrap->size() || !comm::nccl_available()) {
    GTEST_SKIP() << "skipped: NCCL needs one GPU per rank: " << bootstrap->size() << " ranks, " << devices
                 << " usable GPU(s)";
  }
  auto nccl = comm::nccl_communicator(*bootstrap, {.timeout = std::chrono::milliseconds(60000)}, -1);
  testing::check_collectives(*nccl, {0, 1, 7, 100003, 1 << 20});
  testing::all_device_scenarios(*nccl, nccl->device_type());
  auto doomed = comm::nccl_communicator(*bootstrap, {.timeout = std::chrono::milliseconds(10000)}, -1);
  testing::a_rank_that_skips_a_collective(*doomed);
}

}  // namespace
}  // namespace gradsync
