// The NCCL communicator on one GPU (world size 1: NCCL refuses two ranks on one device; the
// multi-rank logic above the Communicator interface is proven on the CPU backends). Every
// test skips with the reason when NCCL or a GPU is missing.
#include <gtest/gtest.h>

#include <chrono>

#include "collectives.h"
#include "devices.h"
#include "dist.h"
#include "expectations.h"
#include "gradsync/comm/connect.h"
#include "gradsync/comm/quorum/coordinator.h"
#include "gradsync/comm/gloo/gloo.h"
#include "gradsync/comm/nccl/nccl.h"
#include "gradsync/core/stream.h"
#include "gradsync/dist/data_parallel/data_parallel.h"
#include "gradsync/dist/horovod/distributed_optimizer.h"
#include "gradsync/dist/fault_tolerance/fault_tolerance.h"
#include "gradsync/optim/adam.h"
#include "models.h"
#include "optimizers.h"
#include "parameters.h"
#include "ranks_on_device.h"
#include "test_util.h"
#include "gradsync/kernels/ops.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;

class Nccl : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!comm::nccl_available()) GTEST_SKIP() << "skipped: " << comm::nccl_unavailable_reason();
  }
  // A world of one: the bootstrap needs no network.
  static std::unique_ptr<comm::Communicator> world(bool debug = false) {
    auto bootstrap = comm::gloo_tcp_store("127.0.0.1", 0, 0, 1);
    return comm::nccl_communicator(*bootstrap, {.timeout = 30000ms, .check_agreement = debug}, 0);
  }
};

TEST_F(Nccl, EveryCollectiveEveryDType) {
  auto comm = world();
  EXPECT_EQ(std::string(comm->backend()), "nccl");
  EXPECT_EQ(comm->device_type(), Device::cuda(0));
  testing::check_collectives(*comm, {0, 1, 7, 1000, 1 << 20});
}

// Every Reducer takes a duplicate (ncclCommSplit); it works on its own and the
// parent stays usable.
TEST_F(Nccl, DuplicateIsAnIndependentCommunicator) {
  auto comm = world();
  auto own = comm->duplicate();
  EXPECT_TRUE(own->broken_reason().empty());
  Tensor t = testing::filled(1000, DType::f32, [](std::int64_t j) { return static_cast<double>(j); }, Device::cuda(0));
  own->allreduce(t, comm::ReduceOp::sum);
  comm->allreduce(t, comm::ReduceOp::sum);
  EXPECT_EQ(t.to_double_vector()[999], 999.0);
}

// ncclCommSplit: a group of one works on its own, kNoColor gets nothing, and the parent goes on.
TEST_F(Nccl, SplitMakesAGroupAndKNoColorGetsNone) {
  auto comm = world();
  auto group = comm->split(3, 0);
  ASSERT_NE(group, nullptr);
  EXPECT_EQ(group->size(), 1);
  Tensor t = testing::filled(1000, DType::f32, [](std::int64_t j) { return static_cast<double>(j); }, Device::cuda(0));
  group->allreduce(t, comm::ReduceOp::sum);
  EXPECT_EQ(t.to_double_vector()[999], 999.0);
  EXPECT_EQ(comm->split(comm::Communicator::kNoColor, 0), nullptr);
  comm->allreduce(t, comm::ReduceOp::sum);
  EXPECT_EQ(t.to_double_vector()[999], 999.0);
}

TEST_F(Nccl, DebugModeAgreementCheckRuns) {
  auto comm = world(/*debug=*/true);
  testing::check_collectives(*comm, {1, 33}, {DType::f32, DType::bf16});
}

TEST_F(Nccl, ManyInFlightOperationsCompleteInOrder) {
  auto comm = world();
  std::vector<Tensor> tensors;
  std::vector<comm::WorkHandle> works;
  for (int i = 0; i < 64; ++i) {
    tensors.push_back(testing::filled(1000 + i, DType::f32, [i](std::int64_t j) { return static_cast<double>(i + j); },
                                      Device::cuda(0)));
    works.push_back(comm->allreduce_async(tensors.back(), comm::ReduceOp::sum));
  }
  works.back()->wait();  // a wait on the last one: the stream has run all the others first
  for (int i = 0; i < 64; ++i) {
    EXPECT_TRUE(works[static_cast<std::size_t>(i)]->is_completed()) << i;
    const auto values = tensors[static_cast<std::size_t>(i)].to_double_vector();
    EXPECT_EQ(values[5], i + 5.0);
  }
}

