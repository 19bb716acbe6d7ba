// A user's program, built outside the project against the installed library via pkg-config.
#include <gradsync/core/tensor.h>
#include <gradsync/io/registry_checkpoint.h>
#include <gradsync/kernels/ops.h>
#include <gradsync/registry/parameter_registry.h>

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
  gradsync::ops::axpy(-1.0, w.grad(), w.value());
  const std::filesystem::path path = std::filesystem::path(argv[1]) / "consumer.safetensors";
  gradsync::io::save_registry(registry, path);
  gradsync::ParameterRegistry loaded;
  loaded.add("w", {4});
  loaded.finalize();
  gradsync::io::load_registry(loaded, path);
  const double norm = gradsync::ops::squared_norm(loaded.at("w").value());
  std::printf("consumer: squared norm %.1f\n", norm);
  return norm == 4.0 ? 0 : 1;
}
