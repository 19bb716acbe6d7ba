// DataParallel (gradsync/dist/data_parallel/data_parallel.h): PyTorch DDP's semantics on the Reducer.
//
// One synchronized step, as this file runs it: ready signals (on_ready) hand gradients to the
// Reducer, which launches buckets in order while the backward goes on; end_backward() ->
// finalize(): the rest of the buckets, the status allreduce at its fixed position (dist/reducer/step_status.h),
// the waits, and the decisions every rank takes alike from the summed status (who missed
// gradients, which parameters nobody used, who has joined, AUTO's choice).
#include "gradsync/dist/data_parallel/data_parallel.h"

#include <sstream>

#include "gradsync/core/timeline.h"
#include "gradsync/dist/replicas/replicas.h"
#include "gradsync/kernels/ops.h"
#include "dist/reducer/step_status.h"
#include "sync_state.h"

namespace gradsync::dist {

struct DataParallel::Impl {
  ParameterRegistry& registry;
  comm::Communicator& comm;
  DataParallelOptions options;
  std::vector<Parameter*> parameters;  // trainable, registry order
  std::unique_ptr<Reducer> reducer;
  ParameterRegistry::Subscription subscription;

  int no_sync_depth = 0;
  bool in_backward = false;
  bool timeline_backward = false;  // a backward span is open on the timeline
  bool backward_syncs = false;
  std::vector<bool> ready_this_backward;  // by registry index
  std::vector<bool> used_in_window;       // by registry index, since the last synced finalize
  std::vector<int> last_used_counts;      // by position in `parameters`
  bool hook_registered = false;
  SyncState sync;                            // Composer's strategies and AUTO (sync_state.h)
  const JoinOptions* join_options = nullptr;  // the Join this rank is inside (gradsync/dist/join/join.h), or null

  Impl(ParameterRegistry& registry_, comm::Communicator& comm_, DataParallelOptions options_)
      : registry(registry_), comm(comm_), options(options_) {}

