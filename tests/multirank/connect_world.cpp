// One rank of a world that meets through comm::connect (the environment rendezvous): checks
// that every rank sees the same world and that a sum and a gather come out right.
//   scripts/launch.sh 3 build/tests/connect_world gloo
#include <cstdio>
#include <string>
#include <vector>

#include "gradsync/comm/connect.h"

int main(int argc, char** argv) {
  using namespace gradsync;
  try {
    auto comm = comm::connect(argc > 1 ? argv[1] : "auto");
    const int n = comm->size();
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
