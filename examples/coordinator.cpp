// coordinator: decides the quorum of fault-tolerant replica groups, every step (comm/coordinator.h,
// docs/fault_tolerance.md). A launcher starts it once for the job, beside the groups' own
// launchers; it holds nothing a restart needs, so a supervisor may start it again on the same
// port and the groups carry on (they wait for it up to their answer timeout).
//
//   build/examples/coordinator --port 29600 --replica-groups 3 --min-replicas 2
//   build/examples/digits_ddp --replica-groups 3 --replica-group 0 --coordinator 127.0.0.1:29600 ...
//
// It serves until SIGINT or SIGTERM, then prints what it decided.
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <thread>

#include "common/flags.h"
#include "common/metrics.h"
#include "gradsync/comm/connect.h"
#include "gradsync/comm/quorum/coordinator.h"

using namespace gradsync;

namespace {
std::atomic<bool> stop{false};
void on_signal(int) { stop = true; }
}  // namespace

int main(int argc, char** argv) try {
  examples::line_buffered_progress();
  examples::Flags flags(argc, argv);
  if (flags.flag("--help")) {
    std::printf("coordinator flags:\n  --port P (29600)   --bind ADDRESS (127.0.0.1; \"\" for every interface)\n"
                "  --replica-groups R   --min-replicas M (1)\n"
                "  --heartbeat-timeout-ms MS (1000: a member silent this long is taken for dead)\n"
                "  --join-timeout-ms MS (10000: how long a forming quorum waits for more groups, and one short of\n"
                "                       --min-replicas waits before it fails)\n"
                "  --vote-timeout-ms MS (2000: once a group reports a failed step, how long the silent ones are\n"
                "                       waited for)   --quiet\n"
                "  --state-file PATH    (keeps the high-water mark, the highest step a quorum reached, across\n"
                "                       this program's restarts: no quorum ever forms below it)\n"
                "  --accept-lost-steps  (a quorum may form below the high-water mark: the groups restarted from a\n"
                "                       checkpoint on purpose, once no group holding it came back within the join\n"
                "                       timeout; without it they end naming the lost step)\n"
                "  The groups present GRADSYNC_STORE_TOKEN when it is set; listening beyond loopback (--bind)\n"
                "  needs it.\n");
    return 0;
  }
  comm::CoordinatorOptions options;
  options.port = static_cast<int>(flags.integer("--port", 29600));
  options.bind_host = flags.text("--bind", "127.0.0.1");
  options.replica_groups = static_cast<int>(flags.count("--replica-groups", 1));
  options.min_replicas = static_cast<int>(flags.count("--min-replicas", 1));
  options.heartbeat_timeout = std::chrono::milliseconds(flags.count("--heartbeat-timeout-ms", 1000));
  options.join_timeout = std::chrono::milliseconds(flags.count("--join-timeout-ms", 10000));
  options.vote_timeout = std::chrono::milliseconds(flags.count("--vote-timeout-ms", 2000));
  options.state_file = flags.text("--state-file", "");
  options.accept_lost_steps = flags.flag("--accept-lost-steps");
  options.quiet = flags.flag("--quiet");
  flags.finish();
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  comm::Coordinator coordinator(options);
  std::printf("coordinator: serving %d replica group(s) (at least %d) on port %d\n", options.replica_groups,
              options.min_replicas, coordinator.port());
  while (!stop) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const comm::CoordinatorCounters counters = coordinator.counters();
  std::printf("coordinator: %lld decisions, %lld steps committed, %lld discarded, %lld quorum changes, %lld recoveries, "
              "high-water mark %lld, %lld groups refused, %lld incarnations superseded\n",
              static_cast<long long>(counters.decisions), static_cast<long long>(counters.commits),
              static_cast<long long>(counters.discards), static_cast<long long>(counters.quorum_changes),
              static_cast<long long>(counters.recoveries), static_cast<long long>(counters.high_water),
              static_cast<long long>(counters.refused), static_cast<long long>(counters.superseded));
  return 0;
} catch (const std::exception& error) {
  return comm::report_fatal_error("coordinator", error);
}
