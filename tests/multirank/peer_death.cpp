// A rank process that dies exactly in a phase, and what the others must say: each survivor gets
// an error naming the dead rank, well within the timeout (GRADSYNC_TIMEOUT_MS is long), instead
// of waiting forever. The dying rank ends with std::_Exit: no destructor runs, no socket is
// closed politely; the kernel closes them, as it does for a process that is killed.
//   peer_death PHASE        (run by tests/multirank/peer_death.sh through scripts/launch.sh 3)
//     zero1-gather          ZeRO-1: the last rank dies while the others gather updated parameters
//     zero2-reduce-scatter  ZeRO-2: ... while the others reduce-scatter gradients in a backward
//     zero2-gather          ZeRO-2: ... while the others gather updated parameters
//     join-shadow           rank 0 is out of data and shadows the others' steps in a Join; the
//                           last rank dies in one of them
//     duplicate             the last rank dies instead of duplicating the communicator (a new
//                           context meeting through the rendezvous store)
//     duplicate-rank0       the same, rank 0 (which serves the store) dying
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

#include "gradsync/comm/connect.h"
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
    comm = comm::connect("gloo");
  } catch (const std::exception& error) {
    std::fprintf(stderr, "connect: %s\n", error.what());
    return 1;
  }
  const int last = comm->size() - 1;
  const int victim = phase == "duplicate-rank0" ? 0 : last;
  const auto start = Clock::now();
  try {
    if (phase == "zero1-gather") {
      testing::zero_training_with_a_death(*comm, 1, false, victim, die);
    } else if (phase == "zero2-reduce-scatter") {
      testing::zero_training_with_a_death(*comm, 2, true, victim, die);
    } else if (phase == "zero2-gather") {
      testing::zero_training_with_a_death(*comm, 2, false, victim, die);
    } else if (phase == "join-shadow") {
      testing::join_training_with_a_death(*comm, victim, die);
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
    const bool named = message.find("rank " + std::to_string(victim)) != std::string::npos;
    if (!named) std::fprintf(stderr, "rank %d: the error does not name rank %d\n", comm->rank(), victim);
    return named ? 0 : 1;
  }
}
