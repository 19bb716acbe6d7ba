// bring_your_own_engine: the smallest data-parallel program on gradsync's low-level API, with
// an "engine" written by hand: linear regression y = x.w + b with a mean squared error.
//
// What it shows, top to bottom:
//   1. comm::connect(): one process per rank, launched by mpirun or scripts/launch.sh (or
//      alone: a world of one).
//   2. Parameters live in a ParameterRegistry, registered by name and finalized into one flat
//      arena per (device, dtype); each parameter is a view of it.
//   3. dist::DataParallel over the registry: it checks all ranks hold the same parameters and
//      broadcasts rank 0's values.
//   4. The engine's backward writes each gradient into the registry's buffer and marks it
//      ready, last layer first. DataParallel hears each mark and reduces (here: averages over
//      ranks) in buckets while the engine continues; end_backward() waits.
//   5. An optimizer step over the arena, and an atomic safetensors checkpoint (the trainers'
//      format, examples/common/checkpoints.h); --resume continues a run and reproduces an
//      uninterrupted run bit for bit.
// Its flags are read by the trainers' Flags (examples/common/flags.h); everything else is the
// library's own API.
//
//   build/examples/bring_your_own_engine --epochs 40
//   mpirun -np 2 build/examples/bring_your_own_engine --epochs 40 --save ckpt.safetensors
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "common/checkpoints.h"
#include "common/flags.h"
#include "common/metrics.h"
#include "gradsync/comm/connect.h"
#include "gradsync/dist/data_parallel/data_parallel.h"
#include "gradsync/optim/sgd.h"

using namespace gradsync;

namespace {

struct Options {
  int epochs = 40;
  int features = 16;
  int samples = 4096;
  int batch = 128;  // global: each rank takes batch / world of it
  double lr = 0.05;
  std::string save;
  std::string resume;
};

Options parse(int argc, char** argv) {
  examples::Flags flags(argc, argv);
  if (flags.flag("--help")) {
    std::printf("bring_your_own_engine [--epochs 40] [--lr 0.05] [--save CKPT] [--resume CKPT]\n"
                "  linear regression through DataParallel with a hand-written engine; run alone, with\n"
                "  mpirun -np N, or scripts/launch.sh N\n");
    std::exit(0);
  }
  Options options;
  options.epochs = static_cast<int>(flags.count("--epochs", options.epochs));
  options.lr = flags.number("--lr", options.lr);
  options.save = flags.text("--save", "");
  options.resume = flags.text("--resume", "");
  flags.finish();
  return options;
}

// Synthetic data from a known model, so the result can be checked: y = X w* + b* + noise.
// Every rank makes the same data set and reads its slice of each batch.
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
  examples::line_buffered_progress();
  const Options options = parse(argc, argv);
  const Dataset data = make_dataset(options);

  // 1. The ranks.
  auto comm = comm::connect();
  const int world = comm->size();
  // Each rank takes an equal slice of every batch of 128 rows (on 3 ranks 42 each: the last 2
  // rows of a batch go unused), so any number of ranks runs.
  const int local_batch = options.batch / world;
  GRADSYNC_CHECK(local_batch > 0, "a batch of ", options.batch, " rows has none for each of ", world, " ranks");

  // 2. Parameters: registered by name, then laid out in one f32 arena.
  ParameterRegistry registry;
  Parameter& weight = registry.add("linear.weight", {options.features});
  Parameter& bias = registry.add("linear.bias", {1});
  registry.finalize();

  // 3. Data parallelism over the registry, and plain SGD over its arena; a checkpoint holds the
  //    weights, SGD's state and the epoch to run next.
  optim::SGD sgd(registry, optim::SGD::Options{.lr = options.lr, .momentum = 0.0, .dampening = 0.0, .weight_decay = 0.0,
                                              .nesterov = false, .maximize = false});
  examples::Progress progress;
  if (!options.resume.empty()) {
    progress = examples::load_checkpoint(options.resume, registry, sgd);
    if (comm->rank() == 0) std::printf("resumed from %s at epoch %d\n", options.resume.c_str(), progress.epoch);
  }
  dist::DataParallel ddp(registry, *comm);

  const int batches = options.samples / options.batch;
  for (int epoch = progress.epoch; epoch < options.epochs; ++epoch) {
    double epoch_loss = 0.0;
    for (int batch = 0; batch < batches; ++batch) {
      const float* w = weight.value().data_as<float>();
      const float b = bias.value().data_as<float>()[0];

      // 4. The engine: forward and backward of L = mean((x.w + b - y)^2) over this rank's
      //    rows, written straight into the gradient buffers.
      ddp.begin_backward();
      float* gw = weight.grad_for_overwrite().data_as<float>();
      float* gb = bias.grad_for_overwrite().data_as<float>();
      std::fill(gw, gw + options.features, 0.0f);
      gb[0] = 0.0f;
      const int first = batch * options.batch + comm->rank() * local_batch;
      for (int row = first; row < first + local_batch; ++row) {
        const float* x = &data.x[static_cast<std::size_t>(row) * static_cast<std::size_t>(options.features)];
        float prediction = b;
        for (int j = 0; j < options.features; ++j) prediction += w[j] * x[j];
        const float error = prediction - data.y[static_cast<std::size_t>(row)];
        epoch_loss += static_cast<double>(error) * error;
        const float scale = 2.0f * error / static_cast<float>(local_batch);
        gb[0] += scale;
        for (int j = 0; j < options.features; ++j) gw[j] += scale * x[j];
      }
      registry.mark_ready(bias);    // the last layer's gradients first, as a backward pass goes;
      registry.mark_ready(weight);  // DataParallel starts reducing at each mark
      ddp.end_backward();           // waits: the gradients now hold the average over ranks

      // 5. The step, over the whole arena at once.
      sgd.step();
      sgd.zero_grad();
    }
    if (comm->rank() == 0 && (epoch + 1) % 10 == 0) {
      std::printf("epoch %3d  loss (rank 0's rows) %.6f\n", epoch + 1, epoch_loss / (batches * local_batch));
    }
  }

  // How close did we get to the model that generated the data?
  double weight_error = 0.0;
  const std::vector<double> learned = weight.value().to_double_vector();
  for (int j = 0; j < options.features; ++j) {
    weight_error = std::max(weight_error, std::abs(learned[static_cast<std::size_t>(j)] - data.true_w[static_cast<std::size_t>(j)]));
  }
  if (comm->rank() == 0) {
    std::printf("%d rank(s) on %s: max |w - w*| = %.4f, |b - b*| = %.4f\n", world, comm->backend(), weight_error,
                std::abs(bias.value().to_double_vector()[0] - data.true_b));
  }
  // An atomic checkpoint: a crash during this save leaves any previous file intact.
  if (!options.save.empty() && comm->rank() == 0) {
    progress = {.epoch = options.epochs, .step_in_epoch = 0, .global_step = options.epochs * batches,
                .global_batch = options.batch};
    examples::save_checkpoint(options.save, registry, {sgd.state_tensors(), sgd.state_metadata()}, progress);
    std::printf("saved %s\n", options.save.c_str());
  }
  return weight_error < 0.01 ? EXIT_SUCCESS : EXIT_FAILURE;
} catch (const std::exception& error) {
  return comm::report_fatal_error("bring_your_own_engine", error);
}
