// bench_optimizers: SGD-momentum and Adam steps over one arena of N f32 parameters, against
// memory bandwidth measured in the same run.
//
// An optimizer step is memory-bound: bytes per parameter as counted in
// shared/reference/anchors.md 3.2 are 20 for SGD with momentum (read p, g, buf; write p,
// buf) and 28 for Adam (read p, g, m, v; write p, m, v). Effective bandwidth = bytes / time.
// The ceiling is a STREAM-style triad done in place, a[i] += s * c[i], over arrays of the
// same size (12 bytes per element), the best of several runs; a plain copy is printed beside it.
//
//   build/benchmarks/bench_optimizers [--device cpu|cuda:0] [--sizes 1,4,16,64] (Mi parameters)
//
// benchmarks/torch_optimizers.py runs torch.optim on the same sizes and prints the ratios.
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/optim/adam.h"
#include "gradsync/optim/sgd.h"

using namespace gradsync;

namespace {

// The in-place triad as a plain loop. Compiled for AVX2 where the CPU has it, like the
// optimizer kernels, so that the ceiling is not held back by an older instruction set.
#if defined(__x86_64__)
__attribute__((target("avx2,fma")))
#endif
void triad_wide(float* __restrict a, const float* __restrict c, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) a[i] = a[i] + 0.5f * c[i];
}

void triad_baseline(float* __restrict a, const float* __restrict c, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) a[i] = a[i] + 0.5f * c[i];
}

}  // namespace

int main(int argc, char** argv) try {
  Device device = Device::cpu();
  std::vector<std::int64_t> sizes_mi{1, 4, 16, 64};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--device") {
      device = Device::parse(argv[i + 1]);
    } else if (flag == "--sizes") {
      sizes_mi.clear();
      std::stringstream list(argv[i + 1]);
      for (std::string item; std::getline(list, item, ',');) sizes_mi.push_back(std::stoll(item));
    } else {
      throw Error("unknown flag " + flag);
    }
  }
  const int repetitions = device.is_cpu() ? 5 : 20;
  std::printf("bench_optimizers on %s, f32, single thread on the CPU\n", device.str().c_str());
  std::printf("%-9s %-13s %9s %9s %10s %10s %10s\n", "params", "optimizer", "ms/step", "GB/s", "triad GB/s",
              "vs triad", "copy GB/s");
  for (const std::int64_t mi : sizes_mi) {
    const std::int64_t n = mi << 20;
    // Ceilings on arrays of n floats.
    Tensor a = Tensor::zeros({n}, DType::f32, device);
    Tensor b = Tensor::zeros({n}, DType::f32, device);
    Tensor c = Tensor::zeros({n}, DType::f32, device);
    // The triad, in place: a[i] = a[i] + s * c[i] (ops::axpy), 12 bytes per element. In place,
    // like an optimizer step, so neither pays for write-allocate traffic the other avoids.
    double triad_seconds = 0;
    if (device.is_cpu()) {
      const bool wide = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
      triad_seconds = bench::best_seconds(repetitions, device, [&] {
        (wide ? triad_wide : triad_baseline)(a.data_as<float>(), c.data_as<float>(), n);
      });
    } else {
      triad_seconds = bench::best_seconds(repetitions, device, [&] { ops::axpy(0.5, c, a); });
    }
    const double triad_rate = bench::gigabytes_per_second(12.0 * static_cast<double>(n), triad_seconds);
    const double copy_seconds = bench::best_seconds(repetitions, device, [&] { a.copy_from(b); });
    const double copy_rate = bench::gigabytes_per_second(8.0 * static_cast<double>(n), copy_seconds);
    a = Tensor();
    b = Tensor();
    c = Tensor();

    ParameterRegistry registry;
    registry.add("weights", {n}, DType::f32, device);
    registry.finalize();
    Parameter& weights = registry.at("weights");
    ops::fill(weights.value(), 0.5);
    ops::fill(weights.grad_for_overwrite(), 1e-3);

    optim::SGD sgd(registry, optim::SGD::Options{.lr = 1e-3, .momentum = 0.9});
    optim::Adam adam(registry, optim::Adam::Options{.lr = 1e-3});
    struct Row {
      const char* name;
      double bytes_per_parameter;
      optim::Optimizer* optimizer;
    };
    for (const Row& row : {Row{"sgd_momentum", 20, &sgd}, Row{"adam", 28, &adam}}) {
      const double seconds = bench::best_seconds(repetitions, device, [&] { row.optimizer->step(); });
      const double rate = bench::gigabytes_per_second(row.bytes_per_parameter * static_cast<double>(n), seconds);
      std::printf("%-9s %-13s %9.2f %9.1f %10.1f %9.2fx %10.1f\n", (std::to_string(mi) + "Mi").c_str(), row.name,
                  seconds * 1e3, rate, triad_rate, rate / triad_rate, copy_rate);
    }
  }
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "bench_optimizers: %s\n", error.what());
  return 1;
}
