// bench_join: what uneven inputs cost (dist::Join over DataParallel, DistributedOptimizer::join).
//
// A synthetic model (--layers layers of --layer-elements f32; each layer of the backward
// sleeps --compute-ms, writes its gradient and marks it ready, as bench_distributed). Per front
// end, all measured in this run (median of --repeats runs, slowest rank):
//   even      every rank takes --steps steps (no Join), then a barrier
//   uneven    rank r takes steps - r * steps / (2W) steps, then joins (shadowing the others)
//   ratio     uneven / even: ~1, since the longest rank takes as many steps either way
//   overhead  uneven - even, next to its ceiling: the final shadow step (one allreduce of every
//             gradient, issued before the status that says everyone has joined), plus the
//             broadcasts that make the replicas equal (parameters; optimizer state with Join)
//   allreduce one allreduce of every gradient, broadcast: one broadcast of every parameter
//
//   mpirun -np 2 build/benchmarks/bench_join
//   scripts/launch.sh 4 build/benchmarks/bench_join --backend gloo
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>

#include "bench_common.h"
#include "gradsync/comm/connect.h"
#include "gradsync/dist/data_parallel/data_parallel.h"
#include "gradsync/dist/horovod/distributed_optimizer.h"
#include "gradsync/dist/join/join.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/optim/sgd.h"

using namespace gradsync;
using Clock = std::chrono::steady_clock;

namespace {

struct Settings {
  std::string backend = "auto";
  int layers = 8;
  std::int64_t layer_elements = 1 << 19;
  double compute_ms = 2.0;
  int steps = 12;
  int repeats = 3;
};

void backward(const Settings& settings, ParameterRegistry& registry) {
  for (std::size_t layer = registry.size(); layer-- > 0;) {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(settings.compute_ms));
    Parameter& parameter = registry[layer];
    ops::fill(parameter.grad_for_overwrite(), 0.001 * static_cast<double>(layer));
    registry.mark_ready(parameter);
  }
}

// Seconds of the slowest rank: barrier, `body`, barrier; median over the repeats.
double timed(comm::Communicator& comm, int repeats, const std::function<void()>& body) {
  std::vector<double> times;
  for (int k = 0; k < repeats; ++k) {
    comm.barrier();
    const auto start = Clock::now();
    body();
    comm.barrier();
    Tensor seconds = Tensor::from_vector(std::vector<double>{std::chrono::duration<double>(Clock::now() - start).count()}, {1});
    comm.allreduce_host(seconds, comm::ReduceOp::max);
    times.push_back(seconds.to_double_vector()[0]);
  }
  return bench::median(times);
}

}  // namespace

int main(int argc, char** argv) try {
  Settings settings;
  const bench::Flags flags(argc, argv,
                           "bench_join [--backend auto|mpi|gloo] [--layers N] [--layer-elements N] [--compute-ms MS]\n"
                           "           [--steps N] [--repeats N]\n"
                           "  an epoch with uneven inputs (Join) against the same epoch with even ones; run on several\n"
                           "  ranks (mpirun -np 2 ...)",
                           {"--backend", "--layers", "--layer-elements", "--compute-ms", "--steps", "--repeats"}, {});
  settings.backend = flags.text("--backend", settings.backend);
  settings.layers = static_cast<int>(flags.integer("--layers", settings.layers));
  settings.layer_elements = flags.integer("--layer-elements", settings.layer_elements);
  settings.compute_ms = flags.number("--compute-ms", settings.compute_ms);
  settings.steps = static_cast<int>(flags.integer("--steps", settings.steps));
  settings.repeats = static_cast<int>(flags.integer("--repeats", settings.repeats));
  auto comm = comm::connect(settings.backend);
  GRADSYNC_CHECK(comm->size() > 1, "bench_join: run on several ranks (mpirun -np 2 ...)");
  const int world = comm->size();
  const int mine = settings.steps - comm->rank() * settings.steps / (2 * world);

  ParameterRegistry registry;
  for (int layer = 0; layer < settings.layers; ++layer) registry.add("layer" + std::to_string(layer), {settings.layer_elements});
  registry.finalize();
  optim::SGD sgd(registry, optim::SGD::Options{.lr = 1e-6, .momentum = 0.9, .dampening = 0.0, .weight_decay = 0.0,
                                              .nesterov = false, .maximize = false});
  const double mib = static_cast<double>(registry.total_numel()) * 4 / (1 << 20);

  Tensor all = registry.arenas()[0].grads;
  const double allreduce = timed(*comm, settings.repeats * 3, [&] { comm->allreduce(all, comm::ReduceOp::sum); });
  Tensor values = registry.arenas()[0].values;
  const double broadcast = timed(*comm, settings.repeats * 3, [&] { comm->broadcast(values, 0); });

  const auto train = [&](int steps, const std::function<void()>& step) {
    for (int s = 0; s < steps; ++s) {
      backward(settings, registry);
      step();
    }
  };
  double ddp_even = 0, ddp_uneven = 0, hvd_even = 0, hvd_uneven = 0;
  {
    dist::DataParallel ddp(registry, *comm);
    const auto step = [&] {
      ddp.end_backward();  // the backward's ready signals began it
      sgd.step();
      sgd.zero_grad();
    };
    ddp_even = timed(*comm, settings.repeats, [&] { train(settings.steps, step); });
    ddp_uneven = timed(*comm, settings.repeats, [&] {
      dist::Join join(ddp, {}, &sgd);
      train(mine, step);
      join.join();
    });
  }
  {
    dist::DistributedOptimizer optimizer(sgd, *comm);
    const auto step = [&] {
      optimizer.step();
      optimizer.zero_grad();
    };
    hvd_even = timed(*comm, settings.repeats, [&] { train(settings.steps, step); });
    hvd_uneven = timed(*comm, settings.repeats, [&] {
      train(mine, step);
      dist::broadcast_parameters(registry, *comm, optimizer.join());
    });
  }
  if (comm->rank() == 0) {
    std::printf("%s, %d ranks: %d layers x %lld f32 (%.1f MiB), %.1f ms sleeping compute per layer; rank 0 takes %d "
                "steps, rank %d takes %d\n",
                comm->backend(), world, settings.layers, static_cast<long long>(settings.layer_elements), mib,
                settings.compute_ms, settings.steps, world - 1,
                settings.steps - (world - 1) * settings.steps / (2 * world));
    std::printf("one allreduce of every gradient %.2f ms, one broadcast of every parameter %.2f ms\n", allreduce * 1e3,
                broadcast * 1e3);
    std::printf("%-24s %10s %10s %7s %12s %22s\n", "", "even ms", "uneven ms", "ratio", "overhead ms",
                "ceiling ms");
    const auto row = [&](const char* name, double even, double uneven, double ceiling, const char* what) {
      std::printf("%-24s %10.1f %10.1f %7.3f %12.2f %10.2f %s\n", name, even * 1e3, uneven * 1e3, uneven / even,
                  (uneven - even) * 1e3, ceiling * 1e3, what);
    };
    // Join also broadcasts the optimizer's state (the momentum: one more parameter-sized message).
    row("DataParallel + Join", ddp_even, ddp_uneven, allreduce + 2 * broadcast, "(allreduce + 2 broadcasts)");
    row("DistributedOptimizer", hvd_even, hvd_uneven, allreduce + broadcast, "(allreduce + broadcast)");
  }
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "bench_join: %s\n", error.what());
  return 1;
}
