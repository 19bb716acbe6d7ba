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

}  // namespace
}  // namespace gradsync