  void construct() {
    GRADSYNC_CHECK(registry.finalized(), "DataParallel: finalize the registry first");
    std::vector<const Parameter*> everything;
    std::vector<std::string> names;
    for (Parameter& parameter : registry) {
      everything.push_back(&parameter);
      names.push_back(parameter.name());
      if (parameter.requires_grad()) parameters.push_back(&parameter);
    }
    GRADSYNC_CHECK(!parameters.empty(),
                   "DataParallel is not needed when a module doesn't have any parameter that requires a gradient.");
    // The same model everywhere (docs/semantics/ddp.md section 3's verification, naming both views), then
    // rank 0's values everywhere: parameters and buffers (frozen parameters) alike.
    require_same_parameters(comm, everything, names, "DataParallel");
    comm::Communicator* replicas = options.replicas != nullptr && options.replicas->size() > 1 ? options.replicas : nullptr;
    if (options.replicas != nullptr) {
      GRADSYNC_CHECK(options.shard_gradients, "DataParallel: replicas (HSDP) need shard_gradients (ZeRO stage 2 or 3); ",
                     "for plain data parallelism across nodes, the hierarchical allreduce (CommOptions::hierarchical)");
      if (replicas != nullptr) require_same_parameters(*replicas, everything, names, "DataParallel (across shard groups)");
    }
    if (options.broadcast_parameters) {
      // Under HSDP, group 0's rank 0 first to every group's rank 0, then inside each group.
      for (const Arena& arena : registry.arenas()) {
        Tensor values = arena.values;
        if (replicas != nullptr && comm.rank() == 0) replicas->broadcast(values, 0);
        comm.broadcast(values, 0);
      }
    }
    ReducerOptions reducer_options;
    if (options.bucket_cap_mb) {
      GRADSYNC_CHECK(*options.bucket_cap_mb > 0, "bucket_cap_mb must be positive, got ", *options.bucket_cap_mb);
      reducer_options.bucket_limits = {static_cast<std::size_t>(*options.bucket_cap_mb * (1 << 20))};
    } else {
      reducer_options.bucket_limits = {std::size_t{1} << 20, std::size_t{25} << 20};
    }
    reducer_options.rule = BucketRule::pytorch;
    reducer_options.compression = options.compression;
    reducer_options.op = comm::ReduceOp::sum;
    // Divide before the sum, as PyTorch; under HSDP by every group's ranks.
    reducer_options.prescale = 1.0 / (comm.size() * (replicas != nullptr ? replicas->size() : 1));
    reducer_options.replicas = replicas;
    reducer_options.reduce_scatter = options.shard_gradients;
    reducer_options.user = "DataParallel";
    reducer_options.max_buckets_in_flight = options.max_buckets_in_flight.value_or(options.shard_gradients ? 2 : 0);
    if (!options.units.empty()) {
      GRADSYNC_CHECK(options.shard_gradients, "DataParallel: units (ZeRO stage 3) need shard_gradients");
      // One bucket per unit: no cap lets two units share one (the Reducer keeps each unit whole).
      reducer_options.bucket_limits = {1};
      std::vector<int> unit_of(registry.size(), -1);
      for (std::size_t u = 0; u < options.units.size(); ++u) {
        GRADSYNC_CHECK(!options.units[u].empty(), "DataParallel: unit ", u, " is empty");
        for (Parameter* member : options.units[u]) {
          GRADSYNC_CHECK(member != nullptr && member->index() < registry.size() && &registry[member->index()] == member,
                         "DataParallel: unit ", u, " holds a parameter of another registry");
          GRADSYNC_CHECK(unit_of[member->index()] < 0, "DataParallel: '", member->name(), "' is in units ",
                         unit_of[member->index()], " and ", u);
          unit_of[member->index()] = static_cast<int>(u);
        }
      }
      for (const Parameter* parameter : parameters) {
        GRADSYNC_CHECK(unit_of[parameter->index()] >= 0, "DataParallel: '", parameter->name(), "' is trainable and in ",
                       "no unit; with units (ZeRO stage 3) every trainable parameter belongs to one");
      }
    }
    std::vector<Parameter*> backward_order(parameters.rbegin(), parameters.rend());
    reducer = std::make_unique<Reducer>(registry, comm, backward_order, options.units, reducer_options);
    ready_this_backward.assign(registry.size(), false);
    used_in_window.assign(registry.size(), false);
    subscription = registry.on_ready([this](Parameter& parameter) { on_ready(parameter); });
  }

  // `first_ready`: the backward begins with a ready signal (no begin_backward() call), after the
  // engine has written gradients.
  void begin_backward(const Parameter* first_ready = nullptr) {
    GRADSYNC_CHECK(!in_backward, "DataParallel::begin_backward: the previous backward was not ended (call end_backward())");
    if (options.shard_gradients) {
      // Gradients still holding this rank's reduced pieces (no zero_grad since the last
      // synchronized backward: an accumulation) have them set aside before the engine adds to
      // them (Reducer::set_aside_reduced_pieces); after the engine wrote, it is too late.
      GRADSYNC_CHECK(first_ready == nullptr || !reducer->holds_reduced_pieces(), "DataParallel (shard_gradients): a ",
                     "backward began with the ready signal of '", first_ready->name(), "' while the gradients still ",
                     "hold the reduced pieces of the last synchronized backward (no zero_grad since): the engine may ",
                     "have added to them already, and they would be reduced again. Call begin_backward() before ",
                     "writing gradients when accumulating over synchronized backwards (or zero_grad after each step)");
      reducer->set_aside_reduced_pieces();
    }
    in_backward = true;
    backward_syncs = no_sync_depth == 0;
    timeline_backward = timeline::enabled();
    if (timeline_backward) timeline::detail::begin("backward", backward_syncs ? "backward (synchronized)" : "backward (no_sync)");
    std::fill(ready_this_backward.begin(), ready_this_backward.end(), false);
  }

