// bench_sharded_model: a model that never exists whole on any rank (ZeRO stage 3 with
// DataParallelOptions::broadcast_parameters = false; docs/zero.md, "Models that never exist
// whole"): constructed, initialized by pieces (or loaded by ranges), trained, saved as one
// consolidated file written in parallel. Prints each phase's time and the peak resident memory
// of the largest rank in it (VmHWM, reset before each phase), and the save's rate next to its
// ceiling: one process writing the same number of bytes to the same folder (write + fsync).
//
// The model: --layers layers of --layer-elements f32 (256 x 2^20 = 268M parameters, 1 GiB of
// values, by default), SGD without momentum (no optimizer state: what is left is the values and
// the gradients), one unit per layer. Each step is a synthetic forward (every unit gathered and
// released) and backward (gathered again, a gradient written from its values, marked ready,
// released), as bench_zero's stage 3.
//
//   mpirun -np 4 bench_sharded_model --save model.safetensors       construct, initialize, train, save
//   mpirun -np 3 bench_sharded_model --load model.safetensors       load at another world size, train
//   --construct broadcast     today's way instead: rank 0 initializes the whole model and
//                             DataParallel broadcasts it (every rank writes every value)
//   benchmarks/sharded_model_limit.sh runs both under a per-rank memory limit.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include "bench_common.h"
#include "gradsync/comm/connect.h"
#include "gradsync/dist/data_parallel/data_parallel.h"
#include "gradsync/dist/zero/zero.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/optim/sgd.h"

using namespace gradsync;
using Clock = std::chrono::steady_clock;

namespace {

// This process's peak resident memory since the last reset (VmHWM), in MiB.
double peak_rss_mib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // kB
  }
  return 0.0;
}

// Starts a new peak (Linux: writing 5 to clear_refs resets VmHWM to the current RSS).
void reset_peak() { std::ofstream("/proc/self/clear_refs") << "5"; }

// One phase: its time (the slowest rank's) and the largest rank's peak RSS during it.
struct Phase {
  comm::Communicator& comm;
  const char* name;
  Clock::time_point start;
  Phase(comm::Communicator& comm_, const char* name_) : comm(comm_), name(name_) {
    comm.barrier();
    reset_peak();
    start = Clock::now();
  }
  double finish(const std::string& detail = "") {
    comm.barrier();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    Tensor rss = Tensor::from_vector(std::vector<double>{peak_rss_mib()}, {1});
    comm.allreduce_host(rss, comm::ReduceOp::max);
    if (comm.rank() == 0) {
      std::printf("%-12s %9.2f s   peak RSS %6.0f MiB (largest rank)%s\n", name, seconds, rss.to_double_vector()[0],
                  detail.c_str());
      std::fflush(stdout);
    }
    return seconds;
  }
};

// The ceiling of a save: `bytes` written to a file in `folder` from one 8 MiB buffer, then fsync.
double plain_write_seconds(const std::string& folder, std::int64_t bytes) {
  const std::string path = folder + "/bench_sharded_model.ceiling";
  const int file = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  GRADSYNC_CHECK(file >= 0, "cannot write ", path);
  std::vector<char> buffer(8 << 20, 1);
  const auto start = Clock::now();
  for (std::int64_t left = bytes; left > 0;) {
    const auto n = static_cast<std::size_t>(std::min<std::int64_t>(left, static_cast<std::int64_t>(buffer.size())));
    GRADSYNC_CHECK(::write(file, buffer.data(), n) == static_cast<ssize_t>(n), "writing ", path, " failed");
    left -= static_cast<std::int64_t>(n);
  }
  ::fsync(file);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  ::close(file);
  ::unlink(path.c_str());
  return seconds;
}

}  // namespace

