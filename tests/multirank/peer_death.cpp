// A rank process that dies exactly in a phase, and what the others must say: each survivor gets
// an error naming the dead rank, well within the timeout (GRADSYNC_TIMEOUT_MS is long), instead
// of waiting forever. The dying rank ends with std::_Exit: no destructor runs, no socket is
// closed politely; the kernel closes them, as it does for a process that is killed.
//   peer_death PHASE        (run by tests/multirank/peer_death.sh through scripts/launch.sh 3)
//     zero1-gather          ZeRO-1: the last rank dies while the others gather updated parameters
//     zero2-reduce-scatter  ZeRO-2: ... while the others reduce-scatter gradients in a backward
//     zero2-gather          ZeRO-2: ... while the others gather updated parameters
//     zero3-gather          ZeRO-3: ... while the others gather the units for their forward
//     zero3-reduce-scatter  ZeRO-3: ... while the others reduce-scatter gradients in a backward
//     join-shadow           rank 0 is out of data and shadows the others' steps in a Join; the
//                           last rank dies in one of them
//     duplicate             the last rank dies instead of duplicating the communicator (a new
//                           context meeting through the rendezvous store)
//     duplicate-rank0       the same, rank 0 (which serves the store) dying
//     split                 (3 ranks) ranks 1 and 2 form a group, rank 0 stays out and waits in a
//                           world barrier; the last rank dies in one of the group's allreduces:
//                           the other member names it by its world rank ("world rank 2")
//     hierarchical          (4 ranks on 2 simulated nodes, hierarchical allreduce forced) the last
//                           rank dies in one of the allreduces: inside a node, across nodes, or
//                           waiting on a rank that failed because of it
//     diloco-outer          DiLoCo (H = 4): the last rank dies before its second outer step, while
//                           the others average the pseudo-gradients
//     diloco-streaming      streaming DiLoCo (2 fragments, each reduction landing one inner step
//                           after its launch): the last rank dies while a fragment's reduction is
//                           in flight behind the others' inner steps
//     died-and-followed     (3 ranks) the last rank dies while rank 1 waits for a message from it;
//                           rank 1 fails and leaves; rank 0, busy meanwhile, then finds both
//                           connections closed and must say which rank died (rank 1 said in the
//                           store that it left after failing) rather than "one of them died"
//   (In both duplicates the survivors fail in the collective check that precedes the meeting, over
//   the old connections. A store client whose server dies while it waits is tested in
//   test_store.cpp, Store.AClientFailsPromptlyWhenTheServerDies.)
// Survivors print "rank R failed after S s: MESSAGE" and exit 0 when MESSAGE names the dead rank
// 1 otherwise; the dying rank exits 0 (so that launch.sh does not stop the rest).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/comm/connect.h"
#include "gradsync/dist/outer/diloco.h"
#include "gradsync/kernels/ops.h"
#include "peer_death.h"