  void on_ready(Parameter& parameter) {
    if (!reducer->contains(parameter)) return;
    if (!in_backward) begin_backward(&parameter);  // the first ready signal begins a backward
    GRADSYNC_CHECK(!ready_this_backward[parameter.index()],
                   "Expected to mark a variable ready only once. Parameter at index ", parameter.index(), " with name '",
                   parameter.name(), "' has been marked as ready twice in this backward pass.");
    ready_this_backward[parameter.index()] = true;
    used_in_window[parameter.index()] = true;
    if (backward_syncs) reducer->ready(parameter);
  }

  void end_backward() {
    GRADSYNC_CHECK(in_backward, "DataParallel::end_backward without a backward (no begin_backward() nor ready signal)");
    in_backward = false;
    struct EndSpan {  // the backward's span ends after finalize, also when it throws
      bool active;
      ~EndSpan() {
        if (active) timeline::detail::end();
      }
    } end_span{timeline_backward};
    timeline_backward = false;
    if (backward_syncs) finalize(/*tolerate_missing=*/options.find_unused_parameters);
  }

  // The end of a synchronized step: every bucket launched (zero-filled where undefined), the
  // status allreduce at a fixed position, the waits, and the defined/undefined decision.
  // `join_flags`: this rank's join flags (dist/reducer/step_status.h) when the step is a shadow step.
  Census finalize(bool tolerate_missing, int join_flags = 0) {
    const std::size_t count = parameters.size();
    std::vector<bool> undefined_before(count);
    std::vector<std::size_t> missing;
    for (std::size_t i = 0; i < count; ++i) {
      undefined_before[i] = !parameters[i]->grad_defined();
      if (!used_in_window[parameters[i]->index()]) missing.push_back(i);
    }
    reducer->finish();
    StepStatus status(count, comm, options.replicas);
    for (std::size_t i = 0; i < count; ++i) {
      if (used_in_window[parameters[i]->index()]) status.set_used(i);
    }
    int flags = join_flags;
    if (!tolerate_missing && !missing.empty()) flags |= kMissedGradients;
    status.set_flags(flags);
    sync.write(status, /*shadow_step=*/join_flags != 0);
    timeline::instant("status", join_flags ? "status allreduce (joined)" : "status allreduce");
    status.exchange(comm, [&] { reducer->wait(); }, options.replicas);  // the buckets' waits overlap the status

    std::fill(used_in_window.begin(), used_in_window.end(), false);
    last_used_counts.assign(count, 0);
    for (std::size_t i = 0; i < count; ++i) last_used_counts[i] = status.used_count(i);
    const Census census = status.census();
    sync.read(status, job_rank());

    if (!census.missed.empty()) raise_missing(join_flags ? std::vector<std::size_t>{} : missing, census.missed);
    // Globally unused parameters keep an undefined gradient (the zero-fill was only for the
    // collective); locally unused but globally used ones keep the reduced value.
    for (std::size_t i = 0; i < count; ++i) {
      if (last_used_counts[i] == 0 && undefined_before[i]) parameters[i]->zero_grad(/*set_to_undefined=*/true);
    }
    if (census.joined > 0 && join_flags == 0) react_to_joined(census);
    const int world = job_size();
    if (census.joined > 0 && census.joined < world && join_options != nullptr &&
        !join_options->divide_by_initial_world_size && !hook_registered) {
      // The buckets divided by the world size: make it the number of ranks still active. On
      // every rank: a joined rank's pieces of a sharded optimizer (ZeRO) step with it too.
      const double factor = static_cast<double>(world) / static_cast<double>(world - census.joined);
      for (Parameter* parameter : parameters) {
        if (parameter->grad_defined()) ops::scale(parameter->grad_for_accumulate(), factor);
      }
    }
    return census;
  }

  // The ranks of the job (every shard group's under HSDP) and this one's number among them.
  int job_size() const { return StepStatus::job_size(comm, options.replicas); }
  int job_rank() const { return StepStatus::job_rank(comm, options.replicas); }

