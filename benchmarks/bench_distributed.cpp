// bench_distributed: a synthetic backward through the DistributedOptimizer, and how much of
// the communication hides behind it.
//
// The model is --layers layers of --layer-elements f32 each. A "backward" visits them last to
// first; each layer computes for --compute-ms (a sleep by default: the CPU is free for the
// communication thread, as it is while a GPU computes; --busy spins instead), writes its
// gradient and marks it ready. Each step then calls DistributedOptimizer::step(). Printed,
// all measured in this run:
//   compute   the same backward + step with no communication at all
//   step      the backward + step through the DistributedOptimizer
//   allreduce one allreduce of all the gradient bytes at once (the communicator's, which
//             bench_collectives puts within a few percent of the raw library call)
//   hidden    the share of that allreduce the step did not pay for:
//             1 - (step - compute) / allreduce, clipped to [0, 1]
//
//   mpirun -np 2 build/benchmarks/bench_distributed
//   scripts/launch.sh 4 build/benchmarks/bench_distributed --backend gloo
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "bench_common.h"
#include "gradsync/comm/connect.h"
#include "gradsync/dist/horovod/distributed_optimizer.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/optim/sgd.h"

using namespace gradsync;
using Clock = std::chrono::steady_clock;

namespace {

struct Settings {
  std::string backend = "auto";
  int layers = 16;
  std::int64_t layer_elements = 1 << 19;
  double compute_ms = 4.0;
  bool busy = false;
  int steps = 10;
  double fusion_mib = 8;
};

void compute(const Settings& settings) {
  const auto until = Clock::now() + std::chrono::duration<double, std::milli>(settings.compute_ms);
  if (!settings.busy) return std::this_thread::sleep_until(until);
  volatile double sink = 0;
  while (Clock::now() < until) sink = sink + 1.0;
}

// Seconds per step, median of the steps after one warm-up.
double run_steps(const Settings& settings, ParameterRegistry& registry, const std::function<void()>& step,
                 const std::function<void()>& zero) {
  std::vector<double> times;
  for (int s = 0; s <= settings.steps; ++s) {
    const auto start = Clock::now();
    for (std::size_t layer = registry.size(); layer-- > 0;) {
      compute(settings);
      Parameter& parameter = registry[layer];
      ops::fill(parameter.grad_for_overwrite(), 0.001 * static_cast<double>(layer));
      registry.mark_ready(parameter);
    }
    step();
    times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    zero();
  }
  times.erase(times.begin());
  return bench::median(times);
}

}  // namespace

int main(int argc, char** argv) try {
  Settings settings;
  const bench::Flags flags(argc, argv,
                           "bench_distributed [--backend auto|mpi|gloo] [--layers N] [--layer-elements N]\n"
                           "                  [--compute-ms MS] [--busy] [--steps N] [--fusion-mib MIB]\n"
                           "  the DistributedOptimizer's step against the raw allreduce of the same bytes; run on\n"
                           "  several ranks (mpirun -np 2 ...)",
                           {"--backend", "--layers", "--layer-elements", "--compute-ms", "--steps", "--fusion-mib"},
                           {"--busy"});
  settings.backend = flags.text("--backend", settings.backend);
  settings.layers = static_cast<int>(flags.integer("--layers", settings.layers));
  settings.layer_elements = flags.integer("--layer-elements", settings.layer_elements);
  settings.compute_ms = flags.number("--compute-ms", settings.compute_ms);
  settings.busy = flags.flag("--busy") || settings.busy;
  settings.steps = static_cast<int>(flags.integer("--steps", settings.steps));
  settings.fusion_mib = flags.number("--fusion-mib", settings.fusion_mib);
  auto comm = comm::connect(settings.backend);
  ParameterRegistry registry;
  for (int layer = 0; layer < settings.layers; ++layer) {
    registry.add("layer" + std::to_string(layer), {settings.layer_elements});
  }
  registry.finalize();
  optim::SGD sgd(registry, optim::SGD::Options{.lr = 0.0, .momentum = 0.0, .dampening = 0.0, .weight_decay = 0.0,
                                              .nesterov = false, .maximize = false});
  const double bytes = static_cast<double>(registry.total_numel()) * 4;

  comm->barrier();
  const double compute_only = run_steps(settings, registry, [&] { sgd.step(); }, [&] { sgd.zero_grad(); });

  double step = 0;
  std::int64_t buckets = 0;
  {
    dist::DistributedOptimizer optimizer(sgd, *comm,
                                         {.fusion_threshold_bytes = static_cast<std::size_t>(settings.fusion_mib * (1 << 20))});
    comm->barrier();
    step = run_steps(settings, registry, [&] { optimizer.step(); }, [&] { optimizer.zero_grad(); });
    buckets = optimizer.reducer() ? static_cast<std::int64_t>(optimizer.reducer()->bucket_count()) : 0;
  }

  // One allreduce of all the gradient bytes, median of the same number of calls.
  Tensor all = registry.arenas()[0].grads;
  std::vector<double> times;
  comm->allreduce(all, comm::ReduceOp::sum);
  for (int s = 0; s < settings.steps; ++s) {
    comm->barrier();
    const auto start = Clock::now();
    comm->allreduce(all, comm::ReduceOp::sum);
    times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  const double allreduce = bench::median(times);

  // The slowest rank's figures.
  Tensor figures = Tensor::from_vector(std::vector<double>{compute_only, step, allreduce}, {3});
  comm->allreduce_host(figures, comm::ReduceOp::max);
  const std::vector<double> f = figures.to_double_vector();
  if (comm->rank() == 0) {
    const double hidden = std::clamp(1.0 - (f[1] - f[0]) / f[2], 0.0, 1.0);
    std::printf("%s, %d ranks: %d layers x %lld f32 (%.1f MiB), %.1f ms %s compute per layer, %lld buckets\n",
                comm->backend(), comm->size(), settings.layers, static_cast<long long>(settings.layer_elements),
                bytes / (1 << 20), settings.compute_ms, settings.busy ? "busy" : "sleeping", static_cast<long long>(buckets));
    std::printf("%-12s %10s %12s %14s %8s\n", "", "compute ms", "step ms", "allreduce ms", "hidden");
    std::printf("%-12s %10.1f %12.1f %14.1f %7.0f%%\n", "median", f[0] * 1e3, f[1] * 1e3, f[2] * 1e3, hidden * 100);
    std::printf("sync cost (step - compute) = %.2fx one allreduce of all bytes\n", (f[1] - f[0]) / f[2]);
  }
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "bench_distributed: %s\n", error.what());
  return 1;
}
