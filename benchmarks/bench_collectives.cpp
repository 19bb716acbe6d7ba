// bench_collectives: allreduce, allgather and broadcast from 4 B to 64 MiB (--max-bytes for
// more), reported as nccl-tests does: time per operation, algbw = bytes / time, and busbw
// (allreduce: algbw * 2(n-1)/n; allgather: algbw * (n-1)/n, bytes = the gathered output;
// broadcast: algbw). With MPI the same sizes also go through the raw MPI call
// (MPI_Allreduce, MPI_Allgather, MPI_Bcast) in the same run, and the last column is
// gradsync's time over the raw time: the cost of our layer (communication thread, Work
// handle, validation).
//
//   mpirun -np 2 build/benchmarks/bench_collectives --backend mpi
//   build/benchmarks/bench_collectives --backend gloo --ranks 2      (ranks as threads)
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <cstdio>
#include <string>

#include "bench_common.h"
#include "gradsync/comm/gloo.h"
#include "gradsync/comm/mpi.h"

using namespace gradsync;

namespace {

enum class Op { allreduce, allgather, broadcast };
const char* op_name(Op op) { return op == Op::allreduce ? "allreduce" : op == Op::allgather ? "allgather" : "broadcast"; }

double bus_factor(Op op, int n) {
  if (op == Op::allreduce) return 2.0 * (n - 1) / n;
  if (op == Op::allgather) return static_cast<double>(n - 1) / n;
  return 1.0;
}

// Average seconds per call over `iterations`, after a warm-up, between barriers; the
// slowest rank's figure (an allreduce of max), since a collective is as fast as its last rank.
double time_calls(comm::Communicator& comm, int iterations, const std::function<void()>& call) {
  call();
  comm.barrier();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) call();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iterations;
  Tensor slowest = Tensor::from_vector(std::vector<double>{seconds}, {1});
  comm.allreduce(slowest, comm::ReduceOp::max);
  return slowest.to_double_vector()[0];
}

void sweep(comm::Communicator& comm, std::int64_t max_bytes, bool raw_mpi) {
  const int n = comm.size();
  if (comm.rank() == 0) {
    std::printf("\n%s, %d ranks%s\n", comm.backend(), n, raw_mpi ? " (raw: the MPI call itself)" : "");
    std::printf("%-10s %12s %10s %10s %10s %10s %12s\n", "op", "bytes", "time us", "algbw GB/s", "busbw GB/s",
                "raw us", "ours/raw");
  }
  for (Op op : {Op::allreduce, Op::allgather, Op::broadcast}) {
    for (std::int64_t bytes = 4; bytes <= max_bytes; bytes *= 4) {
      const std::int64_t count = bytes / 4;
      const int iterations = static_cast<int>(std::clamp<std::int64_t>((64 << 20) / bytes, 3, 200));
      Tensor data = Tensor::zeros({op == Op::allgather ? count / n + (count / n == 0) : count}, DType::f32);
      Tensor gathered = Tensor::zeros({data.numel() * n}, DType::f32);
      const double reported_bytes = static_cast<double>(op == Op::allgather ? gathered.nbytes() : data.nbytes());
      std::function<void()> ours;
      std::function<void()> raw;
      switch (op) {
        case Op::allreduce:
          ours = [&] { comm.allreduce(data, comm::ReduceOp::sum); };
          raw = [&] { MPI_Allreduce(MPI_IN_PLACE, data.data(), static_cast<int>(data.numel()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); };
          break;
        case Op::allgather:
          ours = [&] { comm.allgather(data, gathered); };
          raw = [&] {
            MPI_Allgather(data.data(), static_cast<int>(data.numel()), MPI_FLOAT, gathered.data(),
                          static_cast<int>(data.numel()), MPI_FLOAT, MPI_COMM_WORLD);
          };
          break;
        case Op::broadcast:
          ours = [&] { comm.broadcast(data, 0); };
          raw = [&] { MPI_Bcast(data.data(), static_cast<int>(data.numel()), MPI_FLOAT, 0, MPI_COMM_WORLD); };
          break;
      }
      const double seconds = time_calls(comm, iterations, ours);
      double raw_seconds = 0.0;
      if (raw_mpi) raw_seconds = time_calls(comm, iterations, raw);
      if (comm.rank() == 0) {
        const double algbw = reported_bytes / seconds / 1e9;
        std::printf("%-10s %12.0f %10.1f %10.3f %10.3f", op_name(op), reported_bytes, seconds * 1e6, algbw,
                    algbw * bus_factor(op, n));
        if (raw_mpi) {
          std::printf(" %10.1f %11.3fx\n", raw_seconds * 1e6, seconds / raw_seconds);
        } else {
          std::printf(" %10s %12s\n", "-", "-");
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) try {
  std::string backend = "mpi";
  int ranks = 2;
  std::int64_t max_bytes = 64 << 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--backend") backend = argv[i + 1];
    else if (flag == "--ranks") ranks = std::stoi(argv[i + 1]);
    else if (flag == "--max-bytes") max_bytes = std::stoll(argv[i + 1]);
    else throw Error("unknown flag " + flag);
  }
  if (backend == "mpi") {
    auto comm = comm::mpi_world();
    sweep(*comm, max_bytes, /*raw_mpi=*/true);
  } else if (backend == "gloo") {
    comm::run_gloo_thread_group(ranks, [&](comm::Communicator& comm) { sweep(comm, max_bytes, false); });
  } else {
    throw Error("unknown backend " + backend + " (mpi or gloo)");
  }
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "bench_collectives: %s\n", error.what());
  return 1;
}