namespace {

using namespace gradsync;
using Clock = std::chrono::steady_clock;

// The dying rank: give the others time to be inside the phase, then end at once.
void die() {
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  std::fflush(stdout);
  std::_Exit(0);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string phase = argc > 1 ? argv[1] : "";
  std::unique_ptr<comm::Communicator> comm;
  try {
    comm::CommOptions options;
    if (phase == "hierarchical") {  // two nodes of two: ranks 0 and 1, ranks 2 and 3
      const char* rank = std::getenv("RANK");
      options.node = "node" + std::to_string((rank != nullptr ? std::atoi(rank) : 0) / 2);
      options.hierarchical = comm::CommOptions::Hierarchy::always;
    }
    comm = comm::connect("gloo", Device::cpu(), options);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "connect: %s\n", error.what());
    return 1;
  }
  const int last = comm->size() - 1;
  const int victim = phase == "duplicate-rank0" ? 0 : last;
  // A group's member must name the victim by its world rank: its group rank differs.
  bool by_world_rank = false;
  const auto start = Clock::now();
  try {
    if (phase == "zero1-gather") {
      testing::zero_training_with_a_death(*comm, 1, false, victim, die);
    } else if (phase == "zero2-reduce-scatter") {
      testing::zero_training_with_a_death(*comm, 2, true, victim, die);
    } else if (phase == "zero2-gather") {
      testing::zero_training_with_a_death(*comm, 2, false, victim, die);
    } else if (phase == "zero3-gather") {
      testing::zero_training_with_a_death(*comm, 3, false, victim, die);
    } else if (phase == "zero3-reduce-scatter") {
      testing::zero_training_with_a_death(*comm, 3, true, victim, die);
    } else if (phase == "join-shadow") {
      testing::join_training_with_a_death(*comm, victim, die);
    } else if (phase == "split") {
      auto group = comm->split(comm->rank() == 0 ? comm::Communicator::kNoColor : 0, comm->rank());
      by_world_rank = group != nullptr;
      for (int step = 0; group != nullptr && step < 20; ++step) {
        if (step == 3 && comm->rank() == victim) die();
        Tensor value = Tensor::from_vector(std::vector<float>(1000, 1.0f), {1000});
        group->allreduce(value, comm::ReduceOp::sum);
      }
      comm->barrier();
    } else if (phase == "hierarchical") {
      for (int step = 0; step < 20; ++step) {
        if (step == 3 && comm->rank() == victim) die();
        Tensor value = Tensor::from_vector(std::vector<float>(1 << 18, 1.0f), {1 << 18});
        comm->allreduce(value, comm::ReduceOp::sum);
      }
    } else if (phase == "diloco-outer" || phase == "diloco-streaming") {
      ParameterRegistry registry;
      registry.add("w", {1 << 20});
      registry.add("b", {1 << 20});
      registry.finalize();
      const bool streaming = phase == "diloco-streaming";
      dist::DiLoCo diloco(registry, *comm, {.sync_every = 4, .fragments = streaming ? 2 : 1, .delay = streaming ? 1 : 0});
      for (int step = 0; step < 20; ++step) {
        // Streaming: fragment 0 launches at inner steps 2, 6, ... and lands one step later.
        if (step == (streaming ? 6 : 7) && comm->rank() == victim) die();
        for (Parameter& parameter : registry) ops::scale(parameter.value(), 0.99);  // an inner step
        diloco.step();
      }
    } else if (phase == "died-and-followed") {
      Tensor message = Tensor::zeros({16}, DType::f32);
      if (comm->rank() == victim) die();
      if (comm->rank() == 1) comm->recv(message, victim);
      if (comm->rank() == 0) {
        std::this_thread::sleep_for(std::chrono::seconds(2));  // busy while rank 2 dies and rank 1 leaves
        comm->recv(message, 1);
      }
    } else if (phase == "duplicate" || phase == "duplicate-rank0") {
      if (comm->rank() == victim) die();
      auto duplicate = comm->duplicate();
    } else {
      std::fprintf(stderr, "unknown phase '%s'\n", phase.c_str());
      return 2;
    }
    std::fprintf(stderr, "rank %d: %s completed although rank %d died\n", comm->rank(), phase.c_str(), victim);
    return 1;
  } catch (const std::exception& error) {
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    const std::string message = error.what();
    std::printf("rank %d failed after %.2f s: %s\n", comm->rank(), seconds, message.c_str());
    std::fflush(stdout);
    const std::string name = (by_world_rank ? "world rank " : "rank ") + std::to_string(victim);
    bool named = message.find(name) != std::string::npos;
    if (phase == "died-and-followed" && comm->rank() == 0) named = named && message.find(name + " died") != std::string::npos;
    if (!named) std::fprintf(stderr, "rank %d: the error does not name %s\n", comm->rank(), name.c_str());
    return named ? 0 : 1;
  }
}