TEST_F(Nccl, OrderedAfterTheCallersStream) {
  // A kernel queued on the default stream before the allreduce must be visible to it.
  auto comm = world();
  Tensor t = Tensor::zeros({1 << 22}, DType::f32, Device::cuda(0));
  ops::fill(t, 3.0);
  comm->allreduce(t, comm::ReduceOp::max);
  EXPECT_EQ(t.to_double_vector()[(1 << 22) - 1], 3.0);
}

TEST_F(Nccl, WrongDeviceIsAClearError) {
  auto comm = world();
  Tensor host = Tensor::zeros({4}, DType::f32);
  EXPECT_GRADSYNC_ERROR(comm->allreduce(host, comm::ReduceOp::sum), "allreduce", "nccl",
                        "CPU tensors go through the MPI or Gloo backend");
  Tensor ints = Tensor::zeros({4}, DType::i32, Device::cuda(0));
  EXPECT_GRADSYNC_ERROR(comm->allreduce(ints, comm::ReduceOp::avg), "avg", "not defined for integers");
}

TEST_F(Nccl, HostControlPlaneCollectivesAreStaged) {
  auto comm = world();
  Tensor counts = Tensor::from_vector(std::vector<double>{3, 4}, {2}).to(DType::i64);
  comm->allreduce_host(counts, comm::ReduceOp::sum);
  EXPECT_EQ(counts.to_double_vector(), (std::vector<double>{3, 4}));
  Tensor gathered = Tensor::zeros({2}, DType::i64);
  comm->allgather_host(counts, gathered);
  EXPECT_EQ(gathered.to_double_vector(), (std::vector<double>{3, 4}));
  comm->broadcast_host(counts, 0);
  Tensor device = Tensor::zeros({2}, DType::i64, Device::cuda(0));
  EXPECT_GRADSYNC_ERROR(comm->allreduce_host(device, comm::ReduceOp::sum), "expects a host tensor");
}

// DataParallel and the DistributedOptimizer over CUDA parameters and NCCL (a world of one:
// the reductions run, through the same buckets, compression and status collective).
TEST_F(Nccl, DataParallelAndDistributedOptimizerOnTheGpu) {
  auto comm = world();
  ParameterRegistry registry;
  Parameter& w = registry.add("w", {1000}, DType::f32, Device::cuda(0));
  Parameter& unused = registry.add("unused", {10}, DType::f32, Device::cuda(0));
  registry.finalize();
  {
    dist::DataParallel ddp(registry, *comm, {.find_unused_parameters = true, .compression = dist::Compression::bf16});
    ddp.begin_backward();
    w.set_grad(Tensor::from_vector(std::vector<float>(1000, 0.5f), {1000}).to(Device::cuda(0)));
    registry.mark_ready(w);
    ddp.end_backward();
    EXPECT_EQ(w.grad().to_double_vector()[999], 0.5);
    EXPECT_FALSE(unused.grad_defined());
    EXPECT_EQ(ddp.last_used_counts(), (std::vector<int>{1, 0}));
  }
  registry.zero_grad();
  optim::Adam adam(registry, optim::Adam::Options{.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                                                   .weight_decay = 0.0, .amsgrad = false, .maximize = false});
  dist::broadcast_parameters(registry, *comm, 0);
  dist::broadcast_optimizer_state(adam, *comm, 0);
  dist::DistributedOptimizer optimizer(adam, *comm, {.compression = dist::Compression::fp16});
  w.set_grad(Tensor::from_vector(std::vector<float>(1000, 1.0f), {1000}).to(Device::cuda(0)));
  registry.mark_ready(w);
  optimizer.step();
  EXPECT_NEAR(w.value().to_double_vector()[0], -0.1, 1e-6);
}

// The whole device suite (tests/scenarios/devices.h) on NCCL with one rank: every strategy, every
// DistributedOptimizer option through the Reducer (reduce_with_one_rank), expected values that
// differ from the input.
TEST_F(Nccl, EveryDeviceScenarioAtWorldOne) {
  auto comm = world();
  testing::all_device_scenarios(*comm, Device::cuda(0));
}

