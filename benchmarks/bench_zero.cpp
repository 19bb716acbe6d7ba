// bench_zero: what ZeRO saves (memory) and what it costs (time), on a synthetic backward.
//
// The model: --layers layers of --layer-elements f32 (24 x 2^20 = 25.2M parameters by
// default), Adam. Each step, a synthetic backward writes every layer's gradient (last first)
// and marks it ready; DataParallel reduces (stage 0 and 1: allreduce; stages 2 and 3:
// reduce-scatter); then the optimizer steps (stages 1-3: this rank's pieces; stages 1 and 2 then
// gather the parameters). Stage 3 has one unit per layer: a forward gathers and releases each
// layer in turn, the backward gathers it again (the gathers replay the first step's order as
// prefetches).
//
//   bench_zero                 per stage 0-3 in one run: the optimizer state this rank holds
//                              (measured: the bytes its buffers take) next to its ceiling,
//                              total / N + one bucket; the median step time and its ratio to
//                              stage 0's, with one allreduce of every gradient as the yardstick
//   bench_zero --memory S      only stage S, then this process's peak RSS (getrusage): run it
//                              once per stage (benchmarks/compare_zero.sh) to compare the peaks
//   --forward-ms MS            each step begins with a forward sleeping MS in all (the CPU free,
//                              as while a GPU computes), layer by layer; stages 1 and 2 then use
//                              step_async and wait_for(layer) before each layer's forward, so the
//                              parameter gathers travel behind the next forward; stage 3's
//                              gathers travel behind the previous layer's forward (or backward)
//   --backward-ms MS           the backward's compute, layer by layer (default: twice the
//                              forward, as a real layer's backward costs)
//   --hsdp N                   also stages 2 and 3 sharded inside groups of N ranks (0: one per node)
//                              and replicated across them (dist/shard_groups.h); every row says the
//                              bytes this node sent to the others per step (scripts/simulate_nodes.sh)
//
//   mpirun -np 4 build/benchmarks/bench_zero
//   benchmarks/compare_zero.sh 4
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "bench_common.h"
#include "gradsync/comm/connect.h"
#include "gradsync/dist/data_parallel/data_parallel.h"
#include "gradsync/dist/zero/shard_groups.h"
#include "gradsync/dist/zero/zero.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/optim/adam.h"

using namespace gradsync;
using Clock = std::chrono::steady_clock;

