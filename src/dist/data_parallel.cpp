// DataParallel and the sync strategies (gradsync/dist/data_parallel.h).
#include "gradsync/dist/data_parallel.h"
#include "gradsync/core/timeline.h"
#include "gradsync/dist/distributed_optimizer.h"
#include "gradsync/dist/join.h"
#include "gradsync/kernels/ops.h"

#include <array>
#include <cstdio>
#include <exception>
#include <functional>
#include <sstream>

#include "consistency.h"
#include "join_census.h"

namespace gradsync::dist {

using Clock = std::chrono::steady_clock;

namespace {
// AUTO's trials: one warm-up window, then each candidate for kTrialWindows windows.
constexpr std::array<DDPSyncStrategy, 3> kCandidates{DDPSyncStrategy::single_auto_sync, DDPSyncStrategy::multi_auto_sync,
                                                     DDPSyncStrategy::forced_sync};
constexpr int kTrialWindows = 2;
constexpr int kLastTrialWindow = kTrialWindows * static_cast<int>(kCandidates.size());
// The status allreduce after the usage bitmap and the rank words: the carry flag, AUTO's
// decision flag and its three summed trial times.
constexpr std::size_t kTailWords = 5;
}  // namespace

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

  // AUTO: window 0 warms up, windows 1-6 try SINGLE, SINGLE, MULTI, MULTI, FORCED, FORCED;
  // later windows use SINGLE until the decision, which rides on the next synchronized step's
  // status allreduce (so a joined rank, shadowing that step, decides with everybody).
  struct AutoState {
    int window = 0;
    bool active = false;
    DDPSyncStrategy current = DDPSyncStrategy::single_auto_sync;
    Clock::time_point start;
    std::array<double, 3> seconds{};
    bool decision_due = false;  // the trial windows are over: send the times with the next status
    std::optional<DDPSyncStrategy> chosen;
  } automatic;

  // The end of an AUTO window, with or without an exception: local bookkeeping only, so that
  // every rank counts the same windows whatever it threw and caught inside one.
  void end_auto_window(bool final) {
    AutoState& state = automatic;
    if (!final) return;
    const double seconds = std::chrono::duration<double>(Clock::now() - state.start).count();
    if (state.window > 0 && state.window <= kLastTrialWindow) {
      state.seconds[static_cast<std::size_t>((state.window - 1) / kTrialWindows)] += seconds;
    }
    state.active = false;
    ++state.window;
    if (state.window == kLastTrialWindow + 1) state.decision_due = true;
  }

  // Every rank decides from the same summed times, read from the same status allreduce: the
  // same choice.
  void decide_auto(const double* summed);

