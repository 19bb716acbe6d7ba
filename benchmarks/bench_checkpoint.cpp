// bench_checkpoint: saving and loading a registry as safetensors, against the raw file
// system measured in the same run.
//
// Ceilings: writing the same number of bytes with write()+fsync() into a file in the same
// folder, and reading them back with read(). A save does a little more (header, atomic
// rename, fsync of the folder) and a load more still (validation, staging copy into the
// arena), so ratios a little under 1 are the expectation. The checksum sharded ZeRO sets
// record (XXH64, io/checksum.h) is measured in memory against a memcpy of the same bytes, and
// over the file against the raw read, with its cost per GiB.
//
//   build/benchmarks/bench_checkpoint [--mib N] [--dir PATH]
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "bench_common.h"
#include "gradsync/io/checksum.h"
#include "gradsync/io/registry_checkpoint.h"
#include "gradsync/kernels/ops.h"

using namespace gradsync;
namespace fs = std::filesystem;

int main(int argc, char** argv) try {
  const bench::Flags flags(argc, argv,
                           "bench_checkpoint [--mib N (256)] [--dir PATH (the temp folder)]\n"
                           "  saves and loads a registry of N MiB as safetensors against write()+fsync() and read()",
                           {"--mib", "--dir"});
  const std::int64_t mib = flags.integer("--mib", 256);
  const fs::path folder = flags.text("--dir", fs::temp_directory_path().string());
  // A model-like registry: 32 layers of weight and bias, mib MiB of f32 in all.
  ParameterRegistry registry;
  const std::int64_t layers = 32;
  const std::int64_t per_layer = mib * (1 << 20) / 4 / layers;
  for (std::int64_t layer = 0; layer < layers; ++layer) {
    registry.add("layer" + std::to_string(layer) + ".weight", {per_layer - 256});
    registry.add("layer" + std::to_string(layer) + ".bias", {256});
  }
  registry.finalize();
  for (const Arena& arena : registry.arenas()) {
    Tensor values = arena.values;
    ops::fill(values, 0.125);
  }
  const double bytes = static_cast<double>(registry.total_numel()) * 4;
  const fs::path checkpoint = folder / "gradsync_bench.safetensors";
  const fs::path raw = folder / "gradsync_bench.raw";
  const Tensor& arena_values = registry.arenas()[0].values;

  const double raw_write = bench::best_seconds(3, Device::cpu(), [&] {
    const int fd = ::open(raw.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    GRADSYNC_CHECK(fd >= 0 && ::write(fd, arena_values.data(), static_cast<std::size_t>(bytes)) == static_cast<ssize_t>(bytes),
                   "raw write failed");
    ::fsync(fd);
    ::close(fd);
  });
  std::vector<char> sink(static_cast<std::size_t>(bytes));
  const double raw_read = bench::best_seconds(3, Device::cpu(), [&] {
    const int fd = ::open(raw.c_str(), O_RDONLY);
    GRADSYNC_CHECK(fd >= 0 && ::read(fd, sink.data(), sink.size()) == static_cast<ssize_t>(sink.size()), "raw read failed");
    ::close(fd);
  });
  std::vector<char> copy(static_cast<std::size_t>(bytes));
  const double memory_copy = bench::best_seconds(3, Device::cpu(), [&] {
    std::memcpy(copy.data(), arena_values.data(), copy.size());
  });
  std::uint64_t digest = 0;
  const double hash_memory = bench::best_seconds(3, Device::cpu(), [&] {
    digest ^= io::xxh64(arena_values.data(), static_cast<std::size_t>(bytes));
  });
  const double hash_file = bench::best_seconds(3, Device::cpu(), [&] { digest ^= io::checksum_file(raw).xxh64; });
  const double save = bench::best_seconds(3, Device::cpu(), [&] { io::save_registry(registry, checkpoint); });
  const double load = bench::best_seconds(3, Device::cpu(), [&] { io::load_registry(registry, checkpoint); });
  fs::remove(raw);
  fs::remove(checkpoint);

  std::printf("bench_checkpoint: %lld parameters, %.0f MiB, in %s\n", static_cast<long long>(registry.size()),
              bytes / (1 << 20), folder.c_str());
  std::printf("%-26s %10s %10s %12s\n", "operation", "ms", "GB/s", "vs ceiling");
  std::printf("%-26s %10.1f %10.2f %12s\n", "raw write+fsync (ceiling)", raw_write * 1e3,
              bench::gigabytes_per_second(bytes, raw_write), "1.00x");
  std::printf("%-26s %10.1f %10.2f %11.2fx\n", "save_registry (atomic)", save * 1e3,
              bench::gigabytes_per_second(bytes, save), raw_write / save);
  std::printf("%-26s %10.1f %10.2f %12s\n", "raw read (ceiling)", raw_read * 1e3,
              bench::gigabytes_per_second(bytes, raw_read), "1.00x");
  std::printf("%-26s %10.1f %10.2f %11.2fx\n", "load_registry (validated)", load * 1e3,
              bench::gigabytes_per_second(bytes, load), raw_read / load);
  const double gib = bytes / (1 << 30);
  std::printf("%-26s %10.1f %10.2f %12s\n", "memcpy (ceiling)", memory_copy * 1e3,
              bench::gigabytes_per_second(bytes, memory_copy), "1.00x");
  std::printf("%-26s %10.1f %10.2f %11.2fx   %.2f s/GiB\n", "xxh64 in memory", hash_memory * 1e3,
              bench::gigabytes_per_second(bytes, hash_memory), memory_copy / hash_memory, hash_memory / gib);
  std::printf("%-26s %10.1f %10.2f %11.2fx   %.2f s/GiB (vs raw read)\n", "checksum_file (xxh64)", hash_file * 1e3,
              bench::gigabytes_per_second(bytes, hash_file), raw_read / hash_file, hash_file / gib);
  if (digest == 42) std::printf("\n");  // keeps the hashing from being optimized away
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "bench_checkpoint: %s\n", error.what());
  return 1;
}
