// The nn layers: gradients against central finite differences (f64), the readiness order a
// data-parallel wrapper relies on, PyTorch's initialization bounds, the losses' values, errors.
#include <gtest/gtest.h>

#include <cmath>

#include "gradsync/nn/layers.h"
#include "gradsync/nn/loss.h"
#include "test_util.h"

namespace gradsync {
namespace {

struct Mlp {
  ParameterRegistry registry;
  nn::Sequential model{registry};
  Mlp() {
    model.add<nn::Linear>("fc1", 5, 7, DType::f64);
    model.add<nn::ReLU>();
    model.add<nn::Linear>("fc2", 7, 3, DType::f64);
    model.initialize(42);
  }
};

Tensor inputs() {
  std::vector<double> x;
  for (int i = 0; i < 4 * 5; ++i) x.push_back(std::sin(0.7 * i) + 0.1);
  return Tensor::from_vector(x, {4, 5});
}

Tensor labels() { return Tensor::from_vector(std::vector<double>{0, 2, 1, 2}, {4}).to(DType::i64); }

TEST(Nn, GradientsMatchFiniteDifferences) {
  for (const bool classification : {true, false}) {
    Mlp mlp;
    const Tensor x = inputs();
    const Tensor target = Tensor::from_vector(std::vector<double>{0.5, -1, 2, 0, 1, 1, -0.5, 0.25, 3, 1, 0, -2}, {4, 3});
    const auto loss_of = [&](bool with_backward) {
      Tensor out = mlp.model.forward(x);
      nn::LossResult result = classification ? nn::softmax_cross_entropy(out, labels()) : nn::mse_loss(out, target);
      if (with_backward) mlp.model.backward(result.grad);
      return result.loss;
    };
    loss_of(true);
    for (Parameter& parameter : mlp.registry) {
      const std::vector<double> analytic = parameter.grad().to_double_vector();
      for (std::int64_t i = 0; i < parameter.numel(); ++i) {
        double* value = parameter.value().data_as<double>() + i;
        const double saved = *value;
        const double h = 1e-6;
        *value = saved + h;
        const double up = loss_of(false);
        *value = saved - h;
        const double down = loss_of(false);
        *value = saved;
        const double numeric = (up - down) / (2 * h);
        EXPECT_NEAR(analytic[static_cast<std::size_t>(i)], numeric, 1e-7 + 1e-6 * std::abs(numeric))
            << (classification ? "xent " : "mse ") << parameter.name() << "[" << i << "]";
      }
    }
  }
}

TEST(Nn, BackwardAccumulatesAndSignalsLastLayerFirst) {
  Mlp mlp;
  std::vector<std::string> order;
  auto subscription = mlp.registry.on_ready([&](Parameter& p) { order.push_back(p.name()); });
  for (int pass = 0; pass < 2; ++pass) {
    Tensor out = mlp.model.forward(inputs());
    mlp.model.backward(nn::softmax_cross_entropy(out, labels()).grad);
  }
  EXPECT_EQ(order, (std::vector<std::string>{"fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight",
                                             "fc1.bias", "fc1.weight"}));
  // Two identical passes accumulate twice the gradient of one.
  const std::vector<double> twice = mlp.registry.at("fc1.weight").grad().to_double_vector();
  mlp.registry.zero_grad();
  Tensor out = mlp.model.forward(inputs());
  mlp.model.backward(nn::softmax_cross_entropy(out, labels()).grad);
  const std::vector<double> once = mlp.registry.at("fc1.weight").grad().to_double_vector();
  for (std::size_t i = 0; i < once.size(); ++i) EXPECT_NEAR(twice[i], 2 * once[i], 1e-12);
}

TEST(Nn, InitializationFollowsPyTorchBoundsAndTheSeed) {
  Mlp a;
  Mlp b;
  const std::vector<double> w = a.registry.at("fc1.weight").value().to_double_vector();
  EXPECT_EQ(w, b.registry.at("fc1.weight").value().to_double_vector());  // same seed, same values
  const double bound = 1 / std::sqrt(5.0);
  double largest = 0;
  for (double v : w) largest = std::max(largest, std::abs(v));
  EXPECT_LE(largest, bound);
  EXPECT_GT(largest, 0.5 * bound);
}

TEST(Nn, LossValuesAndErrors) {
  // Uniform logits: cross-entropy log(3); MSE of a constant difference 1: 1.
  Tensor logits = Tensor::zeros({2, 3}, DType::f32);
  nn::LossResult xent = nn::softmax_cross_entropy(logits, Tensor::from_vector(std::vector<double>{0, 1}, {2}).to(DType::i64));
  EXPECT_NEAR(xent.loss, std::log(3.0), 1e-12);
  nn::LossResult mse = nn::mse_loss(Tensor::zeros({2, 2}, DType::f32), Tensor::from_vector(std::vector<float>(4, 1.0f), {2, 2}));
  EXPECT_NEAR(mse.loss, 1.0, 1e-12);
  EXPECT_NEAR(mse.grad.to_double_vector()[0], -2.0 / 2 / 2, 1e-7);  // 2 d / features / batch
  EXPECT_GRADSYNC_ERROR(nn::softmax_cross_entropy(logits, Tensor::from_vector(std::vector<double>{0, 5}, {2}).to(DType::i64)),
                        "label 5", "3 classes");
  Mlp mlp;
  EXPECT_GRADSYNC_ERROR(mlp.model.forward(Tensor::zeros({4, 6}, DType::f64)), "Linear forward", "[batch, 5]", "f64[4, 6]");
  EXPECT_GRADSYNC_ERROR(mlp.model.forward(Tensor::zeros({4, 5}, DType::f32)), "expected f64");
}

}  // namespace
}  // namespace gradsync
