// ZeroOptimizer (gradsync/dist/zero.h): the optimizer sharded over a Reducer's buckets
// (DataParallel's, or the DistributedOptimizer's with zero_stage).
#include "gradsync/dist/zero.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>

#include "gradsync/comm/flight_recorder.h"
#include "gradsync/core/timeline.h"
#include "gradsync/dist/replicas.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/optim/clip.h"
#include "zero_checkpoint.h"

namespace gradsync::dist {

struct ZeroOptimizer::Impl {
  optim::Optimizer& optimizer;
  const Reducer& reducer;     // whose buckets are sharded
  DataParallel* ddp;          // the DataParallel front end (Join takes part), or null
  ZeroOptions options;
  // The parameter gathers run on their own communicator: launched after the step, they may
  // still travel while the next backward's buckets go out on the Reducer's.
  std::unique_ptr<comm::Communicator> own_comm;
  comm::Communicator& comm;
  ShardLayout layout;  // who owns which elements (zero_checkpoint.h)

  // One bucket's gather: this rank's piece of the updated values, allgathered into the arena.
  struct Gather {
    std::size_t arena = 0;
    std::int64_t begin = 0;  // the bucket's first element in the arena
    BucketShard shard;
    Tensor staging;  // this rank's piece (the input must not alias the output); stage 3: a
                     // buffer of the staging pool, at least the piece's size
    comm::WorkHandle work;
  };
  std::vector<Gather> gathers;  // by bucket index

  // Stage 3: the engine's units, each one bucket (DataParallelOptions::units), in its order.
  enum class UnitState { released, gathering, gathered };
  struct Unit {
    std::size_t bucket = 0;
    std::vector<Parameter*> members;
    std::shared_ptr<const std::string> why_released;  // what a released member's value() says
    UnitState state = UnitState::gathered;  // until build() releases it
  };
  std::vector<Unit> units;
  std::vector<std::size_t> unit_of_bucket;
  // Stage 3's staging buffers, each the size of the largest piece, kept for the next unit's
  // gather: there are only as many as gathers in flight at once (two with auto prefetch), and
  // a fresh buffer per gather would cost its page faults on the caller's thread each time.
  std::vector<Tensor> staging_pool;
  std::int64_t largest_piece = 0;
  // Auto prefetch: the first step's order of gathers, replayed from a cursor in later steps.
  std::vector<std::size_t> recorded_order;
  bool recording = true;
  std::size_t cursor = 0;

  Impl(optim::Optimizer& optimizer_, const Reducer& reducer_, comm::Communicator& base, DataParallel* ddp_,
       ZeroOptions options_)
      : optimizer(optimizer_), reducer(reducer_), ddp(ddp_), options(options_),
        own_comm(base.size() > 1 ? base.duplicate() : nullptr), comm(own_comm ? *own_comm : base) {}

  // A dist::Join over this ZeroOptimizer (and its DataParallel) is open on this rank.
  bool inside_join = false;
  ParameterRegistry& registry() const { return optimizer.registry(); }

  // Under dist::Join a joined rank must take part in every step: its pieces are its to update,
  // and the gathers need it. Each collective phase of a step on the active ranks therefore
  // starts with a control allreduce (max) of [kind, unscale, clip] that a joined rank answers
  // with zeros and reads: kind 1, the gradient statistics follow; kind 2, the step and the
  // gathers. See docs/zero.md.
  static constexpr double kStatistics = 1, kStep = 2, kGather = 3;
  bool shadowing = false;  // this rank is a joined rank in a shadow step

  // One small allreduce (max) before each statistics pass or step under Join: the kind, the
  // deferred unscale and clip factors, then each group's learning rate. A joined rank sends
  // zeros and takes the active ranks' values, so its pieces step with their learning rate (a
  // schedule its own loop no longer sets).
  struct Control {
    double kind, unscale, clip;
    std::vector<double> lrs;
  };
  // (kGather, stage 3: the unit to gather rides in `unscale`.)
  Control control(double kind, double unscale, double clip) {
    const comm::OperationLabel label(control_label());
    Tensor words = control_words(kind, unscale, clip);
    comm.allreduce_host(words, comm::ReduceOp::max);
    return parse_control(words);
  }

