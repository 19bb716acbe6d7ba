// A user's program, built outside the project against the installed library via pkg-config.
#include <gradsync/core/tensor.h>
#include <gradsync/io/registry_checkpoint.h>
#include <gradsync/kernels/ops.h>
#include <gradsync/optim/adam.h>
#include <gradsync/registry/parameter_registry.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  gradsync::ParameterRegistry registry;
  registry.add("w", {4});
  registry.finalize();
  gradsync::Parameter& w = registry.at("w");
  gradsync::ops::fill(w.value(), 1.5);
  gradsync::ops::fill(w.grad_for_overwrite(), 0.5);
  gradsync::ops::axpy(-1.0, w.grad(), w.value());  // w = 1.0
  // One AdamW step with lr 0.5 and no decay moves every element by exactly lr: w = 0.5.
  gradsync::optim::AdamW adamw(registry, gradsync::optim::AdamW::Options{.lr = 0.5, .weight_decay = 0.0});
  adamw.step();
  adamw.save_state(std::filesystem::path(argv[1]) / "optimizer.safetensors");
  const std::filesystem::path path = std::filesystem::path(argv[1]) / "consumer.safetensors";
  gradsync::io::save_registry(registry, path);
  gradsync::ParameterRegistry loaded;
  loaded.add("w", {4});
  loaded.finalize();
  gradsync::io::load_registry(loaded, path);
  const double norm = gradsync::ops::squared_norm(loaded.at("w").value());
  std::printf("consumer: squared norm %.1f\n", norm);
  return std::abs(norm - 1.0) < 1e-6 ? 0 : 1;  // four elements of 0.5
}
