// bench_ddp: DataParallel on a 25M-parameter MLP (24 x Linear(1024, 1024) + ReLU), real
// compute through our nn layers, for each sync strategy and number of microbatches.
//
// Per configuration, all measured in this run (median step over --steps after a warm-up):
//   step       forward + backward of every microbatch through DataParallel, plus an SGD step
//   local      the same step with communication off (the plain module, no wrapper)
//   allreduce  one allreduce of the whole gradient (all parameters at once)
//   sync cost  (step - local) / allreduce: the price of synchronizing, in allreduces
//   hidden     1 - sync cost, clipped to [0, 1]: the share of one allreduce the step did not pay
//   bytes      gradient bytes handed to the communicator per step
// and once per run the wrapper's memory: the growth of peak RSS from the same steps without
// DataParallel to the steps with it, next to one bucket (25 MiB).
//
//   mpirun -np 2 build/benchmarks/bench_ddp [--microbatches 1,2,4,8] [--strategies single,multi,forced]
//   scripts/simulate_nodes.sh -- build/benchmarks/bench_ddp --backend gloo --microbatches 1 --strategies single --powersgd-rank 4
//   benchmarks/compare_ddp.sh 2        (adds PyTorch DDP on gloo, same model, ranks, microbatches)
#include <algorithm>
#include <chrono>
#include <thread>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "bench_common.h"
#include "gradsync/core/timeline.h"
#include "gradsync/comm/connect.h"
#include "gradsync/dist/data_parallel/sync_strategy.h"
#include "gradsync/dist/hooks/powersgd.h"
#include "gradsync/nn/data_parallel_module.h"
#include "gradsync/nn/layers.h"
#include "gradsync/nn/loss.h"
#include "gradsync/optim/sgd.h"

using namespace gradsync;
using Clock = std::chrono::steady_clock;

namespace {

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) parts.push_back(part);
  return parts;
}

double peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) * 1024;
  }
  return 0;
}

// torch_ddp.py's step times: "strategy microbatches seconds" per line.
std::map<std::pair<std::string, int>, double> read_torch(const std::string& path) {
  std::map<std::pair<std::string, int>, double> table;
  if (path.empty()) return table;
  std::ifstream in(path);
  std::string strategy;
  int microbatches = 0;
  double seconds = 0;
  while (in >> strategy >> microbatches >> seconds) table[{strategy, microbatches}] = seconds;
  return table;
}

}  // namespace

// --idle-ms: a layer whose backward waits this long with the CPU free, as the host thread of a
// GPU engine waits on its kernels: the regime where work moved off the caller's thread (the
// PowerSGD hook's) can run beside the backward.
class Idle final : public nn::Module {
 public:
  Idle(ParameterRegistry& registry, double ms) : registry_(registry), ms_(ms) {}
  ParameterRegistry& registry() override { return registry_; }
  Tensor forward(const Tensor& input) override { return input; }
  Tensor backward(const Tensor& grad_output) override {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms_));
    return grad_output;
  }

 private:
  ParameterRegistry& registry_;
  double ms_;
};

