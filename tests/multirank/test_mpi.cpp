// MPI: the same collective checks as Gloo's, on processes started by mpirun (registered
// with -np 2 and -np 4), plus the debug-mode mismatch path.
#include <string>
#include <tuple>

#include "collectives.h"
#include "devices.h"
#include "dist.h"
#include "expectations.h"
#include "gradsync/comm/connect.h"
#include "gradsync/comm/mpi/mpi.h"
#include "gradsync/comm/nccl/nccl.h"
#include "join.h"
#include "models.h"
#include "optimizers.h"
#include "parameters.h"
#include "ranks_on_device.h"
#include "reproducible.h"
#include "hierarchical.h"
#include "split.h"
#include "test_util.h"
#include "zero.h"

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

// The device-parameterised suite (tests/scenarios/devices.h): host parameters, and CUDA parameters
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

// Reproducible mode over MPI: the same bits as the ascending-rank fold (and so as Gloo's), with
// both algorithms, whatever Open MPI would have chosen; DataParallel's buckets do not matter.
TEST(MpiReproducible, EveryReductionIsTheAscendingFold) {
  for (const char* algorithm : {"owner", "chain"}) {
    const testing::ScopedVariable variable("GRADSYNC_REPRODUCIBLE_ALGORITHM", algorithm);
    auto comm = comm::mpi_world({.reproducible = true});
    testing::reproducible_reductions(*comm, {0, 1, 7, 1000, 100003});
    const auto runs = testing::train_with_three_bucket_caps(*comm);
    EXPECT_TRUE(runs[0] == runs[1] && runs[0] == runs[2]) << algorithm << ": the bucket caps give other parameters";
  }
}

// Sub-communicators over MPI_Comm_split: the groups, every collective on them, and (with an even
// number of ranks) two axes in flight at once.
TEST(MpiSplit, GroupsOrdersAndEveryCollective) { testing::split_groups(world()); }
TEST(MpiSplit, TwoAxesInFlightAtOnce) {
  if (world().size() % 2 != 0) GTEST_SKIP() << "skipped: needs an even number of ranks";
  testing::two_axes(world());
}

// Hierarchical allreduce over MPI sub-communicators (MPI_Comm_split of the node groups), on
// simulated nodes: two round-robin nodes of two add in the hierarchy's order (and the flat
// algorithms do not); any even world as two nodes, the front ends included.
comm::CommOptions on_two_nodes(bool round_robin, comm::CommOptions::Hierarchy mode) {
  comm::CommOptions options;
  options.hierarchical = mode;
  options.node = testing::simulated_node(world().rank(), world().size(), 2, round_robin);
  return options;
}

TEST(MpiHierarchical, TwoNodesOfTwoAddInTheHierarchysOrder) {
  if (world().size() != 4) GTEST_SKIP() << "skipped: needs four ranks";
  auto hierarchical = comm::mpi_world(on_two_nodes(true, comm::CommOptions::Hierarchy::always));
  testing::hierarchical_values(*hierarchical, testing::Expect::pairwise_order);
  auto flat = comm::mpi_world(on_two_nodes(true, comm::CommOptions::Hierarchy::never));
  testing::hierarchical_values(*flat, testing::Expect::not_pairwise);
}

TEST(MpiHierarchical, FrontEndsOnTwoNodes) {
  if (world().size() % 2 != 0 || world().size() < 4) GTEST_SKIP() << "skipped: needs an even number of ranks, 4 or more";
  auto comm = comm::mpi_world(on_two_nodes(false, comm::CommOptions::Hierarchy::always));
  testing::hierarchical_values(*comm, testing::Expect::any_order);
  testing::hierarchical_front_ends(*comm);
}