namespace {

struct Result {
  double step_seconds = 0;
  std::int64_t state_bytes = 0;
  std::int64_t bucket_bytes = 0;  // the largest bucket
  double sent_per_step = 0;       // bytes this node's network interfaces sent per step
};

// A layer's simulated compute: the CPU free, as while a GPU computes.
void compute(double ms) {
  if (ms > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
}

// `groups`: HSDP (stages 2 and 3 sharded inside each group, replicated across the groups).
Result run_stage(comm::Communicator& comm, int layers, std::int64_t elements, int stage, int steps, double forward_ms,
                 double backward_ms, dist::ShardGroups* groups = nullptr) {
  ParameterRegistry registry;
  for (int layer = 0; layer < layers; ++layer) registry.add("layer" + std::to_string(layer), {elements});
  registry.finalize();
  optim::Adam adam(registry, optim::Adam::Options{.lr = 1e-4});
  dist::DataParallelOptions options{.shard_gradients = stage >= 2};
  if (stage == 3) {  // one unit per layer
    for (Parameter& layer : registry) options.units.push_back({&layer});
  }
  if (groups != nullptr) options.replicas = &groups->replicas();
  dist::DataParallel ddp(registry, groups != nullptr ? groups->shard() : comm, options);
  std::unique_ptr<dist::ZeroOptimizer> zero;
  if (stage > 0) zero = std::make_unique<dist::ZeroOptimizer>(adam, ddp, dist::ZeroOptions{.stage = stage});
  std::vector<double> times;
  double sent_before = 0;
  for (int s = 0; s <= steps; ++s) {
    comm.barrier();
    if (s == 1) sent_before = static_cast<double>(comm::node_bytes_sent());
    const auto start = Clock::now();
    // Stage 3: each layer gathered for its forward and released after it (the gathers of the
    // next layers replayed behind it from the second step: auto prefetch), gathered again for
    // its backward; the last layer stays gathered from its forward to its backward (as FSDP2's
    // root module: its backward comes next).
    const std::size_t last = registry.size() - 1;
    if (forward_ms > 0 || stage == 3) {
      for (std::size_t layer = 0; layer < registry.size(); ++layer) {
        if (stage == 3) {
          zero->gather(layer);
        } else if (zero) {
          zero->wait_for(registry[layer]);  // this layer's parameters have arrived
        }
        compute(forward_ms / static_cast<double>(layers));
        if (stage == 3 && layer != last) zero->release(layer);
      }
    }
    ddp.begin_backward();
    for (std::size_t layer = registry.size(); layer-- > 0;) {
      if (stage == 3) zero->gather(layer);
      compute(backward_ms / static_cast<double>(layers));
      ops::fill(registry[layer].grad_for_overwrite(), 1e-3 * static_cast<double>(layer + 1));
      registry.mark_ready(registry[layer]);
      if (stage == 3) zero->release(layer);
    }
    ddp.end_backward();
    if (zero) {
      forward_ms > 0 ? zero->step_async() : zero->step();  // with a forward next, the gathers go behind it (1, 2)
    } else {
      adam.step();
    }
    adam.zero_grad();
    if (s > 0) times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  if (zero) zero->wait_all();
  comm.barrier();
  Result result;
  result.sent_per_step = steps > 0 ? (static_cast<double>(comm::node_bytes_sent()) - sent_before) / steps : 0.0;
  result.step_seconds = bench::median(times);
  result.state_bytes = adam.state_bytes();
  for (std::size_t b = 0; b < ddp.reducer().bucket_count(); ++b) {
    result.bucket_bytes = std::max<std::int64_t>(result.bucket_bytes, ddp.reducer().bucket(b).numel * 4);
  }
  return result;
}

double peak_rss_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // KiB on Linux
}

}  // namespace

int main(int argc, char** argv) try {
  const bench::Flags flags(argc, argv,
                           "bench_zero [--backend auto|mpi|gloo] [--layers N] [--layer-elements N] [--steps N]\n"
                           "           [--memory STAGE] [--forward-ms MS [--backward-ms MS]] [--hsdp RANKS_PER_GROUP]\n"
                           "  ZeRO stages 0-3: optimizer state per rank, step time (or, with --memory, one stage's\n"
                           "  peak RSS); --hsdp adds stages 2 and 3 sharded in groups (0: one per node) and\n"
                           "  replicated across them; run on several ranks (mpirun -np 4 ...)",
                           {"--backend", "--layers", "--layer-elements", "--steps", "--memory", "--forward-ms",
                            "--backward-ms", "--hsdp"}, {});
  auto comm = comm::connect(flags.text("--backend", "auto"));
  const int layers = static_cast<int>(flags.integer("--layers", 24));
  const std::int64_t elements = flags.integer("--layer-elements", 1 << 20);
  const int steps = static_cast<int>(flags.integer("--steps", 5));
  const int memory_stage = static_cast<int>(flags.integer("--memory", -1));
  const double forward_ms = flags.number("--forward-ms", 0.0);
  const double backward_ms = flags.number("--backward-ms", 2 * forward_ms);
  const int hsdp = static_cast<int>(flags.integer("--hsdp", -1));
  const double total_mib = static_cast<double>(layers * elements) * 4 / (1 << 20);
  const int world = comm->size();

  if (memory_stage >= 0) {
    const Result r = run_stage(*comm, layers, elements, memory_stage, 2, 0.0, 0.0);
    Tensor rss = Tensor::from_vector(std::vector<double>{peak_rss_mib()}, {1});
    comm->allreduce_host(rss, comm::ReduceOp::max);
    if (comm->rank() == 0) {
      std::printf("stage %d, %d ranks, %.1fM parameters (%.0f MiB), Adam: optimizer state %.1f MiB per rank, peak RSS "
                  "%.0f MiB (largest rank)\n",
                  memory_stage, world, static_cast<double>(layers * elements) / 1e6, total_mib,
                  static_cast<double>(r.state_bytes) / (1 << 20), rss.to_double_vector()[0]);
    }
    return 0;
  }

  // The yardstick: one allreduce of every gradient byte.
  Tensor all = Tensor::zeros({layers * elements}, DType::f32);
  std::vector<double> times;
  for (int s = 0; s <= steps; ++s) {
    comm->barrier();
    const auto start = Clock::now();
    comm->allreduce(all, comm::ReduceOp::sum);
    if (s > 0) times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  const double allreduce = bench::median(times);
  all = Tensor();

  // Stages 0-3 over every rank, then (--hsdp) stages 2 and 3 sharded inside each group.
  struct Row {
    std::string label;
    Result result;
    int shards = 1;  // ranks that split the state
  };
  std::vector<Row> rows;
  for (int stage = 0; stage < 4; ++stage) {
    rows.push_back({std::to_string(stage), run_stage(*comm, layers, elements, stage, steps, forward_ms, backward_ms),
                    stage == 0 ? 1 : world});
  }
  if (hsdp >= 0) {
    dist::ShardGroups groups(*comm, hsdp);
    const std::string shape = " hsdp " + std::to_string(groups.groups()) + "x" + std::to_string(groups.group_size());
    for (const int stage : {2, 3}) {
      rows.push_back({std::to_string(stage) + shape,
                      run_stage(*comm, layers, elements, stage, steps, forward_ms, backward_ms, &groups), groups.group_size()});
    }
  }
  if (comm->rank() == 0) {
    std::printf("%s, %d ranks: %d layers x %lld f32 = %.1fM parameters (%.0f MiB), Adam; one allreduce of every "
                "gradient %.1f ms%s\n",
                comm->backend(), world, layers, static_cast<long long>(elements),
                static_cast<double>(layers * elements) / 1e6, total_mib, allreduce * 1e3,
                forward_ms > 0 ? ("; a " + std::to_string(static_cast<int>(forward_ms)) + " ms forward and a " +
                                  std::to_string(static_cast<int>(backward_ms)) +
                                  " ms backward per step, the gathers behind them")
                                     .c_str()
                               : "");
    std::printf("%-14s %16s %26s %10s %12s %22s\n", "stage", "state MiB/rank", "ceiling (total/N + bucket)", "step ms",
                "vs stage 0", "sent off node MB/step");
    const double full_state = static_cast<double>(rows[0].result.state_bytes) / (1 << 20);
    for (const Row& row : rows) {
      const Result& r = row.result;
      const double ceiling =
          row.shards == 1 ? full_state : full_state / row.shards + static_cast<double>(r.bucket_bytes) * 2 / (1 << 20);
      std::printf("%-14s %16.1f %26.1f %10.1f %11.2fx %22.1f\n", row.label.c_str(),
                  static_cast<double>(r.state_bytes) / (1 << 20), ceiling, r.step_seconds * 1e3,
                  r.step_seconds / rows[0].result.step_seconds, r.sent_per_step / 1e6);
    }
  }
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "bench_zero: %s\n", error.what());
  return 1;
}