  // An active rank's step in which `census.joined` ranks contributed zeros.
  void react_to_joined(const Census& census) {
    if (join_options == nullptr) {
      std::ostringstream ranks;
      for (std::size_t k = 0; k < census.joined_ranks.size(); ++k) ranks << (k ? ", " : "") << census.joined_ranks[k];
      detail::throw_error("rank ", ranks.str(), " joined (dist::Join: out of inputs) but this rank is not inside a Join ",
                          "over this DataParallel: every rank must enter dist::Join for uneven inputs");
    }
    if (join_options->throw_on_early_termination) {
      throw JoinEarlyTermination("Detected at least one rank that exhausted inputs. Throwing across all ranks.");
    }
  }

  // One of the active ranks' synchronized steps, shadowed by this joined rank (gradsync/dist/join/join.h).
  void shadow_step(JoinStep& step) {
    // Zeros in every bucket: this rank's leftover gradients (a partial accumulation window)
    // must not leak into the others' average, and it uses no parameter. Except when the
    // others carry the last step's average into this one and the average divides by the
    // initial world size: then this rank adds that average too, as each of them does.
    const bool carry =
        sync.last_step_carried() && (join_options == nullptr || join_options->divide_by_initial_world_size);
    if (!carry) {
      for (Parameter* parameter : parameters) parameter->zero_grad(/*set_to_undefined=*/true);
    } else if (options.shard_gradients) {
      reducer->set_aside_reduced_pieces();  // the carried average is this rank's pieces: added back, not reduced again
    }
    std::fill(used_in_window.begin(), used_in_window.end(), false);
    const Census census = finalize(/*tolerate_missing=*/true, step.first ? kJoined | kJoinedThisStep : kJoined);
    step.synchronized = true;
    step.joined = census.joined;
    step.world = job_size();
    step.last_joiner = census.last_joiner;
    // A carried step (MULTI before the final microbatch) is followed by another synchronization,
    // not by the optimizer.
    step.optimizer_step_follows = !sync.last_step_carried();
  }

