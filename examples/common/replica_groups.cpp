// The trainers' fault-tolerant run across replica groups (replica_groups.h).
#include "replica_groups.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "gradsync/core/error.h"

namespace gradsync::examples {

const char* const kReplicaGroupHelp =
    "fault tolerance across replica groups (each group started by its own launcher; docs/fault_tolerance.md):\n"
    "  --replica-groups R --replica-group G --coordinator HOST:PORT (build/examples/coordinator serves it)\n"
    "  --cross-timeout-ms MS (every operation across the groups: 10000; a quorum's meeting: at most 5000)\n"
    "  --record-samples FILE\n"
    "  --ft-die PHASE:GROUP.RANK@STEP (fault injection: reduce | quorum | gather, or a recovery source's\n"
    "    moment: named | started | halfway | sent)\n"
    "  --batch means in each group what it means without groups; the run ends where the trainer's does\n"
    "    (digits_ddp: --epochs of samples consumed, or --max-steps; gpt_ddp: --steps committed)";

ReplicaGroupOptions parse_replica_group_options(Flags& flags) {
  ReplicaGroupOptions options;
  options.groups = static_cast<int>(flags.integer("--replica-groups", 0));
  options.group = static_cast<int>(flags.integer("--replica-group", -1));
  const std::string coordinator = flags.text("--coordinator", "");
  options.record = flags.text("--record-samples", "");
  options.timeout_ms = flags.count("--cross-timeout-ms", 10000);
  const std::string die = flags.text("--ft-die", "");
  if (!options.enabled()) {
    GRADSYNC_CHECK(coordinator.empty() && die.empty() && options.record.empty(), "--coordinator, --ft-die and ",
                   "--record-samples need --replica-groups");
    return options;
  }
  GRADSYNC_CHECK(options.group >= 0 && options.group < options.groups, "--replica-group ", options.group,
                 ": expected a group in [0, ", options.groups, ") (--replica-groups ", options.groups, ")");
  const auto colon = coordinator.rfind(':');
  GRADSYNC_CHECK(colon != std::string::npos && colon > 0, "--coordinator '", coordinator, "': expected HOST:PORT");
  options.host = coordinator.substr(0, colon);
  options.port = std::atoi(coordinator.c_str() + colon + 1);
  GRADSYNC_CHECK(options.port > 0 && options.port < 65536, "--coordinator '", coordinator, "': no port");
  if (!die.empty()) {
    char phase[32] = {};
    long long step = 0;
    GRADSYNC_CHECK(std::sscanf(die.c_str(), "%31[a-z]:%d.%d@%lld", phase, &options.die_group, &options.die_rank, &step) == 4,
                   "--ft-die '", die, "': expected PHASE:GROUP.RANK@STEP (e.g. reduce:1.0@40)");
    options.die_phase = phase;
    options.die_step = step;
    const std::vector<std::string> phases = {"reduce", "quorum", "gather", "named", "started", "halfway", "sent"};
    GRADSYNC_CHECK(std::find(phases.begin(), phases.end(), options.die_phase) != phases.end(), "--ft-die '", die,
                   "': the phase is reduce, quorum or gather, or a recovery's named, started, halfway or sent");
  }
  return options;
}

std::unique_ptr<dist::FaultTolerance> make_fault_tolerance(const ReplicaGroupOptions& options, ParameterRegistry& registry,
                                                           optim::Optimizer* optimizer, comm::Communicator& group,
                                                           std::int64_t samples_per_group, dist::ZeroOptimizer* zero,
                                                           optim::GradScaler* scaler) {
  dist::FaultToleranceOptions ft;
  ft.coordinator.host = options.host;
  ft.coordinator.port = options.port;
  ft.coordinator.group = options.group;
  ft.coordinator.cross_options.timeout = std::chrono::milliseconds(options.timeout_ms);
  // Meeting a new quorum takes milliseconds; a member that never arrives has died in between.
  ft.coordinator.cross_options.rendezvous_timeout = std::chrono::milliseconds(std::min<std::int64_t>(options.timeout_ms, 5000));
  ft.samples_per_group = samples_per_group;
  ft.zero = zero;
  ft.grad_scaler = scaler;
  // --ft-die at a recovery's moments: inside the library's transfer, so through its hook.
  const int rank = group.rank();
  ft.on_recovery_moment = [options, rank](const std::string& moment, int, std::int64_t step) {
    die_if_asked(options, moment, rank, step);
  };
  return std::make_unique<dist::FaultTolerance>(registry, optimizer, group, ft);
}

void resume_across_groups(dist::FaultTolerance& ft, const Progress& progress, const std::string& path) {
  GRADSYNC_CHECK(progress.position >= 0, path, " records no data position: --replica-groups resumes only from a ",
                 "checkpoint a fault-tolerant run wrote");
  ft.resume(progress.global_step, progress.position);
}

void die_if_asked(const ReplicaGroupOptions& options, const std::string& phase, int rank, std::int64_t step) {
  if (phase != options.die_phase || options.group != options.die_group || rank != options.die_rank ||
      step < options.die_step) {
    return;
  }
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (restarts != nullptr && std::string(restarts) != "0") return;  // the first attempt only
  std::fprintf(stderr, "replica group %d rank %d: --ft-die: stopping at '%s' after step %lld\n", options.group, rank,
               phase.c_str(), static_cast<long long>(step));
  // Inside a phase every rank takes part in, 0.3 s more puts the others in it too; a recovery's
  // moment is the newcomer's, and it is there already.
  const bool recovery_moment = phase == "named" || phase == "started" || phase == "halfway" || phase == "sent";
  if (!recovery_moment) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  std::raise(SIGKILL);
}

bool commit_across_groups(dist::FaultTolerance& ft, const ReplicaGroupOptions& options, int rank) {
  die_if_asked(options, "reduce", rank, ft.step());
  ft.average_gradients();
  die_if_asked(options, "quorum", rank, ft.step());
  return ft.should_commit();
}

void report_events(dist::FaultTolerance& ft, Metrics& metrics, int rank, bool quiet) {
  // Wall-clock time, comparable across the groups' processes (the benchmark lines up kills,
  // commits and recoveries of different processes).
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  for (const dist::FaultToleranceEvent& event : ft.take_events()) {
    metrics.event(ft.step(), event.kind, event.detail,
                  {{"quorum", static_cast<double>(event.quorum)}, {"seconds", event.seconds}, {"took", event.took},
                   {"unix_time", now - (ft.seconds() - event.seconds)}});
    if ((rank == 0 || event.kind == "failed") && !quiet) {  // a failure: whichever rank saw it
      std::printf("group %d rank %d: %s at step %lld (%.3f s): %s\n", ft.group(), rank, event.kind.c_str(),
                  static_cast<long long>(event.step), event.took, event.detail.c_str());
    }
  }
}

ReplicaGroupRun::ReplicaGroupRun(const ReplicaGroupOptions& options, Training& training, const TrainerOptions& trainer,
                                 dist::ZeroOptimizer* zero)
    : options_(options), training_(training), trainer_(trainer) {
  ft_ = make_fault_tolerance(options, training.registry, training.optimizer.get(), *training.comm,
                             training.local_batch * training.comm->size(), zero, training.scaler.get());
  if (!training.resumed_from.empty()) resume_across_groups(*ft_, training.progress, training.resumed_from);
}

bool ReplicaGroupRun::commit() {
  committed_ = commit_across_groups(*ft_, options_, training_.comm->rank());
  return committed_;
}

// Epoch e's rows, the seeded permutation of the training set every group computes alike.
const std::vector<std::int64_t>& ReplicaGroupRun::epoch_rows(std::int64_t epoch) {
  if (epoch != cached_epoch_) {
    cached_rows_ = epoch_order(training_.split.train, trainer_.seed, static_cast<int>(epoch), 0, 1, 1, trainer_.shuffle);
    cached_epoch_ = epoch;
  }
  return cached_rows_;
}

int ReplicaGroupRun::run(const std::string& name,
                         const std::function<double(const std::vector<std::int64_t>&, std::int64_t)>& step) {
  using Clock = std::chrono::steady_clock;
  Training& t = training_;
  const int rank = t.comm->rank();
  const bool writer = rank == 0;
  Metrics metrics(trainer_.metrics, writer, /*append=*/true);
  std::FILE* record = nullptr;
  if (writer && !options_.record.empty()) {
    record = std::fopen(options_.record.c_str(), "a");
    GRADSYNC_CHECK(record != nullptr, "cannot write --record-samples ", options_.record);
  }
  const auto n = static_cast<std::int64_t>(t.split.train.size());
  const std::int64_t total = n * trainer_.epochs;
  const std::int64_t group_batch = t.local_batch * t.comm->size();
  const auto start = Clock::now();
  auto last_commit = start;
  double loss_sum = 0;
  std::int64_t loss_steps = 0;
  std::vector<std::int64_t> rows(static_cast<std::size_t>(t.local_batch));
  while (ft_->position() < total && (trainer_.max_steps < 0 || ft_->step() < trainer_.max_steps)) {
    if (rank == trainer_.delay_rank) std::this_thread::sleep_for(std::chrono::milliseconds(trainer_.delay_ms));
    const comm::Quorum& quorum = ft_->start_step();
    const std::int64_t first = ft_->first_sample() + rank * t.local_batch;
    for (std::int64_t j = 0; j < t.local_batch; ++j) {
      const std::int64_t k = first + j;  // the global sample index: epoch k / n, place k % n
      rows[static_cast<std::size_t>(j)] = epoch_rows(k / n)[static_cast<std::size_t>(k % n)];
    }
    const std::int64_t position = ft_->position();
    const std::int64_t members = static_cast<std::int64_t>(quorum.members.size());
    const std::int64_t group_first = ft_->first_sample();
    committed_ = false;
    const double loss = step(rows, 0);
    const auto now = Clock::now();
    const double unix_time =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    report_events(*ft_, metrics, rank, trainer_.quiet);
    if (!committed_) continue;
    const double since_last = std::chrono::duration<double>(now - last_commit).count();
    last_commit = now;
    loss_sum += loss;
    ++loss_steps;
    t.progress.global_step = ft_->step();
    t.progress.position = ft_->position();
    // --checkpoint-every: one group writes, the first of the quorum that committed the step.
    if (checkpoint_due(trainer_.restarts, ft_->step()) && ft_->checkpoint_writer()) t.checkpoint(trainer_.restarts);
    kill_if_asked(trainer_.restarts, rank, ft_->step(), name);  // --kill-rank (fault injection)
    metrics.step(ft_->step(), static_cast<int>(position / n) + 1, loss, t.last_grad_norm,
                 {{"members", static_cast<double>(members)},
                  {"seconds", std::chrono::duration<double>(now - start).count()},
                  {"since_last_commit", since_last}, {"unix_time", unix_time}});
    if (record != nullptr) {
      std::fprintf(record,
                   "{\"group\": %d, \"step\": %lld, \"position\": %lld, \"count\": %lld, \"first\": %lld, \"size\": %lld}\n",
                   options_.group, static_cast<long long>(ft_->step()), static_cast<long long>(position),
                   static_cast<long long>(members * group_batch), static_cast<long long>(group_first),
                   static_cast<long long>(group_batch));
      std::fflush(record);
    }
    if (writer && !trainer_.quiet && ft_->step() % std::max<std::int64_t>(t.steps_per_epoch, 1) == 0) {
      std::printf("group %d: step %5lld  samples %lld/%lld  loss %.4f  %lld group(s)  elapsed %.2f s\n", options_.group,
                  static_cast<long long>(ft_->step()), static_cast<long long>(ft_->position()),
                  static_cast<long long>(total), loss_sum / static_cast<double>(loss_steps),
                  static_cast<long long>(members), std::chrono::duration<double>(now - start).count());
      loss_sum = 0;
      loss_steps = 0;
    }
  }
  if (record != nullptr) std::fclose(record);
  if (!trainer_.restarts.checkpoint_dir.empty() && ft_->checkpoint_writer()) t.checkpoint(trainer_.restarts);
  nn::Module& evaluated = t.evaluation_model != nullptr ? *t.evaluation_model : *t.model;
  const double accuracy = evaluate(evaluated, t.data, t.split.heldout, t.device);
  metrics.epoch(ft_->step(), trainer_.epochs, loss_steps > 0 ? loss_sum / static_cast<double>(loss_steps) : 0.0, accuracy);
  if (trainer_.check_replicas) require_identical_replicas(*t.comm, t.registry);
  if (writer && !trainer_.quiet) {
    std::printf("%s: group %d done at step %lld, %lld samples, held-out accuracy %.2f%%, elapsed %.2f s\n", name.c_str(),
                options_.group, static_cast<long long>(ft_->step()), static_cast<long long>(ft_->position()),
                accuracy * 100, std::chrono::duration<double>(Clock::now() - start).count());
  }
  if (writer) std::printf("final held-out accuracy: %.2f%%\n", accuracy * 100);
  if (trainer_.min_accuracy >= 0 && accuracy < trainer_.min_accuracy) {
    if (writer) {
      std::fprintf(stderr, "%s: held-out accuracy %.4f is below --min-accuracy %.4f\n", name.c_str(), accuracy,
                   trainer_.min_accuracy);
    }
    return 2;
  }
  return 0;
}

}  // namespace gradsync::examples
