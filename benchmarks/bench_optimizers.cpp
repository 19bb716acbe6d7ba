// bench_optimizers: SGD-momentum and Adam steps over one arena of N parameters, f32 and mixed
// precision, against memory bandwidth measured in the same run.
//
// An optimizer step is memory-bound: the bytes per parameter (docs/benchmarks.md) are 20 for
// SGD with momentum (read p, g, buf; write p,
// buf) and 28 for Adam (read p, g, m, v; write p, m, v). Effective bandwidth = bytes / time.
// Mixed precision (bf16 or f16 parameters and gradients, f32 master weights and moments) moves
// the same 28 bytes for Adam: read g (2) and master, m, v (12); write master, m, v (12) and the
// 16-bit model copy (2), all in one pass; SGD 20 (g 2, master 8, momentum 8, model 2).
// The ceiling is a STREAM-style triad done in place, a[i] += s * c[i], over arrays of the
// same size (12 bytes per element), the best of several runs; a plain copy is printed beside it.
//
//   build/benchmarks/bench_optimizers [--device cpu|cuda:0] [--sizes 1,4,16,64] (Mi parameters)
//
// benchmarks/torch_optimizers.py runs torch.optim on the same sizes and prints the ratios.
#include <cstdio>
#include <cstring>
#include <memory>
#include <utility>
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
  const bench::Flags flags(argc, argv,
                           "bench_optimizers [--device cpu|cuda:0 (cpu)] [--sizes 1,4,16,64 (Mi parameters)]\n"
                           "  SGD-momentum and Adam steps in f32, bf16 and fp16 (f32 master weights) against the\n"
                           "  triad and copy bandwidth of the same run",
                           {"--device", "--sizes"});
  const Device device = Device::parse(flags.text("--device", "cpu"));
  std::vector<std::int64_t> sizes_mi;
  std::stringstream list(flags.text("--sizes", "1,4,16,64"));
  for (std::string item; std::getline(list, item, ',');) sizes_mi.push_back(std::stoll(item));
  const int repetitions = device.is_cpu() ? 5 : 20;
  std::printf("bench_optimizers on %s, %d CPU thread(s) (GRADSYNC_NUM_THREADS), ceilings on as many\n",
              device.str().c_str(), num_threads());
  std::printf("%-9s %-17s %9s %9s %10s %10s %10s %9s\n", "params", "optimizer", "ms/step", "GB/s", "triad GB/s",
              "vs triad", "copy GB/s", "vs copy");
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
        bench::on_all_cores(n, [&](std::int64_t begin, std::int64_t end) {
          (wide ? triad_wide : triad_baseline)(a.data_as<float>() + begin, c.data_as<float>() + begin, end - begin);
        });
      });
    } else {
      triad_seconds = bench::best_seconds(repetitions, device, [&] { ops::axpy(0.5, c, a); });
    }
    const double triad_rate = bench::gigabytes_per_second(12.0 * static_cast<double>(n), triad_seconds);
    const double copy_seconds = bench::best_seconds(repetitions, device, [&] {
      if (!device.is_cpu()) return a.copy_from(b);
      bench::on_all_cores(n, [&](std::int64_t begin, std::int64_t end) {
        std::memcpy(a.data_as<float>() + begin, b.data_as<float>() + begin, static_cast<std::size_t>(end - begin) * 4);
      });
    });
    const double copy_rate = bench::gigabytes_per_second(8.0 * static_cast<double>(n), copy_seconds);
    a = Tensor();
    b = Tensor();
    c = Tensor();

    // One registry per precision: the model's dtype, its gradients' dtype, f32 master weights
    // for the 16-bit ones.
    struct Model {
      const char* label;
      DType dtype;
      ParameterRegistry registry;
    };
    std::vector<std::unique_ptr<Model>> models;
    for (const auto& [label, dtype] : {std::pair{"", DType::f32}, std::pair{"_bf16", DType::bf16},
                                       std::pair{"_fp16", DType::f16}}) {
      auto model = std::make_unique<Model>();
      model->label = label;
      model->dtype = dtype;
      Parameter& weights = model->registry.add("weights", {n}, dtype, device);
      model->registry.finalize();
      ops::fill(weights.value(), 0.5);
      ops::fill(weights.grad_for_overwrite(), 1e-3);
      models.push_back(std::move(model));
    }
    for (const auto& model : models) {
      const auto master = model->dtype == DType::f32 ? optim::MasterWeights::none : optim::MasterWeights::f32;
      optim::SGD sgd(model->registry, optim::SGD::Options{.lr = 1e-3, .momentum = 0.9}, master);
      optim::Adam adam(model->registry, optim::Adam::Options{.lr = 1e-3}, master);
      struct Row {
        std::string name;
        double bytes_per_parameter;
        optim::Optimizer* optimizer;
      };
      for (const Row& row : {Row{std::string("sgd_momentum") + model->label, 20, &sgd},
                             Row{std::string("adam") + model->label, 28, &adam}}) {
        row.optimizer->step();  // the first step creates the state (and takes the master copy)
        const double seconds = bench::best_seconds(repetitions, device, [&] { row.optimizer->step(); });
        const double rate = bench::gigabytes_per_second(row.bytes_per_parameter * static_cast<double>(n), seconds);
        std::printf("%-9s %-17s %9.2f %9.1f %10.1f %9.2fx %10.1f %8.2fx\n", (std::to_string(mi) + "Mi").c_str(),
                    row.name.c_str(), seconds * 1e3, rate, triad_rate, rate / triad_rate, copy_rate, rate / copy_rate);
      }
    }
  }
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "bench_optimizers: %s\n", error.what());
  return 1;
}