int main(int argc, char** argv) try {
  const bench::Flags flags(
      argc, argv,
      "bench_sharded_model [--backend auto|mpi|gloo] [--layers N] [--layer-elements N] [--steps N]\n"
      "                    [--construct sharded|broadcast] [--load FILE] [--save FILE]\n"
      "  a ZeRO stage-3 model constructed, initialized (or loaded), trained and saved without ever being\n"
      "  whole on a rank; each phase's time and peak RSS. Run on several ranks (mpirun -np 4 ...)",
      {"--backend", "--layers", "--layer-elements", "--steps", "--construct", "--load", "--save"}, {});
  auto comm = comm::connect(flags.text("--backend", "auto"));
  const int layers = static_cast<int>(flags.integer("--layers", 256));
  const std::int64_t elements = flags.integer("--layer-elements", 1 << 20);
  const int steps = static_cast<int>(flags.integer("--steps", 2));
  const std::string construct = flags.text("--construct", "sharded");
  GRADSYNC_CHECK(construct == "sharded" || construct == "broadcast", "--construct: sharded or broadcast, got '",
                 construct, "'");
  const std::string load = flags.text("--load", ""), save = flags.text("--save", "");
  const double total_mib = static_cast<double>(layers) * static_cast<double>(elements) * 4 / (1 << 20);
  if (comm->rank() == 0) {
    std::printf("%s, %d ranks: %d layers x %lld f32 = %.1fM parameters (%.0f MiB of values), SGD, ZeRO stage 3, "
                "construction: %s\n",
                comm->backend(), comm->size(), layers, static_cast<long long>(elements),
                static_cast<double>(layers) * static_cast<double>(elements) / 1e6, total_mib, construct.c_str());
    std::fflush(stdout);
  }
  const auto rule = [](const Parameter&) { return init::normal(0.0, 0.02); };
  constexpr std::uint64_t kSeed = 20261205;

  Phase constructing(*comm, "construct");
  ParameterRegistry registry;
  for (int layer = 0; layer < layers; ++layer) registry.add("layers." + std::to_string(layer) + ".weight", {elements});
  registry.finalize();
  optim::SGD sgd(registry, optim::SGD::Options{.lr = 0.1});
  const bool broadcast = construct == "broadcast";
  if (broadcast && comm->rank() == 0) {  // today's way: the whole model on rank 0, then everywhere
    for (Parameter& p : registry) init::initialize(p, rule(p), kSeed);
  }
  dist::DataParallelOptions options{.broadcast_parameters = broadcast, .shard_gradients = true};
  for (Parameter& layer : registry) options.units.push_back({&layer});
  dist::DataParallel ddp(registry, *comm, options);
  dist::ZeroOptimizer zero(sgd, ddp, {.stage = 3});
  constructing.finish();

  if (!broadcast) {
    Phase filling(*comm, load.empty() ? "initialize" : "load");
    load.empty() ? zero.initialize(rule, kSeed) : zero.load_model(load);
    filling.finish(load.empty() ? "" : "  (" + load + ", read by ranges, checksums verified)");
  }
  std::uint64_t checksum = zero.model_checksum();
  if (comm->rank() == 0) std::printf("model checksum %016llx\n", static_cast<unsigned long long>(checksum));

  Phase training(*comm, "train");
  for (int step = 0; step < steps; ++step) {
    for (std::size_t u = 0; u < registry.size(); ++u) {  // forward: each unit in turn
      zero.gather(u);
      if (u + 1 < registry.size()) zero.release(u);
    }
    ddp.begin_backward();
    for (std::size_t u = registry.size(); u-- > 0;) {
      zero.gather(u);
      Tensor& grad = registry[u].grad_for_overwrite();
      grad.copy_from(registry[u].value());
      ops::scale(grad, 0.01);  // the gradient of 0.005 |w|^2: every step shrinks the weights
      registry.mark_ready(registry[u]);
      zero.release(u);
    }
    ddp.end_backward();
    zero.step();
    zero.zero_grad(/*set_to_undefined=*/false);  // stage 3: the gradient pages given back between steps
  }
  training.finish("  (" + std::to_string(steps) + " steps)");
  checksum = zero.model_checksum();
  if (comm->rank() == 0) std::printf("model checksum after training %016llx\n", static_cast<unsigned long long>(checksum));

  if (!save.empty()) {
    Phase saving(*comm, "save");
    zero.save_model(save);
    const double seconds = saving.finish();
    if (comm->rank() == 0) {
      const std::string folder = std::filesystem::path(save).has_parent_path() ? std::filesystem::path(save).parent_path().string() : ".";
      const auto bytes = static_cast<std::int64_t>(std::filesystem::file_size(save));
      const double ceiling = plain_write_seconds(folder, bytes);
      std::printf("saved %s: %.0f MiB in %.2f s, %.0f MiB/s; ceiling: one process writing as many bytes there "
                  "(write, fsync) %.0f MiB/s\n",
                  save.c_str(), static_cast<double>(bytes) / (1 << 20), seconds,
                  static_cast<double>(bytes) / (1 << 20) / seconds, static_cast<double>(bytes) / (1 << 20) / ceiling);
    }
  }
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "bench_sharded_model: %s\n", error.what());
  return 1;
}
