// ZeRO under dist::Join (join.h): the control words, a joined rank's shadow step, and
// stage 3's shadow thread.
#include "join.h"

#include <chrono>
#include <utility>

#include "gradsync/comm/records/flight_recorder.h"

namespace gradsync::dist {

namespace {

std::shared_ptr<const std::string> control_label() {
  static const auto kLabel = std::make_shared<const std::string>("ZeRO control (statistics, step or gather)");
  return kLabel;
}

}  // namespace

ZeroJoin::ZeroJoin(optim::Optimizer& optimizer, comm::Communicator& comm, DataParallel* ddp, int stage)
    : optimizer_(optimizer), comm_(comm), ddp_(ddp), stage_(stage) {
  comm::Communicator* replicas = ddp != nullptr ? ddp->options().replicas : nullptr;
  if (replicas != nullptr && replicas->size() > 1) replicas_ = replicas->duplicate();  // collective: every rank constructs
}

ZeroJoin::~ZeroJoin() { end_shadow_thread(/*stop=*/true); }

// ---- The active ranks' side: announcing each phase --------------------------------------------

bool ZeroJoin::announces() const {
  // A Join over the DataParallel alone would leave the joined ranks out of this step's
  // collectives: the active ranks would wait for them until the timeout.
  GRADSYNC_CHECK(inside_join_ || ddp_ == nullptr || !ddp_->inside_join(), "ZeroOptimizer: its DataParallel is inside ",
                 "a dist::Join that does not include this ZeroOptimizer, so joined ranks would not take part in its ",
                 "steps; join both: dist::Join({&ddp, &zero}, options)");
  return inside_join_ && !shadowing_;
}

void ZeroJoin::require_no_scaler() const {
  GRADSYNC_CHECK(!inside_join_ || optimizer_.pending_gradient_unscale() == 1.0, "ZeroOptimizer under dist::Join ",
                 "with a GradScaler is not supported: a skipped step would leave the joined ranks waiting for it");
}

void ZeroJoin::before_statistics() {
  if (!announces()) return;
  require_no_scaler();
  control(kStatistics, optimizer_.pending_gradient_unscale(), 1.0);
}

void ZeroJoin::before_step() {
  if (!announces()) return;
  require_no_scaler();
  control(kStep, optimizer_.pending_gradient_unscale(), optimizer_.pending_gradient_clip());
}

void ZeroJoin::before_gather(std::size_t unit) {
  if (announces()) control(kGather, static_cast<double>(unit), 0);  // the unit rides in the unscale slot
}

// ---- The control word --------------------------------------------------------------------------

ZeroJoin::Control ZeroJoin::control(double kind, double unscale, double clip) {
  const comm::OperationLabel label(control_label());
  Tensor words = control_words(kind, unscale, clip);
  comm_.allreduce_host(words, comm::ReduceOp::max);
  if (crosses_groups(words)) replicas_->allreduce_host(words, comm::ReduceOp::max);
  return parse_control(words);
}

// Under HSDP, every word but a gather goes across the groups as well (join.h). The same
// decision on every rank of every group: a group's word is the same on its ranks, and a gather
// word is only ever this group's.
bool ZeroJoin::crosses_groups(const Tensor& words) const {
  return replicas_ != nullptr && words.data_as<double>()[0] != kGather;
}

// The shadow thread's control(0, 0, 0): its allreduces polled (every 100 us: the gather it
// announces waits for this rank's answer), so that a Join left abnormally (an exception on this
// rank) does not wait for the communicator's timeout.
ZeroJoin::Control ZeroJoin::shadow_control() {
  const comm::OperationLabel label(control_label());
  shadow_words_ = control_words(0, 0, 0);
  comm::WorkHandle work = comm_.allreduce_async(shadow_words_, comm::ReduceOp::max);
  wait_polled(work);
  if (crosses_groups(shadow_words_)) {
    work = replicas_->allreduce_async(shadow_words_, comm::ReduceOp::max);
    wait_polled(work);
  }
  return parse_control(shadow_words_);
}

void ZeroJoin::wait_polled(comm::WorkHandle& work) {
  while (!work->is_completed()) {
    if (shadow_stop_.load()) {
      detail::throw_error("ZeroOptimizer: the Join was left before every rank joined (the shadow thread stopped)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  work->wait();  // its error, if it failed
}

Tensor ZeroJoin::control_words(double kind, double unscale, double clip) const {
  std::vector<double> words{kind, unscale, clip};
  for (std::size_t g = 0; g < optimizer_.group_count(); ++g) words.push_back(kind == 0 ? 0.0 : optimizer_.lr(g));
  return Tensor::from_vector(words, {static_cast<std::int64_t>(words.size())});
}

ZeroJoin::Control ZeroJoin::parse_control(const Tensor& words) {
  const std::vector<double> v = words.to_double_vector();
  return {v[0], v[1], v[2], std::vector<double>(v.begin() + 3, v.end())};
}

// A joined rank's part in the active ranks' statistics (kStatistics: its pieces' sums, through
// ZeroShards' combine) or step (kStep: its pieces stepped with their factors and learning rates).
void ZeroJoin::follow(const Control& word) {
  if (word.unscale != 1.0) optimizer_.defer_gradient_unscale(word.unscale);
  if (word.kind == kStatistics) {
    (void)optimizer_.gradient_statistics();
    return;
  }
  if (word.clip != 1.0) optimizer_.defer_gradient_clip(word.clip);
  for (std::size_t g = 0; g < word.lrs.size(); ++g) optimizer_.set_lr(g, word.lrs[g]);
  optimizer_.step();
}

// ---- The joined rank's side ---------------------------------------------------------------------

void ZeroJoin::opened(const JoinOptions* options) {
  if (options == nullptr) end_shadow_thread(/*stop=*/true);  // left early (an error): no more waiting
  GRADSYNC_CHECK(options == nullptr || stage_ < 3 || !options->throw_on_early_termination,
                 "ZeroOptimizer: stage 3 under dist::Join with throw_on_early_termination is not supported (the ",
                 "joined rank's shadow thread would wait for gathers that never come)");
  GRADSYNC_CHECK(options == nullptr || ddp_ != nullptr, "ZeroOptimizer: only a ZeroOptimizer over a DataParallel ",
                 "joins (the DistributedOptimizer's zero_stage does not combine with join)");
  inside_join_ = options != nullptr;
}

void ZeroJoin::begin_shadowing(ZeroUnits* units) {
  if (stage_ != 3 || shadow_thread_.joinable()) return;
  shadowing_ = true;  // the gathers, statistics and steps below announce nothing
  shadow_steps_done_ = shadow_syncs_ = 0;
  shadow_over_ = false;
  shadow_stop_ = false;
  shadow_error_ = nullptr;
  shadow_thread_ = std::thread([this, units] { serve_shadow(*units); });
}

// Stages 1 and 2: a joined rank's part in one optimizer step of the others (the join loop runs
// it after every synchronized step that an optimizer step follows). Stage 3: the shadow thread
// takes that step; this rank's thread lets it, and waits.
void ZeroJoin::shadow_step(const JoinStep& step, ZeroShards& shards) {
  if (!step.synchronized || !step.optimizer_step_follows) return;
  if (stage_ == 3) return wait_for_shadow_step();
  shadowing_ = true;
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{shadowing_};
  for (;;) {
    const Control word = control(0, 0, 0);
    if (word.kind == kStatistics) {
      follow(word);
    } else if (word.kind == kStep) {
      follow(word);
      shards.launch_all();
      shards.wait_all();
      return;
    } else {
      detail::throw_error("ZeroOptimizer: a joined rank expected the others' optimizer step, got control word ", word.kind);
    }
  }
}

void ZeroJoin::serve_shadow(ZeroUnits& units) {
  try {
    for (;;) {
      const Control word = shadow_control();
      if (word.kind == 0) break;  // every rank has joined
      if (word.kind == kGather) {
        const auto u = static_cast<std::size_t>(word.unscale);
        GRADSYNC_CHECK(u < units.count(), "ZeroOptimizer: a joined rank was asked to gather unit ", u, " of ", units.count());
        units.give_pieces(u);
      } else if (word.kind == kStatistics || word.kind == kStep) {
        {
          // The rank's own thread may still be finishing the synchronization this step follows
          // (writing the reduced pieces that the statistics and the step read): wait for it.
          std::unique_lock<std::mutex> lock(shadow_mutex_);
          shadow_changed_.wait(lock, [&] { return shadow_syncs_ > shadow_steps_done_ || shadow_stop_.load(); });
          if (shadow_stop_.load()) detail::throw_error("ZeroOptimizer: the Join was left before every rank joined");
        }
        follow(word);
        if (word.kind == kStep) {
          const std::lock_guard<std::mutex> lock(shadow_mutex_);
          ++shadow_steps_done_;
          shadow_changed_.notify_all();
        }
      } else {
        detail::throw_error("ZeroOptimizer: a joined rank expected a gather, statistics or a step, got control word ",
                            word.kind);
      }
    }
  } catch (...) {
    const std::lock_guard<std::mutex> lock(shadow_mutex_);
    shadow_error_ = std::current_exception();
  }
  const std::lock_guard<std::mutex> lock(shadow_mutex_);
  shadow_over_ = true;
  shadow_changed_.notify_all();
}

// The rank's own thread, after a synchronization the active ranks step after: lets the shadow
// thread take that step's statistics and step (they read the gradients the synchronization
// wrote), and waits until it has (bounded: its collectives have the communicator's timeout).
void ZeroJoin::wait_for_shadow_step() {
  std::unique_lock<std::mutex> lock(shadow_mutex_);
  ++shadow_syncs_;  // this synchronization is shadowed: the shadow thread may read its gradients
  shadow_changed_.notify_all();
  shadow_changed_.wait(lock, [&] { return shadow_steps_done_ >= shadow_syncs_ || shadow_over_; });
  if (shadow_error_) std::rethrow_exception(shadow_error_);
  GRADSYNC_CHECK(shadow_steps_done_ >= shadow_syncs_, "ZeroOptimizer: the active ranks synchronized a step ",
                 "and sent no optimizer step for the joined ranks (ZeRO-3 under dist::Join steps after every ",
                 "synchronized step)");
}

void ZeroJoin::end_shadow_thread(bool stop) {
  if (!shadow_thread_.joinable()) return;
  {
    const std::lock_guard<std::mutex> lock(shadow_mutex_);
    shadow_stop_ = stop;
    shadow_changed_.notify_all();
  }
  shadow_thread_.join();
  shadowing_ = false;
}

// Every rank has joined. Its pieces are current on every rank: nothing to copy. Stage 3: every
// rank's shadow thread ends with the control word of all zeros.
void ZeroJoin::finish() {
  end_shadow_thread(/*stop=*/false);
  if (shadow_error_) std::rethrow_exception(std::exchange(shadow_error_, nullptr));
}

}  // namespace gradsync::dist