int main(int argc, char** argv) try {
  const bench::Flags flags(argc, argv,
                           "bench_ddp [--backend auto|mpi|gloo|nccl] [--device cpu|cuda] [--microbatches 1,4]\n"
                           "          [--strategies single,multi,forced]\n"
                           "          [--layers 24] [--width 1024] [--batch 8 (samples per microbatch)] [--steps 5]\n"
                           "          [--torch FILE (from benchmarks/torch_ddp.py)] [--timeline-cost PATH]\n"
                           "          [--powersgd-rank R [--powersgd-on-caller (PyTorch's way: not overlapped)]]\n"
                           "          [--idle-ms MS (each layer's backward also waits MS with the CPU free, as a GPU engine's host)]\n"
                           "  DataParallel steps of an MLP against the compute-only step and PyTorch DDP; run on\n"
                           "  several ranks (mpirun -np 2 ..., or benchmarks/compare_ddp.sh)",
                           {"--microbatches", "--strategies", "--layers", "--width", "--batch", "--steps", "--torch",
                            "--backend", "--timeline-cost", "--device", "--powersgd-rank", "--idle-ms"},
                           {"--powersgd-on-caller"});
  const std::string microbatch_list = flags.text("--microbatches", "1,4");
  const std::string strategy_list = flags.text("--strategies", "single,multi,forced");
  const std::string torch_path = flags.text("--torch", "");
  const std::string backend = flags.text("--backend", "auto");
  const int layers = static_cast<int>(flags.integer("--layers", 24));
  const int width = static_cast<int>(flags.integer("--width", 1024));
  const int batch = static_cast<int>(flags.integer("--batch", 8));
  const int steps = static_cast<int>(flags.integer("--steps", 5));
  // The timeline's cost: the SINGLE step with it off, then recording into PATH (.rank<R>).
  const std::string timeline_path = flags.text("--timeline-cost", "");
  const int powersgd_rank = static_cast<int>(flags.integer("--powersgd-rank", 0));
  const bool powersgd_on_caller = flags.flag("--powersgd-on-caller");
  const double idle_ms = flags.number("--idle-ms", 0.0);
  const Device requested = Device::parse(flags.text("--device", "cpu"));
  auto comm = comm::connect(backend, requested);
  // NCCL: the rank's own GPU; a CPU backend with --device cuda: the GPU of the local rank,
  // its tensors staged through pinned host memory.
  const Device device = comm->device_type().is_cuda() ? comm->device_type()
                        : requested.is_cuda()
                            ? Device::cuda(comm::local_rank_from_environment(comm->rank()) % std::max(1, cuda_device_count()))
                            : Device::cpu();
  const auto torch = read_torch(torch_path);

  ParameterRegistry registry;
  auto model = std::make_shared<nn::Sequential>(registry);
  for (int l = 0; l < layers; ++l) {
    model->add<nn::Linear>("layer" + std::to_string(l), width, width, DType::f32, device);
    model->add<nn::ReLU>();
    if (idle_ms > 0) model->add<Idle>(idle_ms);
  }
  model->initialize(1);
  optim::SGD sgd(registry, optim::SGD::Options{.lr = 1e-4, .momentum = 0.9, .dampening = 0.0, .weight_decay = 0.0,
                                              .nesterov = false, .maximize = false});
  Tensor x = Tensor::from_vector(std::vector<float>(static_cast<std::size_t>(batch * width), 0.5f), {batch, width}).to(device);
  Tensor target = Tensor::zeros({batch, width}, DType::f32, device);
  const double gradient_bytes = static_cast<double>(registry.total_numel()) * 4;

  // One step of `microbatches` forward/backward passes through `module`, then SGD.
  const auto run_step = [&](nn::Module& module, int microbatches, std::optional<dist::DDPSyncStrategy> strategy) {
    for (int mb = 0; mb < microbatches; ++mb) {
      std::optional<nn::SyncContext> sync;
      if (strategy) sync.emplace(module, mb + 1 == microbatches, *strategy);
      const nn::LossResult loss = nn::mse_loss(module.forward(x), target, 1.0 / (batch * microbatches));
      module.backward(loss.grad);
      if (sync) sync->close();
    }
    sgd.step();
    sgd.zero_grad();
    synchronize(device);  // a GPU step ends when its kernels do
  };
  const auto median_step = [&](const std::function<void()>& step) {
    std::vector<double> times;
    step();  // warm-up
    for (int s = 0; s < steps; ++s) {
      comm->barrier();
      const auto start = Clock::now();
      step();
      times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
    std::sort(times.begin(), times.end());
    Tensor slowest = Tensor::from_vector(std::vector<double>{times[times.size() / 2]}, {1});
    comm->allreduce_host(slowest, comm::ReduceOp::max);
    return slowest.to_double_vector()[0];
  };

  // One allreduce of all the gradient bytes.
  Tensor all = registry.arenas()[0].grads;
  const double allreduce = median_step([&] {
    comm->allreduce(all, comm::ReduceOp::sum);
    synchronize(device);
  });

  // The local steps first: once DataParallel listens to the registry, every backward is its.
  std::map<int, double> local_seconds;
  for (const std::string& m : split(microbatch_list)) {
    local_seconds[std::stoi(m)] = median_step([&] { run_step(*model, std::stoi(m), std::nullopt); });
  }
  const double rss_before_ddp = peak_rss_bytes();
  auto ddp = std::make_shared<nn::DistributedDataParallel>(model, *comm);
  // --powersgd-rank R: every step after the first two through PowerSGD (dist/powersgd.h).
  std::shared_ptr<dist::PowerSGDState> powersgd;
  if (powersgd_rank > 0) {
    powersgd = std::make_shared<dist::PowerSGDState>(
        dist::PowerSGDOptions{.matrix_approximation_rank = powersgd_rank, .start_powerSGD_iter = 2,
                              .overlap_backward = !powersgd_on_caller});
    ddp->data_parallel().register_comm_hook(dist::powersgd_hook(powersgd));
  }
  if (comm->rank() == 0) {
    std::printf("%s, %d ranks, parameters on %s: %d x Linear(%d, %d) + ReLU, %.1fM parameters (%.0f MiB of gradients), %d samples per "
                "microbatch, %zu buckets; one allreduce of all of it: %.1f ms\n",
                comm->backend(), comm->size(), device.str().c_str(), layers, width, width, static_cast<double>(registry.total_numel()) / 1e6,
                gradient_bytes / (1 << 20), batch, ddp->data_parallel().reducer().bucket_count(), allreduce * 1e3);
    std::printf("%-8s %4s %10s %10s %10s %8s %12s", "strategy", "mb", "step ms", "local ms", "sync cost", "hidden",
                "MiB/step");
    if (!torch.empty()) std::printf(" %11s %11s %14s %16s", "torch ms", "ours/torch", "torch sync ms", "sync ours/torch");
    std::printf("\n");
  }
  for (const std::string& m : split(microbatch_list)) {
    const int microbatches = std::stoi(m);
    const double local = local_seconds[microbatches];
    for (const std::string& name : split(strategy_list)) {
      const dist::DDPSyncStrategy strategy =
          dist::parse_sync_strategy(name == "forced" ? "forced_sync" : name == "auto" ? "auto" : name + "_auto_sync");
      const std::int64_t bytes_before = ddp->data_parallel().reducer().stats().bytes_communicated;
      const double step = median_step([&] { run_step(*ddp, microbatches, strategy); });
      const double bytes = static_cast<double>(ddp->data_parallel().reducer().stats().bytes_communicated - bytes_before) /
                           (steps + 1);
      const double cost = (step - local) / allreduce;
      if (comm->rank() == 0) {
        std::printf("%-8s %4d %10.1f %10.1f %9.2fx %7.0f%% %12.1f", name.c_str(), microbatches, step * 1e3, local * 1e3,
                    cost, std::clamp(1.0 - cost, 0.0, 1.0) * 100, bytes / (1 << 20));
        // PyTorch's synchronization cost is its DDP step minus its compute-only step, as ours.
        const auto found = torch.find({name == "single" ? "no_sync" : name == "multi" ? "sync" : "", microbatches});
        const auto torch_local = torch.find({"local", microbatches});
        if (found != torch.end()) {
          std::printf(" %11.1f %10.2fx", found->second * 1e3, step / found->second);
          if (torch_local != torch.end()) {
            const double torch_sync = found->second - torch_local->second;
            std::printf(" %14.1f %15.2fx", torch_sync * 1e3, (step - local) / torch_sync);
          }
        }
        std::printf("\n");
      }
    }
  }
  if (powersgd && comm->rank() == 0) {
    std::printf("PowerSGD rank %d: %.2f MiB per compressed step to the collectives instead of %.2f (%.0fx fewer)\n",
                powersgd_rank, static_cast<double>(powersgd->numel_after_compression()) * 4 / (1 << 20) / static_cast<double>(powersgd->iteration() - 2),
                static_cast<double>(powersgd->numel_before_compression()) * 4 / (1 << 20) / static_cast<double>(powersgd->iteration() - 2),
                static_cast<double>(powersgd->numel_before_compression()) / static_cast<double>(std::max<std::int64_t>(powersgd->numel_after_compression(), 1)));
  }
  if (!timeline_path.empty()) {
    const int microbatches = std::stoi(split(microbatch_list).back());
    const auto single = dist::DDPSyncStrategy::single_auto_sync;
    const double off = median_step([&] { run_step(*ddp, microbatches, single); });
    timeline::start(timeline_path, comm->rank());
    const double on = median_step([&] { run_step(*ddp, microbatches, single); });
    timeline::stop();
    // Off, an event site is one relaxed atomic load: its cost, times the events of a step,
    // bounds the difference to a build without the timeline.
    constexpr int kCalls = 10'000'000;
    const auto start = Clock::now();
    for (int i = 0; i < kCalls; ++i) {
      if (timeline::enabled()) timeline::instant("bench", "ready " + std::to_string(i));  // as the call sites
    }
    const double per_call = std::chrono::duration<double>(Clock::now() - start).count() / kCalls;
    const double events_per_step = 4.0 * microbatches * static_cast<double>(registry.size()) + 64;  // generous
    if (comm->rank() == 0) {
      std::printf("timeline: SINGLE x%d step %.1f ms off, %.1f ms on (%.2fx); off, an event site costs %.2f ns, "
                  "about %.0f per step: %.5f%% of the step\n",
                  microbatches, off * 1e3, on * 1e3, on / off, per_call * 1e9, events_per_step,
                  100.0 * per_call * events_per_step / off);
    }
  }
  // Memory: the peak after the DataParallel steps over the peak of the same steps without it
  // (which already held parameters, gradients, momentum, activations and the communicator).
  Tensor rss = Tensor::from_vector(std::vector<double>{peak_rss_bytes() - rss_before_ddp, peak_rss_bytes()}, {2});
  comm->allreduce_host(rss, comm::ReduceOp::max);
  if (comm->rank() == 0) {
    const std::vector<double> r = rss.to_double_vector();
    std::printf("memory: the wrapper added %.1f MiB of peak RSS (one bucket: 25 MiB); peak RSS %.0f MiB, of which "
                "parameters + gradients + momentum %.0f MiB\n",
                r[0] / (1 << 20), r[1] / (1 << 20), gradient_bytes * 3 / (1 << 20));
  }
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "bench_ddp: %s\n", error.what());
  return 1;
}
