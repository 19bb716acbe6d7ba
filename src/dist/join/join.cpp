// Uneven inputs (gradsync/dist/join/join.h): the join loop every front end shares, and PyTorch's Join.
#include "gradsync/dist/join/join.h"

#include <string>

#include "gradsync/core/timeline.h"
#include "gradsync/dist/replicas/replicas.h"
#include "gradsync/optim/optimizer.h"
#include "loop.h"

namespace gradsync::dist {

namespace {

// A failure during a shadow step, with what a joined rank was doing: most often the active
// ranks issued a collective of their own, which has no partner here.
[[noreturn]] void rethrow_from_shadow_step(const std::exception& error) {
  throw Error(std::string("while this rank was joined (out of inputs) and shadowing the others' synchronized steps: ") +
              error.what() +
              "\n(a collective the active ranks issue outside their synchronized steps, such as a GradScaler with a "
              "communicator or a metrics allreduce, has no partner on a joined rank: see docs/join.md)");
}

}  // namespace

int run_join_loop(const std::vector<Joinable*>& participants, bool throw_on_early_termination) {
  GRADSYNC_CHECK(!participants.empty(), "Join: no participant to shadow");
  for (const Joinable* participant : participants) participant->require_joinable();
  for (Joinable* participant : participants) participant->begin_shadowing();
  const int rank = participants.front()->join_rank();
  int last_joiner = rank;
  for (bool first = true;; first = false) {
    JoinStep step{.first = first};
    bool everyone_joined = false;
    for (Joinable* participant : participants) {
      const bool synchronized_before = step.synchronized;
      try {
        participant->shadow_step(step);
      } catch (const std::exception& error) {
        rethrow_from_shadow_step(error);
      }
      if (synchronized_before || !step.synchronized) continue;
      // The status of this step has been read: nothing more to shadow once everybody is out.
      if (step.joined == step.world) {
        everyone_joined = true;
        break;
      }
      if (throw_on_early_termination) throw JoinEarlyTermination("Rank " + std::to_string(rank) + " exhausted all inputs.");
    }
    GRADSYNC_CHECK(step.synchronized, "Join: none of its participants synchronizes (a Join needs the DataParallel or ",
                   "DistributedOptimizer whose steps carry the status, first)");
    if (everyone_joined) {
      last_joiner = step.last_joiner;
      break;
    }
  }
  for (Joinable* participant : participants) participant->finish_join(last_joiner);
  return last_joiner;
}

Join::Join(std::vector<Joinable*> participants, JoinOptions options, optim::Optimizer* optimizer)
    : participants_(std::move(participants)), options_(options), optimizer_(optimizer),
      uncaught_(std::uncaught_exceptions()) {
  GRADSYNC_CHECK(!participants_.empty(), "Join: no participant");
  for (const Joinable* participant : participants_) GRADSYNC_CHECK(participant != nullptr, "Join: a null participant");
  if (!options_.enable) return;
  std::size_t opened = 0;
  try {
    for (; opened < participants_.size(); ++opened) participants_[opened]->join_opened(&options_);
  } catch (...) {
    while (opened > 0) participants_[--opened]->join_opened(nullptr);
    throw;
  }
  inside_ = true;
}

Join::~Join() noexcept(false) {
  if (!options_.enable || joined_) return;
  if (std::uncaught_exceptions() > uncaught_) {  // unwinding: leave, communicating nothing
    leave();
    return;
  }
  join();
}

void Join::leave() {
  if (!inside_) return;
  inside_ = false;
  for (Joinable* participant : participants_) participant->join_opened(nullptr);
}

int Join::join() {
  GRADSYNC_CHECK(!joined_, "Join::join called twice");
  joined_ = true;
  Joinable& front = *participants_.front();
  if (!options_.enable) return front.join_rank();
  struct Leave {  // the Join ends when join() does, also when it throws
    Join& join;
    ~Leave() { join.leave(); }
  } leave{*this};
  if (front.join_world_size() == 1) return 0;
  timeline::Span span("join", "join (shadowing)");
  const int last_joiner = run_join_loop(participants_, options_.throw_on_early_termination);
  // The last joiner's optimizer state everywhere. A sharded optimizer (ZeRO) kept stepping its
  // pieces on the joined ranks: nothing to copy.
  if (optimizer_ != nullptr && !optimizer_->sharded()) {
    GRADSYNC_CHECK(front.join_world_size() == front.join_communicator().size(), "Join: under HSDP the optimizer ",
                   "is a ZeroOptimizer, whose pieces step on the joined ranks too (nothing to broadcast); got another");
    broadcast_optimizer_state(*optimizer_, front.join_communicator(), last_joiner);
  }
  return last_joiner;
}

}  // namespace gradsync::dist