// An engine computing on its own (non-blocking) stream: the collective waits for the kernel
// queued there, on NCCL and on Gloo (staged), and so does a tensor copy.
TEST_F(Nccl, CollectivesFollowTheEnginesOwnStream) {
  auto nccl = world();
  auto gloo = comm::gloo_tcp_store("127.0.0.1", 0, 0, 1);
  CudaStream stream(Device::cuda(0));
  CudaStreamScope scope(Device::cuda(0), stream.get());
  for (comm::Communicator* comm : {nccl.get(), gloo.get()}) {
    for (int round = 0; round < 5; ++round) {
      Tensor t = Tensor::zeros({1 << 24}, DType::f32, Device::cuda(0));
      ops::fill(t, 3.0 + round);  // queued on `stream`, a large kernel: still running when the collective is issued
      comm->allreduce(t, comm::ReduceOp::max);
      EXPECT_EQ(t.to_double_vector()[(1 << 24) - 1], 3.0 + round) << comm->backend();
    }
  }
}

TEST(NcclBackendChoice, AutoPicksNcclForCudaTensorsWhenAGpuIsThere) {
  if (!comm::nccl_available()) GTEST_SKIP() << "skipped: " << comm::nccl_unavailable_reason();
  EXPECT_EQ(comm::choose_backend("auto", Device::cuda(0)), "nccl");
  EXPECT_EQ(comm::choose_backend("auto", Device::cpu()) == "nccl", false);
}

// CUDA tensors on Gloo: staged through pooled page-locked buffers; the pool is reused.
TEST(GlooWithCudaTensors, AreStagedThroughPinnedPooledBuffers) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "skipped: " << cuda_unavailable_reason();
  auto comm = comm::gloo_tcp_store("127.0.0.1", 0, 0, 1);
  testing::check_collectives(*comm, {0, 1, 7, 1000, 1 << 20}, testing::all_dtypes(), Device::cuda(0));
  std::vector<Tensor> tensors;
  std::vector<comm::WorkHandle> works;
  for (int i = 0; i < 32; ++i) {  // many in flight: copies of later ones overlap earlier wires
    tensors.push_back(testing::filled(1000 + i, DType::f32, [i](std::int64_t j) { return static_cast<double>(i + j); },
                                      Device::cuda(0)));
    works.push_back(comm->allreduce_async(tensors.back(), comm::ReduceOp::sum));
  }
  for (int i = 0; i < 32; ++i) {
    works[static_cast<std::size_t>(i)]->wait();
    EXPECT_TRUE(works[static_cast<std::size_t>(i)]->is_completed());
    EXPECT_EQ(tensors[static_cast<std::size_t>(i)].to_double_vector()[7], i + 7.0);
  }
}

// Fault tolerance with NCCL across the groups (dist/fault_tolerance.h, cross_backend "nccl"):
// one replica group on one GPU (NCCL refuses two ranks on one device), its device gradients
// averaged over an NCCL communicator made for the quorum through its Gloo context, then a second
// incarnation of the group joining (a new quorum: the first NCCL communicator torn down, a new one
// made). Several groups need several GPUs: the protocol itself is tested on Gloo
// (test_fault_tolerance, fault_tolerance.sh).
TEST_F(Nccl, FaultToleranceAveragesDeviceGradientsOverNccl) {
  comm::CoordinatorOptions coordinator_options;
  coordinator_options.quiet = true;
  coordinator_options.token = "nccl-test";
  comm::Coordinator coordinator(coordinator_options);
  auto group = comm::gloo_tcp_store("127.0.0.1", 0, 0, 1);
  for (int incarnation = 0; incarnation < 2; ++incarnation) {
    ParameterRegistry registry;
    registry.add("w", {1000}, DType::f32, Device::cuda(0));
    registry.finalize();
    auto sgd = testing::make_test_optimizer("sgd", registry, {{"lr", 0.5}});
    dist::FaultToleranceOptions options;
    options.coordinator.port = coordinator.port();
    options.coordinator.token = "nccl-test";
    options.cross_backend = "nccl";
    options.cross_device = 0;
    dist::FaultTolerance ft(registry, sgd.get(), *group, options);
    for (int step = 0; step < 3; ++step) {
      ft.start_step();
      registry.at("w").set_grad(testing::filled(1000, DType::f32, [](std::int64_t) { return 2.0; }, Device::cuda(0)));
      ASSERT_TRUE(ft.average_gradients());
      ASSERT_TRUE(ft.should_commit());
      sgd->step();
      registry.zero_grad();
    }
    EXPECT_EQ(registry.at("w").value().to_double_vector()[999], -3.0);  // 0 - 3 x 0.5 x 2
  }
}

}  // namespace
}  // namespace gradsync