  // The Join this rank is inside (join.h), or null.
  const JoinOptions* join_options = nullptr;
  // The gradients reduced by this step stay in place for the next synchronized step of the
  // same window (MULTI_AUTO_SYNC before the final microbatch, set by DDPSyncContext): a joined
  // rank then contributes them again instead of zeros, so the part already averaged is not
  // shrunk by the joined ranks (docs/join.md).
  bool step_carries = false;
  bool last_step_carried = false;  // as the last status said
  // An optimizer whose step is collective (ZeRO): after every synchronized step that does not
  // carry, the active ranks step it, and a joined rank runs this to take part (join.h).
  std::function<void()> shadow_optimizer_step;

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
    if (options.broadcast_parameters) {
      for (const Arena& arena : registry.arenas()) {
        Tensor values = arena.values;
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
    reducer_options.prescale = 1.0 / comm.size();  // divide before the sum, as PyTorch
    reducer_options.reduce_scatter = options.shard_gradients;
    std::vector<Parameter*> backward_order(parameters.rbegin(), parameters.rend());
    reducer = std::make_unique<Reducer>(registry, comm, backward_order, std::vector<std::vector<Parameter*>>{},
                                        reducer_options);
    ready_this_backward.assign(registry.size(), false);
    used_in_window.assign(registry.size(), false);
    subscription = registry.on_ready([this](Parameter& parameter) { on_ready(parameter); });
  }

  void begin_backward() {
    GRADSYNC_CHECK(!in_backward, "DataParallel::begin_backward: the previous backward was not ended (call end_backward())");
    in_backward = true;
    backward_syncs = no_sync_depth == 0;
    timeline_backward = timeline::enabled();
    if (timeline_backward) timeline::detail::begin("backward", backward_syncs ? "backward (synchronized)" : "backward (no_sync)");
    std::fill(ready_this_backward.begin(), ready_this_backward.end(), false);
  }

  void on_ready(Parameter& parameter) {
    if (!reducer->contains(parameter)) return;
    if (!in_backward) begin_backward();  // the first ready signal begins a backward
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
  // `join_flags`: this rank's join flags (join_census.h) when the step is a shadow step.
  join_detail::Census finalize(bool tolerate_missing, int join_flags = 0) {
    const std::size_t count = parameters.size();
    const int world = comm.size();
    std::vector<bool> undefined_before(count);
    std::vector<std::size_t> missing;
    for (std::size_t i = 0; i < count; ++i) {
      undefined_before[i] = !parameters[i]->grad_defined();
      if (!used_in_window[parameters[i]->index()]) missing.push_back(i);
    }
    reducer->finish();
    // Status, summed: [usage bitmap of the window | one word of flags per rank | carry flag |
    // AUTO's decision flag and trial times]. Doubles: the counts stay exact and the times fit.
    const std::size_t ranks_at = count;
    const std::size_t carry_at = count + static_cast<std::size_t>(world);
    const std::size_t auto_at = carry_at + 1;
    Tensor status = Tensor::zeros({static_cast<std::int64_t>(carry_at + kTailWords)}, DType::f64);
    double* words = status.data_as<double>();
    for (std::size_t i = 0; i < count; ++i) words[i] = used_in_window[parameters[i]->index()] ? 1 : 0;
    int flags = join_flags;
    if (!tolerate_missing && !missing.empty()) flags |= join_detail::kMissedGradients;
    words[ranks_at + static_cast<std::size_t>(comm.rank())] = flags;
    if (join_flags == 0 && step_carries) words[carry_at] = 1;
    if (automatic.decision_due) {
      words[auto_at] = 1;
      std::copy(automatic.seconds.begin(), automatic.seconds.end(), words + auto_at + 1);
    }
    timeline::instant("status", join_flags ? "status allreduce (joined)" : "status allreduce");
    comm::WorkHandle status_work = comm.allreduce_host_async(status, comm::ReduceOp::sum);
    try {
      reducer->wait();
    } catch (...) {
      // The status allreduce still writes `status`: wait for it (bounded; it fails at once on
      // a broken communicator) before the buffer can go away. The Reducer's error wins.
      try {
        status_work->wait();
      } catch (...) {
      }
      throw;
    }
    status_work->wait();
    std::fill(used_in_window.begin(), used_in_window.end(), false);
    last_used_counts.assign(count, 0);
    for (std::size_t i = 0; i < count; ++i) last_used_counts[i] = static_cast<int>(words[i]);
    const join_detail::Census census = join_detail::read_census(words + ranks_at, world);
    last_step_carried = words[carry_at] > 0;
    if (words[auto_at] > 0) decide_auto(words + auto_at + 1);

    if (!census.missed.empty()) raise_missing(join_flags ? std::vector<std::size_t>{} : missing, census.missed);
    // Globally unused parameters keep an undefined gradient (the zero-fill was only for the
    // collective); locally unused but globally used ones keep the reduced value.
    for (std::size_t i = 0; i < count; ++i) {
      if (last_used_counts[i] == 0 && undefined_before[i]) parameters[i]->zero_grad(/*set_to_undefined=*/true);
    }
    if (census.joined > 0 && join_flags == 0) react_to_joined(census);
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

  // An active rank's step in which `census.joined` ranks contributed zeros.
  void react_to_joined(const join_detail::Census& census) {
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

  // join.h: this rank is out of inputs. Shadow steps until every rank has joined; then the
  // last joiner's parameters, buffers (and optimizer state) everywhere. Returns that rank.
  int join(optim::Optimizer* optimizer) {
    GRADSYNC_CHECK(!in_backward, "Join::join inside a backward: call end_backward() first");
    GRADSYNC_CHECK(!automatic.active, "Join::join inside a ddp_sync_context window: close the window first");
    GRADSYNC_CHECK(!reducer->round_started(), "Join::join with a synchronized step half launched");
    const int world = comm.size();
    int flags = join_detail::kJoined | join_detail::kJoinedThisStep;
    int last_joiner = comm.rank();
    for (;;) {
      // Zeros in every bucket: this rank's leftover gradients (a partial accumulation window)
      // must not leak into the others' average, and it uses no parameter. Except when the
      // others carry the last step's average into this one and the average divides by the
      // initial world size: then this rank adds that average too, as each of them does.
      const bool carry = last_step_carried && (join_options == nullptr || join_options->divide_by_initial_world_size);
      if (!carry) {
        for (Parameter* parameter : parameters) parameter->zero_grad(/*set_to_undefined=*/true);
      }
      std::fill(used_in_window.begin(), used_in_window.end(), false);
      join_detail::Census census;
      try {
        census = finalize(/*tolerate_missing=*/true, flags);
      } catch (const std::exception& error) {
        join_detail::rethrow_from_shadow_step(error);
      }
      if (census.joined == world) {
        last_joiner = census.last_joiner;
        break;
      }
      if (join_options != nullptr && join_options->throw_on_early_termination) {
        throw JoinEarlyTermination("Rank " + std::to_string(comm.rank()) + " exhausted all inputs.");
      }
      if (shadow_optimizer_step && !last_step_carried) {
        try {
          shadow_optimizer_step();
        } catch (const std::exception& error) {
          join_detail::rethrow_from_shadow_step(error);
        }
      }
      flags = join_detail::kJoined;
    }
    for (Parameter* parameter : parameters) parameter->zero_grad(/*set_to_undefined=*/true);
    // The last joiner has taken every step: its replica is the one to keep.
    for (const Arena& arena : registry.arenas()) {
      Tensor values = arena.values;
      comm.broadcast(values, last_joiner);
    }
    // A sharded optimizer (ZeRO) kept stepping its pieces on the joined ranks: nothing to copy.
    if (optimizer != nullptr && !optimizer->sharded()) broadcast_optimizer_state(*optimizer, comm, last_joiner);
    // An AUTO trial cut short by the join counted different windows on different ranks: start
    // the trials again, everywhere alike.
    if (!automatic.chosen) automatic = AutoState{};
    return last_joiner;
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

  void synchronize_all() {
    GRADSYNC_CHECK(!in_backward, "DataParallel::synchronize_all inside a backward: call end_backward() first");
    finalize(/*tolerate_missing=*/true);
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
void DataParallel::synchronize_all() { impl_->synchronize_all(); }
const std::vector<int>& DataParallel::last_used_counts() const { return impl_->last_used_counts; }
bool DataParallel::inside_join() const { return impl_->join_options != nullptr; }
void DataParallel::set_shadow_optimizer_step(std::function<void()> step) {
  impl_->shadow_optimizer_step = std::move(step);
}
const Reducer& DataParallel::reducer() const { return *impl_->reducer; }
comm::Communicator& DataParallel::communicator() const { return impl_->comm; }
ParameterRegistry& DataParallel::registry() const { return impl_->registry; }
const DataParallelOptions& DataParallel::options() const { return impl_->options; }

void DataParallel::register_comm_hook(ReduceHook hook) {
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

// ---- sync strategies -------------------------------------------------------------------------

const char* sync_strategy_name(DDPSyncStrategy strategy) {
  switch (strategy) {
    case DDPSyncStrategy::single_auto_sync: return "single_auto_sync";
    case DDPSyncStrategy::multi_auto_sync: return "multi_auto_sync";
    case DDPSyncStrategy::forced_sync: return "forced_sync";
    case DDPSyncStrategy::auto_select: return "auto";
  }
  return "?";
}

DDPSyncStrategy parse_sync_strategy(const std::string& text) {
  for (const DDPSyncStrategy strategy : {DDPSyncStrategy::single_auto_sync, DDPSyncStrategy::multi_auto_sync,
                                         DDPSyncStrategy::forced_sync, DDPSyncStrategy::auto_select}) {
    if (text == sync_strategy_name(strategy)) return strategy;
  }
  detail::throw_error("'", text, "' is not a valid DDPSyncStrategy: expected one of single_auto_sync, multi_auto_sync, ",
                      "forced_sync, auto");
}

DDPSyncStrategy default_sync_strategy(bool find_unused_parameters) {
  return find_unused_parameters ? DDPSyncStrategy::multi_auto_sync : DDPSyncStrategy::single_auto_sync;
}


void DataParallel::Impl::decide_auto(const double* summed) {
  AutoState& state = automatic;
  state.decision_due = false;
  std::size_t best = 0;
  for (std::size_t k = 1; k < kCandidates.size(); ++k) {
    if (kCandidates[k] == DDPSyncStrategy::multi_auto_sync && options.shard_gradients) continue;
    if (summed[k] < summed[best]) best = k;
  }
  state.chosen = kCandidates[best];
  if (comm.rank() == 0) {
    std::fprintf(stderr,
                 "gradsync: DDPSyncStrategy auto chose %s (mean window ms over %d windows each, summed over ranks: "
                 "single %.2f, multi %.2f, forced %.2f)\n",
                 sync_strategy_name(*state.chosen), kTrialWindows, summed[0] * 1e3 / kTrialWindows,
                 summed[1] * 1e3 / kTrialWindows, summed[2] * 1e3 / kTrialWindows);
  }
}

DDPSyncContext::DDPSyncContext(DataParallel& ddp, bool is_final_microbatch, DDPSyncStrategy strategy)
    : ddp_(ddp), final_(is_final_microbatch), strategy_(strategy), uncaught_(std::uncaught_exceptions()) {
  if (strategy_ == DDPSyncStrategy::auto_select) {
    auto& state = ddp_.impl_->automatic;
    if (state.chosen) {
      strategy_ = *state.chosen;
    } else {
      if (!state.active) {
        state.active = true;
        state.start = Clock::now();
        const bool trial = state.window > 0 && state.window <= kLastTrialWindow;
        state.current = trial ? kCandidates[static_cast<std::size_t>((state.window - 1) / kTrialWindows)]
                              : DDPSyncStrategy::single_auto_sync;
      }
      strategy_ = state.current;
      auto_window_ = true;
    }
  }
  if (strategy_ == DDPSyncStrategy::multi_auto_sync && ddp_.impl_->options.shard_gradients) {
    // Reduce-scattered buckets leave the reduced gradient in one piece per rank; a second
    // synchronization in the window would reduce those pieces again.
    GRADSYNC_CHECK(auto_window_, "multi_auto_sync does not combine with shard_gradients (ZeRO stage 2): it ",
                   "synchronizes every microbatch, and reduce-scattered gradients cannot be reduced again; use ",
                   "single_auto_sync or forced_sync");
    strategy_ = DDPSyncStrategy::single_auto_sync;  // AUTO: MULTI's trial windows run SINGLE
  }
  const bool unsynced = (strategy_ == DDPSyncStrategy::single_auto_sync && !final_) ||
                        strategy_ == DDPSyncStrategy::forced_sync;
  if (unsynced) no_sync_.emplace(ddp_);
  ddp_.impl_->step_carries = strategy_ == DDPSyncStrategy::multi_auto_sync && !final_;
}

void DDPSyncContext::close() {
  if (closed_) return;
  closed_ = true;
  no_sync_.reset();
  ddp_.impl_->step_carries = false;
  if (!final_) return;
  if (strategy_ == DDPSyncStrategy::forced_sync) {
    try {
      ddp_.synchronize_all();
    } catch (...) {
      if (auto_window_) ddp_.impl_->end_auto_window(/*final=*/true);
      throw;
    }
  }
  if (auto_window_) ddp_.impl_->end_auto_window(/*final=*/true);
}

DDPSyncContext::~DDPSyncContext() noexcept(false) {
  if (std::uncaught_exceptions() > uncaught_) {
    closed_ = true;  // unwinding: restore no_sync, communicate nothing, but count the window
    no_sync_.reset();
    ddp_.impl_->step_carries = false;
    if (auto_window_) ddp_.impl_->end_auto_window(final_);
    return;
  }
  close();
}

}  // namespace gradsync::dist

// ---- Join (join.h) ---------------------------------------------------------------------------

namespace gradsync::dist {

Join::Join(DataParallel& ddp, JoinOptions options, optim::Optimizer* optimizer)
    : ddp_(ddp), options_(options), optimizer_(optimizer), uncaught_(std::uncaught_exceptions()) {
  if (!options_.enable) return;
  GRADSYNC_CHECK(ddp_.impl_->join_options == nullptr, "Join: this DataParallel is already inside a Join");
  ddp_.impl_->join_options = &options_;
}

Join::~Join() noexcept(false) {
  if (!options_.enable || joined_) return;
  if (std::uncaught_exceptions() > uncaught_) {  // unwinding: leave, communicating nothing
    ddp_.impl_->join_options = nullptr;
    return;
  }
  join();
}

int Join::join() {
  GRADSYNC_CHECK(!joined_, "Join::join called twice");
  joined_ = true;
  if (!options_.enable) return ddp_.impl_->comm.rank();
  struct Leave {  // the Join ends when join() does, also when it throws
    DataParallel::Impl& impl;
    ~Leave() { impl.join_options = nullptr; }
  } leave{*ddp_.impl_};
  if (ddp_.impl_->comm.size() == 1) return 0;
  timeline::Span span("join", "join (shadowing)");
  return ddp_.impl_->join(optimizer_);
}

}  // namespace gradsync::dist
