// The nn layers on a CUDA device (cuBLAS and kernels) against the CPU (Eigen): the same
// forward, the same gradients, within f32 tolerance. Skips without a GPU.
#include <gtest/gtest.h>

#include "gradsync/core/device.h"
#include "gradsync/nn/layers.h"
#include "gradsync/nn/loss.h"
#include "test_util.h"

namespace gradsync {
namespace {

TEST(CudaNn, MatchesTheCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "skipped: " << cuda_unavailable_reason();
  std::vector<std::vector<double>> results[2];
  for (const Device device : {Device::cpu(), Device::cuda(0)}) {
    ParameterRegistry registry;
    nn::Sequential model(registry);
    model.add<nn::Linear>("fc1", 33, 65, DType::f32, device);
    model.add<nn::ReLU>();
    model.add<nn::Linear>("fc2", 65, 10, DType::f32, device);
    model.initialize(3);
    Tensor x = testing::random_tensor(17 * 33, DType::f32, 9).reshape({17, 33}).to(device);
    Tensor labels = Tensor::from_vector(std::vector<double>(17, 3.0), {17}).to(DType::i64);
    Tensor out = model.forward(x);
    model.backward(nn::softmax_cross_entropy(out, labels).grad);
    auto& r = results[device.is_cuda() ? 1 : 0];
    r.push_back(out.to_double_vector());
    for (const Parameter& p : registry) r.push_back(p.grad().to_double_vector());
  }
  for (std::size_t k = 0; k < results[0].size(); ++k) {
    for (std::size_t i = 0; i < results[0][k].size(); ++i) {
      EXPECT_NEAR(results[1][k][i], results[0][k][i], 1e-4 * std::max(1.0, std::abs(results[0][k][i]))) << k << "[" << i << "]";
    }
  }
}

}  // namespace
}  // namespace gradsync
