// bench_ops: throughput of the element-wise kernels against the memory-bandwidth ceiling
// measured in the same run.
//
// Every op here is memory-bound: its cost is the bytes it must move. The ceiling is a plain
// copy of the same number of bytes (memcpy on the host, cudaMemcpy device-to-device on a
// GPU), timed right before; each op's effective bandwidth is divided by it. A ratio near 1
// means the kernel moves bytes as fast as the memory system allows; optimizers and the
// reducer's scaling/casting inherit that.
//
//   build/benchmarks/bench_ops [--device cpu|cuda:0] [--elements N]
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "bench_common.h"
#include "gradsync/kernels/ops.h"

using namespace gradsync;

int main(int argc, char** argv) try {
  const bench::Flags flags(argc, argv,
                           "bench_ops [--device cpu|cuda:0 (cpu)] [--elements N (32 Mi)]\n"
                           "  the element-wise ops and reductions against the memory bandwidth of the same run",
                           {"--device", "--elements"});
  const Device device = Device::parse(flags.text("--device", "cpu"));
  const std::int64_t n = flags.integer("--elements", 1 << 25);  // 32 Mi: 128 MiB of f32, far beyond any cache
  const int repetitions = device.is_cpu() ? 5 : 20;

  Tensor x = Tensor::empty({n}, DType::f32, device);
  Tensor y = Tensor::empty({n}, DType::f32, device);
  Tensor out = Tensor::empty({n}, DType::f32, device);
  Tensor half = Tensor::empty({n}, DType::bf16, device);
  Tensor f16 = Tensor::empty({n}, DType::f16, device);
  ops::fill(x, 1.25);
  ops::fill(y, -0.5);

  const double f32_bytes = static_cast<double>(n) * 4;
  // Ceilings, each counted the way the ops below are counted (bytes read + bytes written):
  //  * copy: 4n bytes in, 4n out (out.copy_from(x): memcpy / cudaMemcpy);
  //  * on the CPU also a read-only integer sum and an in-place integer increment, plain
  //    loops the compiler vectorizes fully. CPUs often stream reads or read-modify-writes
  //    faster than a copy (write-allocate), and an op must not look "faster than memory".
  // The ceiling is the best of them.
  // On the CPU the ceilings use as many threads as the library (bench::on_all_cores).
  const double copy_seconds = bench::best_seconds(repetitions, device, [&] {
    if (!device.is_cpu()) return out.copy_from(x);
    bench::on_all_cores(n, [&](std::int64_t begin, std::int64_t end) {
      std::memcpy(static_cast<float*>(out.data()) + begin, static_cast<const float*>(x.data()) + begin,
                  static_cast<std::size_t>(end - begin) * 4);
    });
  });
  const double copy_rate = bench::gigabytes_per_second(2 * f32_bytes, copy_seconds);
  double read_rate = 0.0;
  double update_rate = 0.0;
  if (device.is_cpu()) {
    auto* words = static_cast<std::uint32_t*>(out.data());
    volatile std::uint32_t keep = 0;
    const double read_seconds = bench::best_seconds(repetitions, device, [&] {
      bench::on_all_cores(n, [&](std::int64_t begin, std::int64_t end) {
        std::uint32_t sum = 0;
        for (std::int64_t i = begin; i < end; ++i) sum += words[i];
        keep = sum;
      });
    });
    const double update_seconds = bench::best_seconds(repetitions, device, [&] {
      bench::on_all_cores(n, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) words[i] += 1u;
      });
    });
    (void)keep;
    read_rate = bench::gigabytes_per_second(f32_bytes, read_seconds);
    update_rate = bench::gigabytes_per_second(2 * f32_bytes, update_seconds);
  }
  const double ceiling = std::max({copy_rate, read_rate, update_rate});

  struct Row {
    const char* name;
    double bytes;  // moved per call
    std::function<void()> fn;
  };
  const Row rows[] = {
      {"fill f32", f32_bytes, [&] { ops::fill(out, 3.0); }},
      {"scale f32", 2 * f32_bytes, [&] { ops::scale(out, 0.999); }},
      {"axpy f32", 3 * f32_bytes, [&] { ops::axpy(1e-3, x, y); }},
      {"add f32", 3 * f32_bytes, [&] { ops::add(x, y, out); }},
      {"cast f32->bf16", 1.5 * f32_bytes, [&] { ops::cast(x, half); }},
      {"cast bf16->f32", 1.5 * f32_bytes, [&] { ops::cast(half, out); }},
      {"cast f32->f16", 1.5 * f32_bytes, [&] { ops::cast(x, f16); }},
      {"cast f16->f32", 1.5 * f32_bytes, [&] { ops::cast(f16, out); }},
      {"dot f32", 2 * f32_bytes, [&] { ops::dot(x, y); }},
      {"squared_norm f32", f32_bytes, [&] { ops::squared_norm(x); }},
  };

  std::printf("bench_ops on %s, %lld elements (%.0f MiB per f32 tensor), %d CPU thread(s)\n", device.str().c_str(),
              static_cast<long long>(n), f32_bytes / (1 << 20), num_threads());
  std::printf("memory: copy %.1f GB/s, read %.1f GB/s, in-place update %.1f GB/s -> ceiling %.1f GB/s\n\n",
              copy_rate, read_rate, update_rate, ceiling);
  std::printf("%-18s %10s %10s %12s %9s\n", "op", "ms", "GB/s", "vs ceiling", "vs copy");
  for (const Row& row : rows) {
    const double seconds = bench::best_seconds(repetitions, device, row.fn);
    const double bandwidth = bench::gigabytes_per_second(row.bytes, seconds);
    std::printf("%-18s %10.2f %10.1f %11.2fx %8.2fx\n", row.name, seconds * 1e3, bandwidth, bandwidth / ceiling,
                bandwidth / copy_rate);
  }
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "bench_ops: %s\n", error.what());
  return 1;
}
