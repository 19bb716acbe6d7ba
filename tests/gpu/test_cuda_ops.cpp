// The gpu suite: the same operation checks as the CPU suite, on cuda:0, plus cross-device
// copies, registry arenas on the GPU, and checkpoints of GPU parameters. Every test skips
// with a one-line reason when no CUDA device can be used (this includes builds without CUDA).
#include <cstring>

#include "gradsync/io/registry_checkpoint.h"
#include "expectations.h"
#include "ops.h"
#include "test_util.h"
#include "gradsync/kernels/ops.h"

namespace gradsync {
namespace {

class Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "skipped: " << cuda_unavailable_reason();
  }
};

TEST_F(Gpu, AllOpsAllDTypesAwkwardSizes) { testing::check_all_ops(Device::cuda(0)); }

TEST_F(Gpu, CopiesBetweenHostAndDevicePreserveBits) {
  for (DType dtype : testing::all_dtypes()) {
    const Tensor host = testing::random_tensor(4097, dtype, 77);
    const Tensor device = host.to(Device::cuda(0));
    EXPECT_EQ(device.device(), Device::cuda(0));
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(device.data()) % 256, 0u);
    const Tensor device_copy = device.clone();
    const Tensor back = device_copy.to(Device::cpu());
    EXPECT_EQ(std::memcmp(back.data(), host.data(), host.nbytes()), 0) << dtype_name(dtype);
    // A view into device memory at an offset copies just its range.
    const Tensor middle = device.view(100, {10}).to(Device::cpu());
    EXPECT_EQ(std::memcmp(middle.data(), host.view(100, {10}).data(), middle.nbytes()), 0);
  }
}

TEST_F(Gpu, CastIsBitIdenticalToTheHost) {
  // Every f16 and bf16 pattern, widened on the device, and narrowed back.
  for (DType dtype : {DType::f16, DType::bf16}) {
    Tensor patterns = Tensor::empty({65536}, dtype);
    auto* bits = static_cast<std::uint16_t*>(patterns.data());
    for (int i = 0; i < 65536; ++i) bits[i] = static_cast<std::uint16_t>(i);
    const Tensor widened_device = patterns.to(Device::cuda(0)).to(DType::f32).to(Device::cpu());
    const Tensor widened_host = patterns.to(DType::f32);
    EXPECT_EQ(std::memcmp(widened_device.data(), widened_host.data(), widened_host.nbytes()), 0) << dtype_name(dtype);
  }
  const Tensor random = testing::random_tensor(1 << 20, DType::f32, 3, 70000.0);
  for (DType dtype : {DType::f16, DType::bf16}) {
    const Tensor narrowed_device = random.to(Device::cuda(0)).to(dtype).to(Device::cpu());
    const Tensor narrowed_host = random.to(dtype);
    EXPECT_EQ(std::memcmp(narrowed_device.data(), narrowed_host.data(), narrowed_host.nbytes()), 0)
        << dtype_name(dtype);
  }
}

TEST_F(Gpu, RegistryArenasAndCheckpointsOnTheDevice) {
  testing::TempDir folder;
  ParameterRegistry registry;
  registry.add("gpu.w", {3, 5}, DType::f32, Device::cuda(0));
  registry.add("cpu.b", {5}, DType::f32, Device::cpu());
  registry.finalize();
  ASSERT_EQ(registry.arenas().size(), 2u) << "one arena per (device, dtype)";
  Parameter& w = registry.at("gpu.w");
  w.value().copy_from(testing::random_tensor(15, DType::f32, 9).reshape({3, 5}));
  w.accumulate_grad(testing::random_tensor(15, DType::f32, 10));  // host gradient into a device buffer
  w.accumulate_grad(testing::random_tensor(15, DType::f32, 10).to(Device::cuda(0)));
  const std::vector<double> expected_grad = [] {
    std::vector<double> g = testing::random_tensor(15, DType::f32, 10).to_double_vector();
    for (double& v : g) v *= 2;
    return g;
  }();
  testing::expect_close("accumulated device gradient", w.grad(), expected_grad);

  io::save_registry(registry, folder / "gpu.safetensors", {.include_grads = true, .metadata = {}});
  ParameterRegistry restored;
  restored.add("gpu.w", {3, 5}, DType::f32, Device::cuda(0));
  restored.add("cpu.b", {5}, DType::f32, Device::cpu());
  restored.finalize();
  io::load_registry(restored, folder / "gpu.safetensors", {.load_grads = true, .allow_extra_tensors = false});
  EXPECT_EQ(restored.at("gpu.w").value().to_double_vector(), w.value().to_double_vector());
  EXPECT_EQ(restored.at("gpu.w").grad().to_double_vector(), w.grad().to_double_vector());
  EXPECT_FALSE(restored.at("cpu.b").grad_defined());
}

TEST_F(Gpu, MixingDevicesIsAClearError) {
  Tensor host = Tensor::zeros({4}, DType::f32);
  Tensor device = Tensor::zeros({4}, DType::f32, Device::cuda(0));
  EXPECT_GRADSYNC_ERROR(ops::axpy(1.0, host, device), "axpy", "device mismatch", "cuda:0");
  EXPECT_GRADSYNC_ERROR(ops::cast(host, device), "cast", "different devices");
}

}  // namespace
}  // namespace gradsync
