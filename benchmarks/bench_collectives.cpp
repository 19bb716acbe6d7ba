// bench_collectives: allreduce, allgather and broadcast from 4 B to 64 MiB (--max-bytes for
// more), reported as nccl-tests does: time per operation, algbw = bytes / time, and busbw
// (allreduce: algbw * 2(n-1)/n; allgather: algbw * (n-1)/n, bytes = the gathered output;
// broadcast: algbw). In the same run the same sizes go through the raw library call with no
// gradsync layer (MPI_Allreduce / gloo::allreduce / ncclAllReduce, and the allgather and
// broadcast of each), and the "ours/raw" column is the cost of our layer. With --torch FILE
// (written by benchmarks/torch_collectives.py: torch.distributed on gloo, same ranks and
// sizes) two more columns compare with PyTorch.
//
// With --device cuda on mpi or gloo: device tensors staged through pinned host memory, each
// allreduce against its ceiling measured in the same run: the host allreduce of the same
// bytes plus one device-to-host and one host-to-device copy through pinned memory.
//
//   mpirun -np 2 build/benchmarks/bench_collectives --backend mpi
//   scripts/launch.sh 2 build/benchmarks/bench_collectives --backend gloo
//   scripts/launch.sh 2 build/benchmarks/bench_collectives --backend gloo --device cuda
//   benchmarks/compare_collectives.sh 2        (all of it, with the torch columns)
//   mpirun -np 4 build/benchmarks/bench_collectives --backend mpi --reproducible   (its cost)
//   scripts/simulate_nodes.sh --measure-link -- build/benchmarks/bench_collectives --backend gloo --hierarchical
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "bench_common.h"
#include "core/staging.h"
#include "gradsync/comm/connect.h"
#include "gradsync/comm/mpi/mpi.h"
#include "gradsync/config.h"
#if GRADSYNC_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

using namespace gradsync;