  static std::shared_ptr<const std::string> control_label() {
    static const auto kLabel = std::make_shared<const std::string>("ZeRO control (statistics, step or gather)");
    return kLabel;
  }

  Tensor control_words(double kind, double unscale, double clip) const {
    std::vector<double> words{kind, unscale, clip};
    for (std::size_t g = 0; g < optimizer.group_count(); ++g) words.push_back(kind == 0 ? 0.0 : optimizer.lr(g));
    return Tensor::from_vector(words, {static_cast<std::int64_t>(words.size())});
  }

  static Control parse_control(const Tensor& words) {
    const std::vector<double> v = words.to_double_vector();
    return {v[0], v[1], v[2], std::vector<double>(v.begin() + 3, v.end())};
  }

  // --- Stage 3 under dist::Join. The active ranks gather units anywhere in their forward and
  // backward, and every gather needs each joined rank's pieces; so a joined rank answers them
  // on a thread of its own (the shadow thread), from the moment it joins, while its own thread
  // shadows the DataParallel's synchronized steps (whose reduce-scatters wait for the active
  // ranks' backward, which waits for those gathers). Each gather of an active rank begins with a
  // control word (kGather and the unit); statistics and steps come as in stages 1 and 2, and the
  // shadow thread takes part in them too, but only once the rank's own thread has finished
  // shadowing the synchronization they follow (which writes the reduced pieces they read); the
  // rank's own thread then waits in shadow_step until that step is done (its next shadow step
  // zero-fills the gradients the step reads). When every rank has joined, every rank's shadow
  // thread is in the same control allreduce, all with zeros: kind 0 ends them.
  std::thread shadow_thread;
  std::mutex shadow_mutex;
  std::condition_variable shadow_changed;
  std::int64_t shadow_steps_done = 0;  // steps the shadow thread has done
  std::int64_t shadow_syncs = 0;       // synchronizations (each followed by a step) the rank's thread has shadowed
  bool shadow_over = false;
  std::atomic<bool> shadow_stop{false};  // leaving the Join before every rank joined (an error): stop waiting
  std::exception_ptr shadow_error;
  Tensor shadow_words;  // the control word the shadow thread waits on (outlives a stopped wait)