  [[noreturn]] void raise_missing(const std::vector<std::size_t>& missing, const std::vector<int>& missed_ranks) {
    std::ostringstream message;
    if (!missing.empty()) {
      message << "Expected to have finished reduction in the prior iteration before starting a new one. This error "
                 "indicates that your module has parameters that were not used in producing loss. You can enable "
                 "unused parameter detection by setting find_unused_parameters in DataParallelOptions, and by making "
                 "sure all outputs participate in calculating loss.\nParameter indices which did not receive grad for rank "
              << comm.rank() << ":";
      for (const std::size_t i : missing) message << " " << parameters[i]->index();
      message << "\nParameters which did not receive grad for rank " << comm.rank() << ":";
      for (std::size_t k = 0; k < missing.size(); ++k) message << (k ? ", " : " ") << parameters[missing[k]]->name();
    } else {
      message << "rank";
      for (std::size_t k = 0; k < missed_ranks.size(); ++k) message << (k ? ", " : " ") << missed_ranks[k];
      message << " did not produce a gradient for every parameter in this backward (find_unused_parameters is off); "
                 "the gradients of this step are incomplete. See that rank's error for the parameters.";
    }
    throw Error(message.str());
  }
};

DataParallel::DataParallel(ParameterRegistry& registry, comm::Communicator& comm, DataParallelOptions options)
    : impl_(std::make_unique<Impl>(registry, comm, options)) {
  impl_->construct();
}

DataParallel::~DataParallel() = default;

void DataParallel::begin_backward() { impl_->begin_backward(); }
void DataParallel::end_backward() { impl_->end_backward(); }
bool DataParallel::in_backward() const { return impl_->in_backward; }
bool DataParallel::sync_enabled() const { return impl_->no_sync_depth == 0; }

void DataParallel::synchronize_all() {
  impl_->reducer->require_usable("DataParallel::synchronize_all");
  GRADSYNC_CHECK(!impl_->in_backward, "DataParallel::synchronize_all inside a backward: call end_backward() first");
  impl_->finalize(/*tolerate_missing=*/true);
}

const std::vector<int>& DataParallel::last_used_counts() const { return impl_->last_used_counts; }
bool DataParallel::inside_join() const { return impl_->join_options != nullptr; }
const Reducer& DataParallel::reducer() const { return *impl_->reducer; }
comm::Communicator& DataParallel::communicator() const { return impl_->comm; }
ParameterRegistry& DataParallel::registry() const { return impl_->registry; }
const DataParallelOptions& DataParallel::options() const { return impl_->options; }
SyncState& DataParallel::sync_state() { return impl_->sync; }

void DataParallel::register_comm_hook(ReduceHook hook) {
  impl_->reducer->require_usable("DataParallel::register_comm_hook");
  GRADSYNC_CHECK(!impl_->hook_registered, "register_comm_hook can only be called once.");
  // Compression is PyTorch's fp16/bf16 compress hook: it counts as the one hook.
  GRADSYNC_CHECK(impl_->options.compression == Compression::none,
                 "register_comm_hook can only be called once: compression ", compression_name(impl_->options.compression),
                 " is already this DataParallel's communication hook.");
  GRADSYNC_CHECK(static_cast<bool>(hook), "Communication hook must be callable.");
  GRADSYNC_CHECK(!impl_->reducer->round_started(), "register_comm_hook during a backward");
  impl_->hook_registered = true;
  impl_->reducer->set_hook(std::move(hook));
  impl_->reducer->set_scales(1.0, 1.0);  // a hook gets the gradients as they are, as PyTorch's
}

DataParallel::NoSync::NoSync(DataParallel& ddp) : ddp_(ddp) { ++ddp_.impl_->no_sync_depth; }
DataParallel::NoSync::~NoSync() { --ddp_.impl_->no_sync_depth; }

// ---- Joinable ----------------------------------------------------------------------------------

void DataParallel::join_opened(const JoinOptions* options) {
  GRADSYNC_CHECK(options == nullptr || impl_->join_options == nullptr, "Join: this DataParallel is already inside a Join");
  impl_->join_options = options;
}

void DataParallel::require_joinable() const {
  impl_->reducer->require_usable("Join::join");
  GRADSYNC_CHECK(!impl_->in_backward, "Join::join inside a backward: call end_backward() first");
  GRADSYNC_CHECK(!impl_->sync.auto_window_open(), "Join::join inside a ddp_sync_context window: close the window first");
  GRADSYNC_CHECK(!impl_->reducer->round_started(), "Join::join with a synchronized step half launched");
}

void DataParallel::shadow_step(JoinStep& step) { impl_->shadow_step(step); }

void DataParallel::finish_join(int last_joiner) {
  for (Parameter* parameter : impl_->parameters) parameter->zero_grad(/*set_to_undefined=*/true);
  // Units (ZeRO stage 3): each rank holds its pieces of the values, and the joined ranks kept
  // stepping theirs: nothing to copy (the last joiner's other pieces are released). The same
  // decision on every rank: the units agree.
  if (!impl_->options.units.empty()) return impl_->sync.restart_trials_unless_decided();
  // The last joiner has taken every step: its replica is the one to keep. Under HSDP it is
  // group g's rank r (StepStatus::job_rank): to its place in every group, then inside each.
  comm::Communicator* replicas = impl_->options.replicas;
  const int group_size = impl_->comm.size();
  for (const Arena& arena : impl_->registry.arenas()) {
    Tensor values = arena.values;
    if (replicas != nullptr && replicas->size() > 1) replicas->broadcast(values, last_joiner / group_size);
    impl_->comm.broadcast(values, last_joiner % group_size);
  }
  // An AUTO trial cut short by the join counted different windows on different ranks.
  impl_->sync.restart_trials_unless_decided();
}

comm::Communicator& DataParallel::join_communicator() const { return impl_->comm; }

int DataParallel::join_rank() const { return impl_->job_rank(); }

int DataParallel::join_world_size() const { return impl_->job_size(); }

// Join's one-participant form (gradsync/dist/join/join.h) is defined here, where a DataParallel is a complete
// Joinable: the join folder sits below data_parallel and does not include it.
Join::Join(DataParallel& ddp, JoinOptions options, optim::Optimizer* optimizer)
    : Join(std::vector<Joinable*>{&ddp}, options, optimizer) {}

}  // namespace gradsync::dist