TEST(MpiProcessSets, MembersReduceAloneAndEveryMistakeIsNamed) {
  if (world().size() < 3) GTEST_SKIP() << "skipped: needs three ranks";
  testing::process_sets(world());
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
// the N-ranks-equal-one-process equivalence). Parameterised tests run under mpirun as anywhere:
// every rank walks the same instances in the same order.
class MpiOptimizer : public ::testing::TestWithParam<std::string> {};
INSTANTIATE_TEST_SUITE_P(Kinds, MpiOptimizer, ::testing::Values("sgd", "adam"),
                         [](const auto& info) { return info.param; });
TEST_P(MpiOptimizer, EquivalenceWithSingleProcessTraining) {
  testing::equivalence_with_single_process(world(), GetParam());
}
TEST(MpiDist, ForceAllreduceWhenARankSkipsAParameter) { testing::force_allreduce_when_a_rank_skips_a_parameter(world()); }
TEST(MpiDist, AdasumMath) { testing::adasum_math(world()); }
TEST(MpiDist, DataParallelMissingGradient) { testing::data_parallel_missing_gradient(world()); }

class MpiStrategy : public ::testing::TestWithParam<dist::DDPSyncStrategy> {};
INSTANTIATE_TEST_SUITE_P(Strategies, MpiStrategy, ::testing::ValuesIn(testing::every_strategy()),
                         [](const auto& info) { return testing::strategy_name(info.param); });
class MpiExplicitStrategy : public ::testing::TestWithParam<dist::DDPSyncStrategy> {};
INSTANTIATE_TEST_SUITE_P(Strategies, MpiExplicitStrategy, ::testing::ValuesIn(testing::explicit_strategies()),
                         [](const auto& info) { return testing::strategy_name(info.param); });
TEST_P(MpiExplicitStrategy, DataParallelEquivalence) { testing::data_parallel_equivalence(world(), GetParam()); }
// Uneven inputs on processes (docs/join.md): every strategy, both division rules.
TEST_P(MpiStrategy, JoinUnevenInputsAdamFindUnused) {
  testing::uneven_data_parallel(world(), {.optimizer = "adam", .strategy = GetParam(), .find_unused_parameters = true});
}
TEST_P(MpiStrategy, JoinUnevenInputsDividedByTheActiveRanks) {
  testing::uneven_data_parallel(world(), {.strategy = GetParam(), .divide_by_initial_world_size = false});
}
TEST(MpiJoin, DistributedOptimizerJoin) { testing::uneven_distributed_optimizer(world(), 2, /*sparse_bias=*/true); }
TEST(MpiJoin, ThrowOnEarlyTermination) { testing::join_throws_on_early_termination(world()); }

class MpiHorovodZero : public ::testing::TestWithParam<std::tuple<std::string, int>> {};
INSTANTIATE_TEST_SUITE_P(Cases, MpiHorovodZero,
                         ::testing::Combine(::testing::Values("sgd", "adam"), ::testing::Values(1, 2)),
                         [](const auto& info) {
                           return testing::name(std::get<0>(info.param), std::to_string(std::get<1>(info.param)) + "_passes");
                         });
TEST_P(MpiHorovodZero, DistributedOptimizerFrontEnd) {
  for (const dist::Compression compression : {dist::Compression::none, dist::Compression::fp16}) {
    testing::horovod_zero_matches_unsharded(
        world(), {.optimizer = std::get<0>(GetParam()), .passes = std::get<1>(GetParam()), .compression = compression});
  }
}

// ZeRO on processes (docs/zero.md): stages 1-3 against unsharded DataParallel.
class MpiZero : public ::testing::TestWithParam<std::tuple<int, std::string>> {};
INSTANTIATE_TEST_SUITE_P(Cases, MpiZero, ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values("sgd", "adamw")),
                         [](const auto& info) {
                           return testing::name("stage" + std::to_string(std::get<0>(info.param)), std::get<1>(info.param));
                         });
TEST_P(MpiZero, MatchesUnshardedDataParallel) {
  const auto& [stage, optimizer] = GetParam();
  testing::zero_matches_unsharded(world(), {.stage = stage, .optimizer = optimizer, .find_unused_parameters = true});
  testing::zero_matches_unsharded(world(), {.stage = stage, .optimizer = optimizer,
                                            .strategy = dist::DDPSyncStrategy::forced_sync, .dtype = DType::bf16});
}

}  // namespace gradsync