namespace {

enum class Op { allreduce, allgather, broadcast };
const char* op_name(Op op) { return op == Op::allreduce ? "allreduce" : op == Op::allgather ? "allgather" : "broadcast"; }

double bus_factor(Op op, int n) {
  if (op == Op::allreduce) return 2.0 * (n - 1) / n;
  if (op == Op::allgather) return static_cast<double>(n - 1) / n;
  return 1.0;
}

// The raw library's calls on the same buffers, with no gradsync layer.
struct RawCalls {
  std::function<void(Tensor&)> allreduce;
  std::function<void(const Tensor&, Tensor&)> allgather;
  std::function<void(Tensor&)> broadcast;
};

RawCalls raw_mpi() {
  return {
      [](Tensor& t) { MPI_Allreduce(MPI_IN_PLACE, t.data(), static_cast<int>(t.numel()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); },
      [](const Tensor& in, Tensor& out) {
        MPI_Allgather(in.data(), static_cast<int>(in.numel()), MPI_FLOAT, out.data(), static_cast<int>(in.numel()),
                      MPI_FLOAT, MPI_COMM_WORLD);
      },
      [](Tensor& t) { MPI_Bcast(t.data(), static_cast<int>(t.numel()), MPI_FLOAT, 0, MPI_COMM_WORLD); }};
}

// A Gloo context of its own, meeting through a folder named after the rendezvous port.
RawCalls raw_gloo(int rank, int size) {
  const std::string folder = "/tmp/gradsync-bench-gloo-" + std::string(std::getenv("MASTER_PORT") ? std::getenv("MASTER_PORT") : "0");
  std::filesystem::create_directories(folder);
  gloo::rendezvous::FileStore store(folder);
  gloo::transport::tcp::attr attributes;
  // The address the ranks' own Gloo listens on (scripts/simulate_nodes.sh gives each node its own).
  attributes.hostname = std::getenv("GRADSYNC_GLOO_HOST") ? std::getenv("GRADSYNC_GLOO_HOST") : "127.0.0.1";
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  auto device = gloo::transport::tcp::CreateDevice(attributes);
  context->connectFullMesh(store, device);
  auto tag = std::make_shared<std::uint32_t>(0);
  return {[context, tag](Tensor& t) {
            gloo::AllreduceOptions options(context);
            options.setOutput(t.data_as<float>(), static_cast<size_t>(t.numel()));
            options.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
            options.setTag((*tag)++);
            gloo::allreduce(options);
          },
          [context, tag](const Tensor& in, Tensor& out) {
            gloo::AllgatherOptions options(context);
            options.setInput(in.data_as<float>(), static_cast<size_t>(in.numel()));
            options.setOutput(out.data_as<float>(), static_cast<size_t>(out.numel()));
            options.setTag((*tag)++);
            gloo::allgather(options);
          },
          [context, tag](Tensor& t) {
            gloo::BroadcastOptions options(context);
            options.setOutput(t.data_as<float>(), static_cast<size_t>(t.numel()));
            options.setRoot(0);
            options.setTag((*tag)++);
            gloo::broadcast(options);
          }};
}

#if GRADSYNC_WITH_NCCL
// A second NCCL communicator, made with the plain NCCL API; calls are synchronized so that
// they are timed like our blocking forms.
RawCalls raw_nccl(comm::Communicator& ours) {
  ncclUniqueId id{};
  if (ours.rank() == 0) ncclGetUniqueId(&id);
  Tensor id_bytes = Tensor::from_vector(std::vector<float>(sizeof(id) / 4), {static_cast<std::int64_t>(sizeof(id) / 4)})
                        .to(ours.device_type());
  Tensor host = Tensor::wrap(&id, {static_cast<std::int64_t>(sizeof(id) / 4)}, DType::f32);
  id_bytes.copy_from(host);
  ours.broadcast(id_bytes, 0);
  host.copy_from(id_bytes);
  auto comm = std::make_shared<ncclComm_t>();
  if (ncclCommInitRank(comm.get(), ours.size(), id, ours.rank()) != ncclSuccess) throw Error("raw ncclCommInitRank failed");
  auto stream = std::make_shared<cudaStream_t>();
  cudaStreamCreateWithFlags(stream.get(), cudaStreamNonBlocking);
  return {[comm, stream](Tensor& t) {
            ncclAllReduce(t.data(), t.data(), static_cast<size_t>(t.numel()), ncclFloat32, ncclSum, *comm, *stream);
            cudaStreamSynchronize(*stream);
          },
          [comm, stream](const Tensor& in, Tensor& out) {
            ncclAllGather(in.data(), out.data(), static_cast<size_t>(in.numel()), ncclFloat32, *comm, *stream);
            cudaStreamSynchronize(*stream);
          },
          [comm, stream](Tensor& t) {
            ncclBroadcast(t.data(), t.data(), static_cast<size_t>(t.numel()), ncclFloat32, 0, *comm, *stream);
            cudaStreamSynchronize(*stream);
          }};
}
#endif

// torch.distributed's times, microseconds by (op, bytes), from torch_collectives.py.
using TorchTable = std::map<std::pair<std::string, std::int64_t>, double>;
TorchTable read_torch_table(const std::string& path) {
  TorchTable table;
  if (path.empty()) return table;
  std::ifstream in(path);
  if (!in) throw Error("cannot read the torch table " + path);
  std::string op;
  std::int64_t bytes = 0;
  double microseconds = 0;
  while (in >> op >> bytes >> microseconds) table[{op, bytes}] = microseconds;
  return table;
}

// Average seconds per call over `iterations`, best of three rounds (the least disturbed by
// other work on the machine), after a warm-up, between barriers; the slowest rank's figure
// (an allreduce of max), since a collective is as fast as its last rank.
double time_calls(comm::Communicator& comm, int iterations, const std::function<void()>& call) {
  call();
  synchronize(comm.device_type());
  double seconds = 1e30;
  for (int round = 0; round < 3; ++round) {
    comm.barrier();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iterations; ++i) call();
    synchronize(comm.device_type());
    seconds = std::min(seconds, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iterations);
  }
  Tensor slowest = Tensor::from_vector(std::vector<double>{seconds}, {1});
  comm.allreduce_host(slowest, comm::ReduceOp::max);
  return slowest.to_double_vector()[0];
}

// The same ranks without the always-on fingerprint check (docs/communication.md): the check's
// cost is the difference between the two.
std::unique_ptr<comm::Communicator> unverified_duplicate(comm::Communicator& comm) {
  ::setenv("GRADSYNC_VERIFY_COLLECTIVES", "0", 1);
  auto plain = comm.duplicate();
  ::unsetenv("GRADSYNC_VERIFY_COLLECTIVES");
  return plain;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

void sweep(comm::Communicator& comm, std::int64_t max_bytes, const RawCalls& raw, const TorchTable& torch, int runs) {
  const int n = comm.size();
  const bool cpu = comm.device_type().is_cpu();
  std::unique_ptr<comm::Communicator> unverified = cpu ? unverified_duplicate(comm) : nullptr;
  const Device device = comm.device_type();
  if (comm.rank() == 0) {
    std::printf("\n%s, %d ranks, f32 sum; raw = the library call itself%s\n", comm.backend(), n,
                torch.empty() ? "" : "; torch = torch.distributed (gloo)");
    std::printf("%-10s %12s %10s %10s %10s %10s %9s", "op", "bytes", "time us", "algbw GB/s", "busbw GB/s", "raw us",
                "ours/raw");
    if (!torch.empty()) std::printf(" %10s %10s", "torch us", "ours/torch");
    if (unverified) std::printf(" %13s %10s", "unverified us", "verify us");
    std::printf("\n");
  }
  for (Op op : {Op::allreduce, Op::allgather, Op::broadcast}) {
    for (std::int64_t bytes = 4; bytes <= max_bytes; bytes *= 4) {
      const std::int64_t count = bytes / 4;
      const int iterations = static_cast<int>(std::clamp<std::int64_t>((32 << 20) / bytes, 3, 100));
      Tensor data = Tensor::zeros({op == Op::allgather ? count / n + (count / n == 0) : count}, DType::f32, device);
      Tensor gathered = Tensor::zeros({data.numel() * n}, DType::f32, device);
      const std::int64_t reported_bytes = static_cast<std::int64_t>(op == Op::allgather ? gathered.nbytes() : data.nbytes());
      std::function<void()> ours;
      std::function<void()> theirs;
      switch (op) {
        case Op::allreduce:
          ours = [&] { comm.allreduce(data, comm::ReduceOp::sum); };
          theirs = [&] { raw.allreduce(data); };
          break;
        case Op::allgather:
          ours = [&] { comm.allgather(data, gathered); };
          theirs = [&] { raw.allgather(data, gathered); };
          break;
        case Op::broadcast:
          ours = [&] { comm.broadcast(data, 0); };
          theirs = [&] { raw.broadcast(data); };
          break;
      }
      // --runs R: ours and raw R times, alternating, each figure the median of its R.
      std::vector<double> ours_runs, raw_runs;
      for (int run = 0; run < runs; ++run) {
        ours_runs.push_back(time_calls(comm, iterations, ours));
        raw_runs.push_back(time_calls(comm, iterations, theirs));
      }
      const double seconds = median(ours_runs);
      const double raw_seconds = median(raw_runs);
      double unverified_seconds = 0;
      if (unverified && op == Op::allreduce) {
        unverified_seconds = time_calls(comm, iterations, [&] { unverified->allreduce(data, comm::ReduceOp::sum); });
      }
      if (comm.rank() == 0) {
        const double algbw = static_cast<double>(reported_bytes) / seconds / 1e9;
        std::printf("%-10s %12lld %10.1f %10.3f %10.3f %10.1f %8.3fx", op_name(op), static_cast<long long>(reported_bytes),
                    seconds * 1e6, algbw, algbw * bus_factor(op, n), raw_seconds * 1e6, seconds / raw_seconds);
        if (!torch.empty()) {
          const auto found = torch.find({op_name(op), reported_bytes});
          if (found != torch.end()) {
            std::printf(" %10.1f %9.3fx", found->second, seconds * 1e6 / found->second);
          } else {
            std::printf(" %10s %10s", "-", "-");
          }
        }
        if (unverified && unverified_seconds > 0) {
          std::printf(" %13.1f %10.1f", unverified_seconds * 1e6, (seconds - unverified_seconds) * 1e6);
        } else if (unverified) {
          std::printf(" %13s %10s", "-", "-");
        }
        std::printf("\n");
      }
    }
  }
}

// A duplicate of `comm` made while the environment has `variables` (a duplicate reads the
// knobs again), which are unset afterwards.
std::unique_ptr<comm::Communicator> duplicate_with(comm::Communicator& comm,
                                                   const std::vector<std::pair<const char*, const char*>>& variables) {
  for (const auto& [name, value] : variables) ::setenv(name, value, 1);
  auto duplicate = comm.duplicate();
  for (const auto& [name, value] : variables) ::unsetenv(name);
  return duplicate;
}

// A duplicate of `comm` in reproducible mode with `algorithm` (owner or chain).
std::unique_ptr<comm::Communicator> reproducible_duplicate(comm::Communicator& comm, const char* algorithm) {
  return duplicate_with(comm, {{"GRADSYNC_REPRODUCIBLE", "1"}, {"GRADSYNC_REPRODUCIBLE_ALGORITHM", algorithm}});
}

// Ranks on several nodes (scripts/simulate_nodes.sh, or real ones): the flat allreduce against
// the hierarchical one, same run, with bus bandwidth (nccl-tests' definition over the whole
// world: algbw * 2(n-1)/n) beside the link's rate (GRADSYNC_LINK_MBPS, which
// simulate_nodes.sh --measure-link measures with one TCP stream between two nodes).
void hierarchical_sweep(comm::Communicator& comm, std::int64_t max_bytes, const RawCalls& raw) {
  const int n = comm.size();
  auto flat = duplicate_with(comm, {{"GRADSYNC_HIERARCHICAL", "0"}});
  auto hierarchical = duplicate_with(comm, {{"GRADSYNC_HIERARCHICAL", "1"}});
  const char* link_text = std::getenv("GRADSYNC_LINK_MBPS");
  const double link = link_text != nullptr ? std::atof(link_text) : 0.0;  // MB/s
  if (comm.rank() == 0) {
    std::printf("\n%s, %d ranks, f32 sum: flat against hierarchical allreduce; link %s MB/s\n", comm.backend(), n,
                link > 0 ? link_text : "unknown (set GRADSYNC_LINK_MBPS)");
    std::printf("%12s %10s %10s %10s %11s %11s %10s %10s %9s\n", "bytes", "raw us", "flat us", "hier us",
                "flat busbw", "hier busbw", "flat/link", "hier/link", "hier/flat");
  }
  for (std::int64_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
    const int iterations = static_cast<int>(std::clamp<std::int64_t>((32 << 20) / bytes, 3, 100));
    Tensor data = Tensor::zeros({bytes / 4}, DType::f32);
    const double raw_seconds = time_calls(comm, iterations, [&] { raw.allreduce(data); });
    const double flat_seconds = time_calls(comm, iterations, [&] { flat->allreduce(data, comm::ReduceOp::sum); });
    const double hier_seconds =
        time_calls(comm, iterations, [&] { hierarchical->allreduce(data, comm::ReduceOp::sum); });
    if (comm.rank() == 0) {
      const auto busbw = [&](double seconds) { return static_cast<double>(bytes) / seconds / 1e6 * bus_factor(Op::allreduce, n); };
      std::printf("%12lld %10.1f %10.1f %10.1f %11.1f %11.1f", static_cast<long long>(bytes), raw_seconds * 1e6,
                  flat_seconds * 1e6, hier_seconds * 1e6, busbw(flat_seconds), busbw(hier_seconds));
      if (link > 0) {
        std::printf(" %10.2f %10.2f", busbw(flat_seconds) / link, busbw(hier_seconds) / link);
      } else {
        std::printf(" %10s %10s", "-", "-");
      }
      std::printf(" %8.2fx\n", hier_seconds / flat_seconds);
    }
  }
}

// Reproducible mode's cost: the allreduce and the reduce-scatter with each ordered algorithm
// against the same communicator's ordinary path and the raw library allreduce, same run.
void reproducible_sweep(comm::Communicator& comm, std::int64_t max_bytes, const RawCalls& raw) {
  const int n = comm.size();
  auto owner = reproducible_duplicate(comm, "owner");
  auto chain = reproducible_duplicate(comm, "chain");
  if (comm.rank() == 0) {
    std::printf("\n%s, %d ranks, f32 sum: reproducible mode (ascending rank order) against the ordinary path\n",
                comm.backend(), n);
    std::printf("%-15s %12s %10s %10s %10s %10s %9s %9s\n", "op", "bytes", "raw us", "ordinary", "owner us", "chain us",
                "owner/ord", "chain/ord");
  }
  for (const bool scatter : {false, true}) {
    for (std::int64_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
      const std::int64_t count = bytes / 4 / n * n;
      const int iterations = static_cast<int>(std::clamp<std::int64_t>((32 << 20) / bytes, 3, 100));
      Tensor data = Tensor::zeros({count}, DType::f32);
      Tensor piece = Tensor::zeros({count / n}, DType::f32);
      const auto call = [&](comm::Communicator& c) {
        return [&] {
          if (scatter) {
            c.reduce_scatter(data, piece, comm::ReduceOp::sum);
          } else {
            c.allreduce(data, comm::ReduceOp::sum);
          }
        };
      };
      const double raw_seconds = scatter ? 0.0 : time_calls(comm, iterations, [&] { raw.allreduce(data); });
      const double ordinary = time_calls(comm, iterations, call(comm));
      const double by_owner = time_calls(comm, iterations, call(*owner));
      const double by_chain = time_calls(comm, iterations, call(*chain));
      if (comm.rank() == 0) {
        std::printf("%-15s %12lld ", scatter ? "reduce_scatter" : "allreduce", static_cast<long long>(count * 4));
        if (scatter) {
          std::printf("%10s", "-");
        } else {
          std::printf("%10.1f", raw_seconds * 1e6);
        }
        std::printf(" %10.1f %10.1f %10.1f %8.2fx %8.2fx\n", ordinary * 1e6, by_owner * 1e6, by_chain * 1e6,
                    by_owner / ordinary, by_chain / ordinary);
      }
    }
  }
}

// Device tensors on a CPU backend: the staged allreduce against the host allreduce of the same
// bytes plus one round trip of copies through pinned memory (the least staging can cost
// without overlap; with several operations in flight the copies of one overlap the wire of
// another, which is what a Reducer's buckets get).
void staged_sweep(comm::Communicator& comm, std::int64_t max_bytes, Device device) {
  if (comm.rank() == 0) {
    std::printf("\n%s, %d ranks, f32 sum, tensors on %s staged through pinned host memory\n", comm.backend(), comm.size(),
                device.str().c_str());
    std::printf("%12s %11s %11s %11s %12s %9s %13s\n", "bytes", "staged us", "host us", "copies us", "ceiling us",
                "ratio", "8 in flight us");
  }
  for (std::int64_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
    const std::int64_t count = bytes / 4;
    const int iterations = static_cast<int>(std::clamp<std::int64_t>((32 << 20) / bytes, 3, 100));
    Tensor on_device = Tensor::zeros({count}, DType::f32, device);
    Tensor on_host = Tensor::zeros({count}, DType::f32);
    detail::PooledBuffer pinned = detail::lease_pinned(static_cast<std::size_t>(bytes));
    Tensor pinned_view = Tensor::wrap(pinned.data(), {count}, DType::f32);
    const double staged = time_calls(comm, iterations, [&] { comm.allreduce(on_device, comm::ReduceOp::sum); });
    const double host = time_calls(comm, iterations, [&] { comm.allreduce(on_host, comm::ReduceOp::sum); });
    const double copies = time_calls(comm, iterations, [&] {
      pinned_view.copy_from(on_device);
      on_device.copy_from(pinned_view);
    });
    // Eight buckets in flight at once, per bucket: where the copies hide behind the wire.
    std::vector<Tensor> buckets;
    for (int k = 0; k < 8; ++k) buckets.push_back(Tensor::zeros({count}, DType::f32, device));
    const double pipelined = time_calls(comm, std::max(1, iterations / 8), [&] {
                               std::vector<comm::WorkHandle> works;
                               for (Tensor& bucket : buckets) works.push_back(comm.allreduce_async(bucket, comm::ReduceOp::sum));
                               for (auto& work : works) work->wait();
                             }) / 8;
    if (comm.rank() == 0) {
      std::printf("%12lld %11.1f %11.1f %11.1f %12.1f %8.3fx %13.1f\n", static_cast<long long>(bytes), staged * 1e6,
                  host * 1e6, copies * 1e6, (host + copies) * 1e6, staged / (host + copies), pipelined * 1e6);
    }
  }
}

}  // namespace

int main(int argc, char** argv) try {
  const bench::Flags flags(argc, argv,
                           "bench_collectives [--backend mpi|gloo|nccl (mpi)] [--max-bytes N (64 MiB)] [--torch FILE]\n"
                           "  [--runs R (1): ours and the raw call R times each, alternating; the medians]\n"
                           "  [--device cuda (mpi, gloo: device tensors staged through pinned memory, against\n"
                           "  the host allreduce plus one copy each way)]\n"
                           "  allreduce, allgather and broadcast from 4 B to N bytes, ours against the raw library call\n"
                           "  (and torch.distributed with --torch FILE from benchmarks/torch_collectives.py); run on\n"
                           "  several ranks: mpirun -np 2 ..., or scripts/launch.sh 2 ... --backend gloo\n"
                           "  [--reproducible: instead, the cost of reproducible mode (both algorithms) on mpi or gloo]\n"
                           "  [--hierarchical: instead, flat against hierarchical allreduce, for ranks on several nodes:\n"
                           "   scripts/simulate_nodes.sh --measure-link -- build/benchmarks/bench_collectives --backend gloo\n"
                           "   --hierarchical]",
                           {"--backend", "--max-bytes", "--torch", "--device", "--runs"}, {"--reproducible", "--hierarchical"});
  const std::string backend = flags.text("--backend", "mpi");
  const std::string torch_path = flags.text("--torch", "");
  const std::int64_t max_bytes = flags.integer("--max-bytes", 64 << 20);
  const int runs = static_cast<int>(std::max<std::int64_t>(flags.integer("--runs", 1), 1));
  const TorchTable torch = read_torch_table(torch_path);
  const Device device = Device::parse(flags.text("--device", "cpu"));
  if (device.is_cuda()) {
    if (backend != "mpi" && backend != "gloo") throw Error("--device cuda is for the staged mpi and gloo backends");
    auto comm = comm::connect(backend);
    const int devices = cuda_device_count();
    if (devices == 0) throw Error("--device cuda: " + cuda_unavailable_reason());
    staged_sweep(*comm, max_bytes, Device::cuda(comm::local_rank_from_environment(comm->rank()) % devices));
    return 0;
  }
  if (backend == "mpi") {
    auto comm = comm::connect("mpi");
    if (flags.flag("--reproducible")) return reproducible_sweep(*comm, max_bytes, raw_mpi()), 0;
    if (flags.flag("--hierarchical")) return hierarchical_sweep(*comm, max_bytes, raw_mpi()), 0;
    sweep(*comm, max_bytes, raw_mpi(), torch, runs);
  } else if (backend == "gloo") {
    auto comm = comm::connect("gloo");
    if (flags.flag("--reproducible")) return reproducible_sweep(*comm, max_bytes, raw_gloo(comm->rank(), comm->size())), 0;
    if (flags.flag("--hierarchical")) return hierarchical_sweep(*comm, max_bytes, raw_gloo(comm->rank(), comm->size())), 0;
    sweep(*comm, max_bytes, raw_gloo(comm->rank(), comm->size()), torch, runs);
  } else if (backend == "nccl") {
#if GRADSYNC_WITH_NCCL
    auto comm = comm::connect("nccl", Device::cuda());
    sweep(*comm, max_bytes, raw_nccl(*comm), torch, runs);
#else
    throw Error("this build has no NCCL");
#endif
  } else {
    throw Error("unknown backend " + backend + " (mpi, gloo or nccl)");
  }
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "bench_collectives: %s\n", error.what());
  return 1;
}
