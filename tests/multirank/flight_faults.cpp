// A small data-parallel job with one fault planted on its last rank at step 3, for the flight
// recorder's end-to-end test (flight_recorder.sh) and its documentation:
//   flight_faults stopped   the last rank stops (a compute that never ends) before step 3's backward
//   flight_faults skip      the last rank's engine skips bucket 1 of step 3 and goes on
//   flight_faults differ    the last rank runs an allgather where the others allreduce the loss
// Each step: a backward through DataParallel (three buckets, named in the flight record by the
// Reducer), then the loss averaged on the world communicator. "skip" uses an engine's own bucket
// loop on the world communicator (labelled as the Reducer labels its buckets), since the Reducer
// itself launches every bucket in order.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/comm/connect.h"
#include "gradsync/comm/records/flight_recorder.h"
#include "gradsync/dist/data_parallel/data_parallel.h"

using namespace gradsync;

namespace {
Tensor ones(const Parameter& parameter) {
  return Tensor::from_vector(std::vector<float>(static_cast<std::size_t>(parameter.numel()), 1.0f), parameter.shape());
}
}  // namespace

int main(int argc, char** argv) try {
  const std::string fault = argc > 1 ? argv[1] : "";
  if (fault != "stopped" && fault != "skip" && fault != "differ") {
    std::fprintf(stderr, "usage: flight_faults stopped|skip|differ\n");
    return 2;
  }
  auto comm = comm::connect("gloo");
  const bool faulty = comm->rank() == comm->size() - 1;

  ParameterRegistry registry;
  std::vector<Parameter*> parameters{&registry.add("embed.weight", {3000}), &registry.add("fc.weight", {2000}),
                                     &registry.add("fc.bias", {1000})};
  registry.finalize();
  // One bucket per parameter (about 12, 8 and 4 KB).
  dist::DataParallel ddp(registry, *comm, {.bucket_cap_mb = 0.004});

  for (int step = 0; step < 6; ++step) {
    const bool planted = faulty && step == 3;
    if (planted && fault == "stopped") std::this_thread::sleep_for(std::chrono::minutes(5));
    if (fault == "skip") {
      // The engine's own buckets on the world communicator.
      std::vector<Tensor> grads;
      std::vector<comm::WorkHandle> works;
      for (std::size_t b = 0; b < parameters.size(); ++b) {
        if (planted && b == 1) continue;  // the bug: bucket 1 never launched on this rank
        const comm::OperationLabel label("bucket " + std::to_string(b) + ": " + parameters[b]->name());
        grads.push_back(ones(*parameters[b]));
        works.push_back(comm->allreduce_async(grads.back(), comm::ReduceOp::sum));
      }
      for (const comm::WorkHandle& work : works) work->wait();
    } else {
      ddp.begin_backward();
      for (auto it = parameters.rbegin(); it != parameters.rend(); ++it) {
        (*it)->set_grad(ones(**it));
        registry.mark_ready(**it);
      }
      ddp.end_backward();
    }
    const comm::OperationLabel label("the loss, averaged");
    Tensor loss = Tensor::from_vector(std::vector<float>{1.0f}, {1});
    if (planted && fault == "differ") {
      Tensor all = Tensor::zeros({comm->size()}, DType::f32);
      comm->allgather(loss, all);
    } else {
      comm->allreduce(loss, comm::ReduceOp::avg);
    }
  }
  std::printf("rank %d: done\n", comm->rank());
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "%s\n", error.what());
  return 1;
}