  // The shadow thread's control(0, 0, 0): its allreduce polled (every 100 us: the gather it
  // announces waits for this rank's answer), so that a Join left abnormally (an exception on
  // this rank) does not wait for the communicator's timeout.
  Control shadow_control() {
    const comm::OperationLabel label(control_label());
    shadow_words = control_words(0, 0, 0);
    comm::WorkHandle work = comm.allreduce_async(shadow_words, comm::ReduceOp::max);
    while (!work->is_completed()) {
      if (shadow_stop.load()) {
        detail::throw_error("ZeroOptimizer: the Join was left before every rank joined (the shadow thread stopped)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    work->wait();  // its error, if it failed
    return parse_control(shadow_words);
  }

  void begin_shadow_thread() {
    if (options.stage != 3 || shadow_thread.joinable()) return;
    shadowing = true;  // the gathers, statistics and steps below announce nothing
    shadow_steps_done = shadow_syncs = 0;
    shadow_over = false;
    shadow_stop = false;
    shadow_error = nullptr;
    shadow_thread = std::thread([this] { serve_shadow(); });
  }

  void serve_shadow() {
    try {
      for (;;) {
        const Control word = shadow_control();
        if (word.kind == 0) break;  // every rank has joined
        if (word.kind == kGather) {
          const auto u = static_cast<std::size_t>(word.unscale);  // the unit rides in that slot
          GRADSYNC_CHECK(u < units.size(), "ZeroOptimizer: a joined rank was asked to gather unit ", u, " of ", units.size());
          launch_unit_gather(units[u]);  // this rank's pieces go out to the others
          finish_gather(units[u]);
          release_unit(units[u]);
        } else if (word.kind == kStatistics || word.kind == kStep) {
          {
            // The rank's own thread may still be finishing the synchronization this step follows
            // (writing the reduced pieces that the statistics and the step read): wait for it.
            std::unique_lock<std::mutex> lock(shadow_mutex);
            shadow_changed.wait(lock, [&] { return shadow_syncs > shadow_steps_done || shadow_stop.load(); });
            if (shadow_stop.load()) detail::throw_error("ZeroOptimizer: the Join was left before every rank joined");
          }
          follow(word);
          if (word.kind == kStep) {
            const std::lock_guard<std::mutex> lock(shadow_mutex);
            ++shadow_steps_done;
            shadow_changed.notify_all();
          }
        } else {
          detail::throw_error("ZeroOptimizer: a joined rank expected a gather, statistics or a step, got control word ",
                              word.kind);
        }
      }
    } catch (...) {
      const std::lock_guard<std::mutex> lock(shadow_mutex);
      shadow_error = std::current_exception();
    }
    const std::lock_guard<std::mutex> lock(shadow_mutex);
    shadow_over = true;
    shadow_changed.notify_all();
  }

  // The rank's own thread, after a synchronization the active ranks step after: lets the shadow
  // thread take that step's statistics and step (they read the gradients the synchronization
  // wrote), and waits until it has (bounded: its collectives have the communicator's timeout).
  void wait_for_shadow_step() {
    std::unique_lock<std::mutex> lock(shadow_mutex);
    ++shadow_syncs;  // this synchronization is shadowed: the shadow thread may read its gradients
    shadow_changed.notify_all();
    shadow_changed.wait(lock, [&] { return shadow_steps_done >= shadow_syncs || shadow_over; });
    if (shadow_error) std::rethrow_exception(shadow_error);
    GRADSYNC_CHECK(shadow_steps_done >= shadow_syncs, "ZeroOptimizer: the active ranks synchronized a step ",
                   "and sent no optimizer step for the joined ranks (ZeRO-3 under dist::Join steps after every ",
                   "synchronized step)");
  }

  // Ends the shadow thread: `stop` when leaving before every rank joined (it would otherwise
  // wait for the others' next control word until the timeout).
  void end_shadow_thread(bool stop) {
    if (!shadow_thread.joinable()) return;
    {
      const std::lock_guard<std::mutex> lock(shadow_mutex);
      shadow_stop = stop;
      shadow_changed.notify_all();
    }
    shadow_thread.join();
    shadowing = false;
  }

  bool announces() const {
    // A Join over the DataParallel alone would leave the joined ranks out of this step's
    // collectives: the active ranks would wait for them until the timeout.
    GRADSYNC_CHECK(inside_join || ddp == nullptr || !ddp->inside_join(), "ZeroOptimizer: its DataParallel is inside ",
                   "a dist::Join that does not include this ZeroOptimizer, so joined ranks would not take part in its ",
                   "steps; join both: dist::Join({&ddp, &zero}, options)");
    return inside_join && !shadowing;
  }

  void require_no_scaler_under_join() const {
    GRADSYNC_CHECK(!inside_join || optimizer.pending_gradient_unscale() == 1.0, "ZeroOptimizer under dist::Join ",
                   "with a GradScaler is not supported: a skipped step would leave the joined ranks waiting for it");
  }

  // A joined rank's part in one optimizer step of the others (the join loop runs it after every
  // synchronized step that does not carry).
  void shadow_step() {
    shadowing = true;
    struct Reset {
      bool& flag;
      ~Reset() { flag = false; }
    } reset{shadowing};
    for (;;) {
      const Control word = control(0, 0, 0);
      if (word.kind == kStatistics) {
        follow(word);
      } else if (word.kind == kStep) {
        follow(word);
        launch_gathers();
        wait_all();
        return;
      } else {
        detail::throw_error("ZeroOptimizer: a joined rank expected the others' optimizer step, got control word ", word.kind);
      }
    }
  }

  // A joined rank's part in the active ranks' statistics (kStatistics: its pieces' sums) or
  // step (kStep: its pieces stepped with their factors and learning rates).
  void follow(const Control& word) {
    if (word.unscale != 1.0) optimizer.defer_gradient_unscale(word.unscale);
    if (word.kind == kStatistics) {
      (void)optimizer.gradient_statistics();  // combine() takes part in the sums
      return;
    }
    if (word.clip != 1.0) optimizer.defer_gradient_clip(word.clip);
    for (std::size_t g = 0; g < word.lrs.size(); ++g) optimizer.set_lr(g, word.lrs[g]);
    optimizer.step();
  }

  void build() {
    GRADSYNC_CHECK(options.stage >= 1 && options.stage <= 3, "ZeroOptimizer: stage ", options.stage,
                   " (expected 1: optimizer state sharded, 2: gradients too, or 3: parameters too)");
    GRADSYNC_CHECK(ddp == nullptr || &optimizer.registry() == &ddp->registry(), "ZeroOptimizer: the optimizer and the ",
                   "DataParallel are over different registries");
    const bool sharded_gradients = reducer.options().reduce_scatter;
    GRADSYNC_CHECK(sharded_gradients == (options.stage >= 2), "ZeroOptimizer: stage ", options.stage, " needs a ",
                   "DataParallel ", options.stage >= 2 ? "with" : "without", " shard_gradients (DataParallelOptions), ",
                   "which decides whether buckets are reduce-scattered (stages 2, 3) or allreduced (stage 1)");
    GRADSYNC_CHECK(options.stage < 3 || (ddp != nullptr && !ddp->options().units.empty()), "ZeroOptimizer: stage 3 ",
                   "needs a DataParallel with units (DataParallelOptions::units): the groups of parameters the engine ",
                   "gathers and releases together");
    // Every rank the same stage and the same buckets (a rank with another bucket_cap_mb, say,
    // would cut other pieces): an error on every rank naming the first difference.
    std::vector<std::string> description{"stage " + std::to_string(options.stage)};
    for (std::size_t b = 0; b < reducer.bucket_count(); ++b) {
      const BucketInfo& info = reducer.bucket(b);
      description.push_back("bucket " + std::to_string(b) + ": arena " + std::to_string(info.members[0]->arena_index()) +
                       ", " + std::to_string(info.numel) + " elements from '" + info.members[0]->name() + "'");
    }
    require_same_lines(comm, description, "ZeroOptimizer", "shard layout");

    layout.all_ranges.assign(static_cast<std::size_t>(comm.size()),
                      std::vector<std::vector<optim::Optimizer::ElementRange>>(registry().arenas().size()));
    for (std::size_t b = 0; b < reducer.bucket_count(); ++b) {
      const BucketInfo& info = reducer.bucket(b);
      const std::int64_t begin = static_cast<std::int64_t>(info.members[0]->arena_offset()) - info.member_offset[0];
      for (int r = 0; r < comm.size(); ++r) {
        const BucketShard piece = shard_bucket(info.numel, comm.size(), r);
        if (piece.count == 0) continue;
        layout.all_ranges[static_cast<std::size_t>(r)][info.members[0]->arena_index()].push_back(
            {begin + piece.begin, begin + piece.begin + piece.count});
      }
    }
    for (auto& per_rank : layout.all_ranges) {
      for (auto& list : per_rank) {
        std::sort(list.begin(), list.end(), [](const auto& x, const auto& y) { return x.begin < y.begin; });
      }
    }
    layout.ranges.assign(registry().arenas().size(), {});
    for (std::size_t b = 0; b < reducer.bucket_count(); ++b) {
      const BucketInfo& info = reducer.bucket(b);
      GRADSYNC_CHECK(info.arena_view, "ZeroOptimizer: bucket ", b, " (", info.members[0]->name(), ", ...) is not a view ",
                     "of the gradient arena (its members are not neighbours: frozen parameters between them?); ",
                     "ZeRO shards arena runs");
      Gather gather;
      gather.arena = info.members[0]->arena_index();
      gather.begin = static_cast<std::int64_t>(info.members[0]->arena_offset()) - info.member_offset[0];
      gather.shard = shard_bucket(info.numel, comm.size(), comm.rank());
      if (gather.shard.count > 0) {
        layout.ranges[gather.arena].push_back({gather.begin + gather.shard.begin, gather.begin + gather.shard.begin + gather.shard.count});
      }
      gathers.push_back(std::move(gather));  // its staging is made at its first gather
    }
    for (auto& list : layout.ranges) {
      std::sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
    }
    layout.stage = options.stage;
    optimizer.shard(layout.ranges, [this](optim::GradientStatistics& statistics) { combine(statistics); });
    if (options.stage == 3) build_units();
  }

  // Stage 3: each declared unit is one bucket (DataParallel made it so); then every unit is
  // released, leaving this rank its pieces.
  void build_units() {
    const auto& declared = ddp->options().units;
    unit_of_bucket.assign(reducer.bucket_count(), 0);
    for (const Gather& gather : gathers) largest_piece = std::max(largest_piece, gather.shard.count);
    for (std::size_t u = 0; u < declared.size(); ++u) {
      Unit unit;
      unit.bucket = reducer.bucket_of(*declared[u][0]);
      unit.members = declared[u];
      const BucketInfo& info = reducer.bucket(unit.bucket);
      GRADSYNC_CHECK(info.members.size() == unit.members.size(), "ZeroOptimizer: unit ", u, " ('",
                     unit.members[0]->name(), "', ...) is not one bucket of its DataParallel");
      std::string names = "'" + unit.members[0]->name() + "'" + (unit.members.size() > 1 ? ", ..." : "");
      unit.why_released = std::make_shared<const std::string>(
          "it is in unit " + std::to_string(u) + " (" + names + "), which is released (ZeRO stage 3): gather(" +
          std::to_string(u) + ") first");
      unit_of_bucket[unit.bucket] = u;
      units.push_back(std::move(unit));
    }
    for (Unit& unit : units) release_unit(unit);
  }

  // This rank's piece of a unit's values stays; the rest is zeroed and its pages given back.
  void release_unit(Unit& unit) {
    if (unit.state == UnitState::released) return;
    finish_gather(unit);
    const Gather& gather = gathers[unit.bucket];
    const std::int64_t numel = reducer.bucket(unit.bucket).numel;
    release_other_pieces(registry().arenas()[gather.arena].values.view(static_cast<std::size_t>(gather.begin), {numel}),
                         gather.shard);
    for (Parameter* member : unit.members) member->set_value_released(unit.why_released);
    unit.state = UnitState::released;
  }

  void launch_unit_gather(Unit& unit) {
    if (unit.state != UnitState::released) return;  // gathered or on its way: free
    // Under Join, the joined ranks' shadow threads learn which unit to give their pieces to.
    if (announces()) control(kGather, static_cast<double>(&unit - units.data()), 0);
    launch_gather(gathers[unit.bucket]);
    unit.state = UnitState::gathering;
  }

  void finish_gather(Unit& unit) {
    if (unit.state != UnitState::gathering) return;
    try {
      wait(gathers[unit.bucket]);
    } catch (const std::exception& error) {
      // The unit's values are not whole: it stays released, and the error says which gather.
      unit.state = UnitState::released;
      gathers[unit.bucket].staging = Tensor();  // the failed gather may still hold it: not pooled
      std::string cause = error.what();
      const std::string own = "rank " + std::to_string(comm.rank()) + ": ";
      if (cause.starts_with(own)) cause.erase(0, own.size());  // the rank is said once, in front
      detail::throw_error("ZeRO-3 gather of unit ", &unit - units.data(), " ('", unit.members[0]->name(), "'",
                          unit.members.size() > 1 ? ", ..." : "", ") failed: ", cause);
    }
    // Stage 3 gathers a few units at a time: a unit's staging buffer goes back to the pool
    // (stages 1 and 2 gather every bucket at once, so theirs stay).
    staging_pool.push_back(std::move(gathers[unit.bucket].staging));
    for (Parameter* member : unit.members) member->set_value_released(nullptr);
    unit.state = UnitState::gathered;
  }

  Unit& unit_at(std::size_t u, const char* what) {
    GRADSYNC_CHECK(options.stage == 3, "ZeroOptimizer::", what, ": stage ", options.stage, " has no units (stage 3 does)");
    GRADSYNC_CHECK(u < units.size(), "ZeroOptimizer::", what, ": unit ", u, " of ", units.size());
    return units[u];
  }

  // gather(u): the unit here; in the first step its place in the order is recorded, in later
  // ones the next recorded unit is launched behind it.
  void gather_unit(std::size_t u) {
    Unit& unit = unit_at(u, "gather");
    launch_unit_gather(unit);
    if (recording) {
      recorded_order.push_back(u);
    } else if (options.auto_prefetch) {
      std::size_t at = cursor;
      while (at < recorded_order.size() && recorded_order[at] != u) ++at;
      if (at < recorded_order.size()) {
        cursor = at + 1;
        if (cursor < recorded_order.size()) launch_unit_gather(units[recorded_order[cursor]]);
      } else {
        cursor = recorded_order.size();  // off the recorded order: no more guesses this step
      }
    }
    finish_gather(unit);
  }

  // Every rank's statistics of its owned pieces, made the world's: sums, and the largest.
  void combine(optim::GradientStatistics& statistics) {
    if (announces()) {
      require_no_scaler_under_join();
      control(kStatistics, optimizer.pending_gradient_unscale(), 1.0);
    }
    static const auto kLabel = std::make_shared<const std::string>("ZeRO gradient statistics");
    const comm::OperationLabel label(kLabel);
    Tensor sums = Tensor::from_vector(
        std::vector<double>{statistics.sum_of_squares, static_cast<double>(statistics.nonfinite)}, {2});
    comm.allreduce_host(sums, comm::ReduceOp::sum);
    Tensor largest = Tensor::from_vector(std::vector<double>{statistics.max_abs}, {1});
    comm.allreduce_host(largest, comm::ReduceOp::max);
    statistics.sum_of_squares = sums.to_double_vector()[0];
    statistics.nonfinite = static_cast<std::int64_t>(sums.to_double_vector()[1]);
    statistics.max_abs = largest.to_double_vector()[0];
  }

  void launch_gathers() {
    for (Gather& gather : gathers) launch_gather(gather);
  }

  // One bucket's pieces of the values allgathered into the arena (this rank's own from a
  // staging copy: the input must not alias the output).
  void launch_gather(Gather& gather) {
    const Arena& arena = registry().arenas()[gather.arena];
    Tensor values = arena.values;  // shares the arena's storage
    if (!gather.staging.defined()) {
      gather.staging = options.stage == 3 ? pooled_staging(arena)
                                          : Tensor::empty({gather.shard.count}, arena.dtype, arena.device);
    }
    Tensor piece = gather.staging.view(0, {gather.shard.count});
    if (gather.shard.count > 0) {
      piece.copy_from(values.view(static_cast<std::size_t>(gather.begin + gather.shard.begin), {gather.shard.count}));
    }
    std::int64_t numel = 0;
    for (const std::int64_t count : gather.shard.counts) numel += count;
    Tensor target = values.view(static_cast<std::size_t>(gather.begin), {numel});
    timeline::instant("zero", "gather parameters");
    const comm::OperationLabel label(
        options.stage == 3 ? "ZeRO-3 gather of unit " + std::to_string(unit_of_bucket[static_cast<std::size_t>(&gather - gathers.data())])
                           : "ZeRO gather: arena " + std::to_string(gather.arena) + " from element " + std::to_string(gather.begin));
    gather.work = comm.allgatherv_async(piece, target, gather.shard.counts);
  }

  // A stage-3 staging buffer for the arena's dtype and device: one from the pool, or a new one
  // the size of the largest piece (paged: a pool that is dropped gives its pages back).
  Tensor pooled_staging(const Arena& arena) {
    for (auto it = staging_pool.begin(); it != staging_pool.end(); ++it) {
      if (it->dtype() == arena.dtype && it->device() == arena.device) {
        Tensor buffer = std::move(*it);
        staging_pool.erase(it);
        return buffer;
      }
    }
    return Tensor::zeros_paged({largest_piece}, arena.dtype, arena.device);
  }

  void wait(Gather& gather) {
    if (!gather.work) return;
    comm::WorkHandle work = std::move(gather.work);
    work->wait();
  }

  void wait_all() {
    comm::FirstError errors;
    for (Gather& gather : gathers) errors.wait(gather.work);
    errors.rethrow();
  }

  void drain() noexcept {
    comm::FirstError ignored;  // destruction: nothing left to report to
    for (Gather& gather : gathers) ignored.wait(gather.work);
  }
};

ZeroOptimizer::ZeroOptimizer(optim::Optimizer& optimizer, DataParallel& ddp, ZeroOptions options)
    : impl_(std::make_unique<Impl>(optimizer, ddp.reducer(), ddp.communicator(), &ddp, options)) {
  impl_->build();
}

ZeroOptimizer::ZeroOptimizer(optim::Optimizer& optimizer, const Reducer& reducer, comm::Communicator& comm,
                             ZeroOptions options)
    : impl_(std::make_unique<Impl>(optimizer, reducer, comm, nullptr, options)) {
  impl_->build();
}

ZeroOptimizer::~ZeroOptimizer() {
  impl_->end_shadow_thread(/*stop=*/true);
  impl_->drain();
}

void ZeroOptimizer::step_async() {
  if (impl_->options.stage == 3) {
    // The gathered units' other pieces are about to go stale: every unit back to its pieces,
    // the owned pieces stepped, nothing gathered (the next use gathers).
    if (impl_->announces()) {  // joined ranks step their pieces with us (their shadow threads)
      impl_->require_no_scaler_under_join();
      impl_->control(Impl::kStep, impl_->optimizer.pending_gradient_unscale(), impl_->optimizer.pending_gradient_clip());
    }
    for (Impl::Unit& unit : impl_->units) impl_->release_unit(unit);
    impl_->optimizer.step();
    impl_->recording = false;
    impl_->cursor = 0;
    return;
  }
  impl_->wait_all();
  if (impl_->announces()) {  // joined ranks step their pieces with us (Impl::shadow_step)
    impl_->require_no_scaler_under_join();
    impl_->control(Impl::kStep, impl_->optimizer.pending_gradient_unscale(), impl_->optimizer.pending_gradient_clip());
  }
  impl_->optimizer.step();
  impl_->launch_gathers();
}

void ZeroOptimizer::step() {
  step_async();
  impl_->wait_all();
}

void ZeroOptimizer::wait_for(const Parameter& parameter) {
  const std::size_t bucket = impl_->reducer.bucket_of(parameter);
  if (impl_->options.stage == 3) return impl_->finish_gather(impl_->units[impl_->unit_of_bucket[bucket]]);
  impl_->wait(impl_->gathers.at(bucket));
}

void ZeroOptimizer::wait_all() { impl_->wait_all(); }

void ZeroOptimizer::zero_grad(bool set_to_undefined) {
  optim::Optimizer& optimizer = impl_->optimizer;
  if (impl_->options.stage < 2 || set_to_undefined) return optimizer.zero_grad(set_to_undefined);
  // Stage 2 keeps only its pieces' gradient pages between steps: zeros that give the pages
  // back rather than write them (a plain fill would commit the whole gradient arena).
  optimizer.zero_grad(true);
  for (std::size_t g = 0; g < optimizer.group_count(); ++g) {
    for (Parameter* parameter : optimizer.group_parameters(g)) parameter->grad_for_overwrite().zero_releasing_pages();
  }
}

double ZeroOptimizer::clip_grad_norm(double max_norm, double norm_type, bool error_if_nonfinite) {
  return optim::clip_grad_norm(impl_->optimizer, max_norm, norm_type, error_if_nonfinite);
}

std::size_t ZeroOptimizer::unit_count() const { return impl_->units.size(); }
std::size_t ZeroOptimizer::unit_of(const Parameter& parameter) const {
  GRADSYNC_CHECK(impl_->options.stage == 3, "ZeroOptimizer::unit_of: stage ", impl_->options.stage, " has no units");
  return impl_->unit_of_bucket[impl_->reducer.bucket_of(parameter)];
}
void ZeroOptimizer::gather(std::size_t unit) { impl_->gather_unit(unit); }
void ZeroOptimizer::prefetch(std::size_t unit) { impl_->launch_unit_gather(impl_->unit_at(unit, "prefetch")); }
void ZeroOptimizer::release(std::size_t unit) { impl_->release_unit(impl_->unit_at(unit, "release")); }
bool ZeroOptimizer::gathered(std::size_t unit) const {
  return impl_->unit_at(unit, "gathered").state == Impl::UnitState::gathered;
}

optim::Optimizer& ZeroOptimizer::optimizer() const { return impl_->optimizer; }
int ZeroOptimizer::stage() const { return impl_->options.stage; }
const std::vector<std::vector<optim::Optimizer::ElementRange>>& ZeroOptimizer::shard_ranges() const {
  return impl_->layout.ranges;
}
std::int64_t ZeroOptimizer::state_bytes() const { return impl_->optimizer.state_bytes(); }

// ---- Checkpoints (zero_checkpoint.cpp), once the gathers have landed -----------------------------

ZeroOptimizer::State ZeroOptimizer::consolidated_state() {
  impl_->wait_all();
  return dist::consolidated_state(impl_->optimizer, impl_->comm, impl_->layout);
}

void ZeroOptimizer::save_consolidated(const std::filesystem::path& path) {
  impl_->wait_all();
  dist::save_consolidated(impl_->optimizer, impl_->comm, impl_->layout, path);
}

void ZeroOptimizer::save_sharded(const std::filesystem::path& folder) {
  impl_->wait_all();
  dist::save_sharded(impl_->optimizer, impl_->comm, impl_->layout, folder);
}

void ZeroOptimizer::load_sharded(const std::filesystem::path& folder, bool reshard) {
  impl_->wait_all();
  // Stage 3: the set holds this rank's pieces of the values; a gathered unit's other pieces
  // would be stale after them.
  for (Impl::Unit& unit : impl_->units) impl_->release_unit(unit);
  dist::load_sharded(impl_->optimizer, impl_->comm, impl_->layout, folder, reshard);
}

void ZeroOptimizer::load_state(const std::filesystem::path& path) {
  impl_->wait_all();
  impl_->optimizer.load_state(path);
}

// ---- Joinable: a joined rank steps its pieces with the others and takes part in the gathers ----

void ZeroOptimizer::join_opened(const JoinOptions* options) {
  if (options == nullptr) impl_->end_shadow_thread(/*stop=*/true);  // left early (an error): no more waiting
  GRADSYNC_CHECK(options == nullptr || impl_->options.stage < 3 || !options->throw_on_early_termination,
                 "ZeroOptimizer: stage 3 under dist::Join with throw_on_early_termination is not supported (the ",
                 "joined rank's shadow thread would wait for gathers that never come)");
  GRADSYNC_CHECK(options == nullptr || impl_->ddp != nullptr, "ZeroOptimizer: only a ZeroOptimizer over a DataParallel ",
                 "joins (the DistributedOptimizer's zero_stage does not combine with join)");
  impl_->inside_join = options != nullptr;
}

void ZeroOptimizer::begin_shadowing() { impl_->begin_shadow_thread(); }

void ZeroOptimizer::shadow_step(JoinStep& step) {
  if (!step.synchronized || !step.optimizer_step_follows) return;
  if (impl_->options.stage == 3) return impl_->wait_for_shadow_step();  // the shadow thread steps
  impl_->shadow_step();
}

// Its pieces are current on every rank: nothing to copy. Stage 3: every rank's shadow thread
// ends with the control word of all zeros.
void ZeroOptimizer::finish_join(int) {
  impl_->end_shadow_thread(/*stop=*/false);
  if (impl_->shadow_error) std::rethrow_exception(std::exchange(impl_->shadow_error, nullptr));
}

comm::Communicator& ZeroOptimizer::join_communicator() const { return impl_->comm; }

}  // namespace gradsync::dist
