// The torch.optim trajectories on cuda:0: GPU results match PyTorch (the same tolerances as
// on the CPU) and the CPU results. Skips with the reason when no CUDA device is usable.
#include "optimizer_cases.h"

namespace gradsync {
namespace {

TEST(GpuOptimizers, TrajectoriesMatchTorchAndTheCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "skipped: " << cuda_unavailable_reason();
  const testing::TrajectoryFile data;
  for (const testing::OptimizerCase& c : data.cases()) {
    auto gpu_registry = testing::make_case_registry(data, c, Device::cuda(0));
    auto gpu = testing::make_case_optimizer(c, *gpu_registry);
    testing::run_case_steps(data, c, *gpu_registry, *gpu, 0, data.steps());
    testing::expect_case_matches(data, c, *gpu_registry, *gpu, testing::torch_tolerance(c.dtype));

    auto cpu_registry = testing::make_case_registry(data, c, Device::cpu());
    auto cpu = testing::make_case_optimizer(c, *cpu_registry);
    testing::run_case_steps(data, c, *cpu_registry, *cpu, 0, data.steps());
    for (std::size_t i = 0; i < cpu_registry->size(); ++i) {
      // The kernels use explicitly rounded operations (no contraction), so the GPU should
      // agree with the CPU to the bit; the check allows the specified tolerance and the gpu
      // run reports any difference.
      testing::expect_matches_torch(c.name + " gpu vs cpu", (*gpu_registry)[i].value(), (*cpu_registry)[i].value(),
                                    testing::torch_tolerance(c.dtype));
    }
  }
}

// ZeRO's sharded step on the GPU: the kernels on shifted device pointers, three shards
// together matching torch.
TEST(GpuOptimizers, ShardedOptimizersTogetherMatchTorch) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "skipped: " << cuda_unavailable_reason();
  const testing::TrajectoryFile data;
  for (const testing::OptimizerCase& c : data.cases()) {
    testing::run_sharded_case(data, c, Device::cuda(0), testing::torch_tolerance(c.dtype));
  }
}

}  // namespace
}  // namespace gradsync

#include "mixed_precision_cases.h"

namespace gradsync {
namespace {

// Mixed precision on cuda:0: the master-weight and GradScaler trajectories, bit for bit what
// the CPU kernels give (the same element arithmetic, the same f16/bf16 rounding functions), and
// therefore as close to PyTorch as the CPU is (tests/unit/test_mixed_precision.cpp).
TEST(GpuOptimizers, MixedPrecisionMatchesTheCpuBitwise) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "skipped: " << cuda_unavailable_reason();
  const testing::MixedFile data;
  for (const testing::MixedCase& c : data.cases()) {
    std::unique_ptr<ParameterRegistry> registries[2];
    std::unique_ptr<optim::Optimizer> optimizers[2];
    const Device devices[2] = {Device::cuda(0), Device::cpu()};
    for (int d = 0; d < 2; ++d) {
      registries[d] = testing::make_mixed_registry(data, c, devices[d]);
      optimizers[d] = testing::make_mixed_optimizer(c, *registries[d]);
      if (c.kind == "master") {
        testing::run_master_steps(data, c, *registries[d], *optimizers[d], 0, data.steps());
      } else {
        optim::GradScaler scaler(testing::fixture_scaler_options(c));
        testing::run_scaler_steps(data, c, *registries[d], *optimizers[d], scaler);
      }
    }
    // With clipping the total norm is summed in another order on the GPU (in double): its f32
    // coefficient can differ in the last bit, so that case is held to f32 rounding instead.
    const double master_tolerance = c.clip > 0 ? 1e-6 : 0.0;
    const double model_tolerance = c.clip > 0 ? 1.0 / 1024 : 0.0;
    for (std::size_t i = 0; i < registries[1]->size(); ++i) {
      const Parameter& gpu = (*registries[0])[i];
      const Parameter& cpu = (*registries[1])[i];
      testing::expect_close(c.name + " model gpu vs cpu", gpu.value(), cpu.value(), model_tolerance);
      const Tensor gpu_master = optimizers[0]->master_weight(gpu);
      if (gpu_master.defined()) {
        testing::expect_close(c.name + " master gpu vs cpu", gpu_master, optimizers[1]->master_weight(cpu),
                              master_tolerance);
      }
    }
  }
}

}  // namespace
}  // namespace gradsync
