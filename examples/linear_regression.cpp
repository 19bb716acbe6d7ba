// linear_regression: the smallest complete training loop on gradsync's foundation.
//
// What it shows, top to bottom:
//   1. Parameters live in a ParameterRegistry: registered by name, then finalized into one
//      flat arena per (device, dtype). Each parameter is a view into that arena.
//   2. The "engine" (here, hand-written forward and backward of y = X w + b with a mean
//      squared error loss) writes each gradient into the registry's buffer and marks it
//      ready, last layer first, as a real backward pass would. A readiness listener hears
//      each mark; later layers (the Reducer) start communication from exactly this hook.
//   3. The SGD step is one fused axpy over the whole arena (values -= lr * grads) rather
//      than one per parameter: that is what flat arenas buy.
//   4. Checkpoints are safetensors files, saved atomically; --resume continues a run and
//      reproduces an uninterrupted run bit for bit.
//
// Run:  build/examples/linear_regression --epochs 40 [--save ckpt.safetensors] [--resume ckpt.safetensors]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "gradsync/io/registry_checkpoint.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/registry/parameter_registry.h"

using namespace gradsync;

namespace {

struct Options {
  int epochs = 40;
  int features = 16;
  int samples = 4096;
  int batch = 128;
  double lr = 0.05;
  std::string save;
  std::string resume;
};

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw Error("flag " + flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--epochs") options.epochs = std::stoi(value());
    else if (flag == "--lr") options.lr = std::stod(value());
    else if (flag == "--save") options.save = value();
    else if (flag == "--resume") options.resume = value();
    else throw Error("unknown flag " + flag + " (known: --epochs --lr --save --resume)");
  }
  return options;
}

// Synthetic data from a known model, so the result can be checked: y = X w* + b* + noise.
struct Dataset {
  std::vector<float> x;  // samples x features, row-major
  std::vector<float> y;
  std::vector<float> true_w;
  float true_b = 0.5f;
};

Dataset make_dataset(const Options& options) {
  std::mt19937 generator(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Dataset data;
  for (int j = 0; j < options.features; ++j) data.true_w.push_back(normal(generator));
  for (int i = 0; i < options.samples; ++i) {
    float target = data.true_b;
    for (int j = 0; j < options.features; ++j) {
      const float value = normal(generator);
      data.x.push_back(value);
      target += value * data.true_w[static_cast<std::size_t>(j)];
    }
    data.y.push_back(target + 0.01f * normal(generator));
  }
  return data;
}

}  // namespace

int main(int argc, char** argv) try {
  const Options options = parse(argc, argv);
  const Dataset data = make_dataset(options);

  // 1. Parameters: registered by name, then laid out in one f32 arena.
  ParameterRegistry registry;
  Parameter& weight = registry.add("linear.weight", {options.features});
  Parameter& bias = registry.add("linear.bias", {1});
  registry.finalize();

  int start_epoch = 0;
  if (!options.resume.empty()) {
    const io::Metadata metadata = io::load_registry(registry, options.resume);
    start_epoch = std::stoi(metadata.at("epoch"));
    std::printf("resumed from %s at epoch %d\n", options.resume.c_str(), start_epoch);
  }

  // 2. A readiness listener: here it only counts; the Reducer launches allreduces from it.
  std::size_t ready_marks = 0;
  auto subscription = registry.on_ready([&](Parameter&) { ++ready_marks; });

  const Arena& arena = registry.arenas()[0];
  const int batches = options.samples / options.batch;
  for (int epoch = start_epoch; epoch < options.epochs; ++epoch) {
    double epoch_loss = 0.0;
    for (int batch = 0; batch < batches; ++batch) {
      const float* w = weight.value().data_as<float>();
      const float b = bias.value().data_as<float>()[0];

      // Forward and backward of L = mean((x.w + b - y)^2), written out by hand.
      Tensor& grad_w = weight.grad_for_overwrite();
      Tensor& grad_b = bias.grad_for_overwrite();
      float* gw = grad_w.data_as<float>();
      float* gb = grad_b.data_as<float>();
      std::fill(gw, gw + options.features, 0.0f);
      gb[0] = 0.0f;
      for (int row = batch * options.batch; row < (batch + 1) * options.batch; ++row) {
        const float* x = &data.x[static_cast<std::size_t>(row) * static_cast<std::size_t>(options.features)];
        float prediction = b;
        for (int j = 0; j < options.features; ++j) prediction += w[j] * x[j];
        const float error = prediction - data.y[static_cast<std::size_t>(row)];
        epoch_loss += static_cast<double>(error) * error;
        const float scale = 2.0f * error / static_cast<float>(options.batch);
        gb[0] += scale;
        for (int j = 0; j < options.features; ++j) gw[j] += scale * x[j];
      }
      // Backward finishes the last layer first; here both come from one layer.
      registry.mark_ready(bias);
      registry.mark_ready(weight);

      // 3. SGD over the whole arena at once: padding between parameters is zero in both
      //    buffers, so it stays zero.
      Tensor values = arena.values;
      ops::axpy(-options.lr, arena.grads, values);
      registry.zero_grad();
    }
    std::printf("epoch %3d  loss %.6f\n", epoch + 1, epoch_loss / options.samples);
  }

  // How close did we get to the model that generated the data?
  double weight_error = 0.0;
  const std::vector<double> learned = weight.value().to_double_vector();
  for (int j = 0; j < options.features; ++j) {
    weight_error = std::max(weight_error, std::abs(learned[static_cast<std::size_t>(j)] - data.true_w[static_cast<std::size_t>(j)]));
  }
  std::printf("max |w - w*| = %.4f, |b - b*| = %.4f, %zu gradients marked ready\n", weight_error,
              std::abs(bias.value().to_double_vector()[0] - data.true_b), ready_marks);

  // 4. An atomic checkpoint: a crash during this save leaves any previous file intact.
  if (!options.save.empty()) {
    io::save_registry(registry, options.save, {.include_grads = false, .metadata = {{"epoch", std::to_string(options.epochs)}}});
    std::printf("saved %s\n", options.save.c_str());
  }
  return weight_error < 0.01 ? EXIT_SUCCESS : EXIT_FAILURE;
} catch (const std::exception& error) {
  std::fprintf(stderr, "linear_regression: %s\n", error.what());
  return EXIT_FAILURE;
}
