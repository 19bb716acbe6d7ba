// One rank of a world that meets through comm::connect (the environment rendezvous).
//   connect_world BACKEND              every rank checks the world, a sum and a gather
//   connect_world BACKEND peer-dies    the last rank leaves right after connecting; the others
//                                      must get an error naming the operation, well within
//                                      the timeout, instead of hanging
//   connect_world BACKEND mismatch     rank 0 reduces 100 elements, the others 50: every rank
//                                      must end with our "collective mismatch" error (exit 0)
//   connect_world BACKEND stopped-peer the last rank stops itself (SIGSTOP); the others time out
//                                      (GRADSYNC_TIMEOUT_MS) and the job must still end
//   scripts/launch.sh 3 build/tests/connect_world gloo
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <csignal>

#include "gradsync/comm/connect.h"

int main(int argc, char** argv) {
  using namespace gradsync;
  const std::string mode = argc > 2 ? argv[2] : "";
  const bool peer_dies = mode == "peer-dies";
  try {
    auto comm = comm::connect(argc > 1 ? argv[1] : "auto");
    const int n = comm->size();
    if (peer_dies) {
      if (comm->rank() == n - 1) return 0;  // leaves: its sockets close
      const auto start = std::chrono::steady_clock::now();
      try {
        Tensor t = Tensor::from_vector(std::vector<double>{1.0}, {1});
        comm->allreduce(t, comm::ReduceOp::sum);
        std::fprintf(stderr, "rank %d: the allreduce completed although rank %d left\n", comm->rank(), n - 1);
        return 1;
      } catch (const Error& error) {
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::printf("rank %d got, after %.2f s: %s\n", comm->rank(), seconds, error.what());
        // The operation, and the peer that left by its rank (alone, or among the connections that
        // closed: rank 0 may see rank 1 leave too, after it failed; docs/communication.md).
        const std::string message = error.what();
        return message.find("allreduce #") != std::string::npos &&
                       message.find("rank " + std::to_string(n - 1)) != std::string::npos
                   ? 0
                   : 1;
      }
    }
    if (mode == "mismatch") {
      try {
        Tensor t = Tensor::from_vector(std::vector<double>(comm->rank() == 0 ? 100 : 50, 1.0), {comm->rank() == 0 ? 100 : 50});
        comm->allreduce(t, comm::ReduceOp::sum);
        std::fprintf(stderr, "rank %d: the mismatched allreduce completed\n", comm->rank());
        return 1;
      } catch (const Error& error) {
        std::printf("rank %d got: %s\n", comm->rank(), error.what());
        return std::string(error.what()).find("collective mismatch") != std::string::npos ? 0 : 1;
      }
    }
    if (mode == "stopped-peer") {
      if (comm->rank() == n - 1) std::raise(SIGSTOP);  // stuck: alive, silent
      Tensor t = Tensor::from_vector(std::vector<double>{1.0}, {1});
      try {
        comm->allreduce(t, comm::ReduceOp::sum);
      } catch (const Error& error) {
        std::printf("rank %d got: %s\n", comm->rank(), error.what());
        std::fflush(stdout);
        return 0;  // the process must still be able to end
      }
      return 1;
    }
    Tensor sum = Tensor::from_vector(std::vector<double>{comm->rank() + 1.0}, {1});
    comm->allreduce(sum, comm::ReduceOp::sum);
    Tensor mine = Tensor::from_vector(std::vector<double>{static_cast<double>(comm->rank())}, {1});
    Tensor all = Tensor::empty({n}, DType::f64);
    comm->allgather(mine, all);
    bool ok = sum.to_double_vector()[0] == n * (n + 1) / 2.0;
    const auto ranks = all.to_double_vector();
    for (int r = 0; r < n; ++r) ok = ok && ranks[static_cast<std::size_t>(r)] == r;
    std::printf("rank %d of %d (%s): %s\n", comm->rank(), n, comm->backend(), ok ? "ok" : "WRONG");
    return ok ? 0 : 1;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return 1;
  }
}
