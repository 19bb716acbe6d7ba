// ZeroOptimizer (gradsync/dist/zero/zero.h): the optimizer sharded over a Reducer's buckets
// (DataParallel's, or the DistributedOptimizer's with zero_stage). A front end over three rooms,
// each with its contract in its header:
//   shards.h  ownership and the sharded step (who owns what, statistics, the gathers)
//   units.h   stage 3's units (gather, prefetch, release, the staging pool)
//   join.h    ZeRO under dist::Join (the control words, the shadow step and thread)
// They talk through StepPhases (shards.h): the shards and the units announce each collective
// phase of a step, and ZeroJoin decides whether joined ranks must hear of it. This file holds the
// policy: which stage needs what, and in which order a step's parts run.
#include "gradsync/dist/zero/zero.h"

#include "gradsync/comm/agreement.h"
#include "gradsync/optim/clip.h"
#include "checkpoint.h"
#include "join.h"
#include "model.h"
#include "pieces.h"
#include "shards.h"
#include "units.h"

namespace gradsync::dist {

namespace {

// What each stage needs of the Reducer and its front end, checked before anything is built.
ZeroOptions checked(const ZeroOptions& options, const optim::Optimizer& optimizer, const Reducer& reducer,
                    const DataParallel* ddp) {
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
  return options;
}

}  // namespace

struct ZeroOptimizer::Impl {
  optim::Optimizer& optimizer;
  const Reducer& reducer;  // whose buckets are sharded
  ZeroOptions options;
  // The parameter gathers run on their own communicator: launched after the step, they may
  // still travel while the next backward's buckets go out on the Reducer's.
  std::unique_ptr<comm::Communicator> own_comm;
  comm::Communicator& comm;
  ZeroJoin join;
  ZeroShards shards;
  std::unique_ptr<ZeroUnits> units;  // stage 3

  Impl(optim::Optimizer& optimizer_, const Reducer& reducer_, comm::Communicator& base, DataParallel* ddp,
       const ZeroOptions& options_)
      : optimizer(optimizer_), reducer(reducer_), options(checked(options_, optimizer_, reducer_, ddp)),
        own_comm(base.size() > 1 ? base.duplicate() : nullptr), comm(own_comm ? *own_comm : base),
        join(optimizer, comm, ddp, options.stage), shards(optimizer, reducer, comm, options.stage, join) {
    if (options.stage == 3) {
      units = std::make_unique<ZeroUnits>(shards, reducer, ddp->options().units, options.auto_prefetch, join, comm.rank());
    }
    if (ddp != nullptr) ddp_replicas = ddp->options().replicas;
  }

  // Under HSDP every shard group holds the same pieces: group 0 writes a checkpoint, and every
  // group learns how it went (one agreement across the groups), so a failure is an error on
  // every rank and the other groups never write the same files at once.
  void by_group_zero(const std::string& what, const std::function<void()>& write) const {
    comm::Communicator* replicas = ddp_replicas;
    if (replicas == nullptr || replicas->size() == 1) return write();
    std::string failure;
    if (replicas->rank() == 0) {
      try {
        write();
      } catch (const std::exception& error) {
        failure = error.what();
      }
    }
    comm::agree(*replicas, what, failure);
  }
  comm::Communicator* ddp_replicas = nullptr;  // DataParallelOptions::replicas (HSDP), or null

  // HSDP: every group made its pieces alone; they must be the same in every group.
  void check_replicas(const std::string& who) const {
    if (ddp_replicas != nullptr && ddp_replicas->size() > 1) {
      zero_model::require_same_pieces(optimizer.registry(), *ddp_replicas, shards.layout(), who);
    }
  }

  ZeroUnits& stage3(const char* what) const {
    GRADSYNC_CHECK(units != nullptr, "ZeroOptimizer::", what, ": stage ", options.stage, " has no units (stage 3 does)");
    return *units;
  }
};

ZeroOptimizer::ZeroOptimizer(optim::Optimizer& optimizer, DataParallel& ddp, ZeroOptions options)
    : impl_(std::make_unique<Impl>(optimizer, ddp.reducer(), ddp.communicator(), &ddp, options)) {}

ZeroOptimizer::ZeroOptimizer(optim::Optimizer& optimizer, const Reducer& reducer, comm::Communicator& comm,
                             ZeroOptions options)
    : impl_(std::make_unique<Impl>(optimizer, reducer, comm, nullptr, options)) {}

ZeroOptimizer::~ZeroOptimizer() {
  impl_->join.end_shadow_thread(/*stop=*/true);  // before the rooms it uses go
  impl_->shards.drain();
}

void ZeroOptimizer::step_async() {
  if (impl_->units) {
    // The gathered units' other pieces are about to go stale: every unit back to its pieces,
    // the owned pieces stepped, nothing gathered (the next use gathers). Joined ranks step
    // their pieces with us (their shadow threads).
    impl_->join.before_step();
    impl_->units->release_all();
    impl_->optimizer.step();
    impl_->units->end_step();
    return;
  }
  impl_->shards.wait_all();
  impl_->join.before_step();  // joined ranks step their pieces with us (ZeroJoin::shadow_step)
  impl_->optimizer.step();
  impl_->shards.launch_all();
}

void ZeroOptimizer::step() {
  step_async();
  impl_->shards.wait_all();
}

void ZeroOptimizer::wait_for(const Parameter& parameter) {
  const std::size_t bucket = impl_->reducer.bucket_of(parameter);
  if (impl_->units) return impl_->units->finish(impl_->units->unit_of_bucket(bucket));
  impl_->shards.wait(bucket);
}

void ZeroOptimizer::wait_all() { impl_->shards.wait_all(); }
void ZeroOptimizer::zero_grad(bool set_to_undefined) { impl_->shards.zero_grad(set_to_undefined); }

double ZeroOptimizer::clip_grad_norm(double max_norm, double norm_type, bool error_if_nonfinite) {
  return optim::clip_grad_norm(impl_->optimizer, max_norm, norm_type, error_if_nonfinite);
}

std::size_t ZeroOptimizer::unit_count() const { return impl_->units ? impl_->units->count() : 0; }
std::size_t ZeroOptimizer::unit_of(const Parameter& parameter) const {
  return impl_->stage3("unit_of").unit_of_bucket(impl_->reducer.bucket_of(parameter));
}
void ZeroOptimizer::gather(std::size_t unit) { impl_->stage3("gather").gather(unit); }
void ZeroOptimizer::prefetch(std::size_t unit) { impl_->stage3("prefetch").prefetch(unit); }
void ZeroOptimizer::release(std::size_t unit) { impl_->stage3("release").release(unit); }
bool ZeroOptimizer::gathered(std::size_t unit) const { return impl_->stage3("gathered").gathered(unit); }

optim::Optimizer& ZeroOptimizer::optimizer() const { return impl_->optimizer; }
int ZeroOptimizer::stage() const { return impl_->options.stage; }
const std::vector<std::vector<optim::Optimizer::ElementRange>>& ZeroOptimizer::shard_ranges() const {
  return impl_->shards.layout().ranges;
}
std::int64_t ZeroOptimizer::state_bytes() const { return impl_->optimizer.state_bytes(); }

// ---- The model piece by piece (model.cpp), once the gathers have landed ----------------------

void ZeroOptimizer::initialize(const std::function<init::Rule(const Parameter&)>& rule_of, std::uint64_t seed) {
  impl_->shards.wait_all();
  if (impl_->units) impl_->units->release_all();  // a gathered unit's other pieces would be stale
  zero_model::initialize(impl_->optimizer.registry(), impl_->comm, impl_->shards.layout(), rule_of, seed);
  impl_->check_replicas("ZeroOptimizer::initialize");
}

void ZeroOptimizer::load_model(const std::filesystem::path& model) {
  impl_->shards.wait_all();
  if (impl_->units) impl_->units->release_all();
  zero_model::load(impl_->optimizer.registry(), impl_->comm, impl_->shards.layout(), model);
  impl_->check_replicas("ZeroOptimizer::load_model");
}

void ZeroOptimizer::save_model(const std::filesystem::path& path, const io::Metadata& metadata) {
  impl_->shards.wait_all();
  impl_->by_group_zero("ZeroOptimizer::save_model (HSDP: shard group 0 writes)", [&] {
    zero_model::save(impl_->optimizer.registry(), impl_->comm, impl_->shards.layout(), path, metadata);
  });
}

std::uint64_t ZeroOptimizer::model_checksum() {
  impl_->shards.wait_all();
  return zero_model::checksum(impl_->optimizer.registry(), impl_->comm, impl_->shards.layout());
}

// ---- Checkpoints (checkpoint.cpp), once the gathers have landed -----------------------------

ZeroOptimizer::State ZeroOptimizer::consolidated_state() {
  impl_->shards.wait_all();
  return dist::consolidated_state(impl_->optimizer, impl_->comm, impl_->shards.layout());
}

void ZeroOptimizer::save_consolidated(const std::filesystem::path& path) {
  impl_->shards.wait_all();
  impl_->by_group_zero("ZeroOptimizer::save_consolidated (HSDP: shard group 0 writes)", [&] {
    dist::save_consolidated(impl_->optimizer, impl_->comm, impl_->shards.layout(), path);
  });
}

void ZeroOptimizer::save_sharded(const std::filesystem::path& folder) {
  impl_->shards.wait_all();
  impl_->by_group_zero("ZeroOptimizer::save_sharded (HSDP: shard group 0 writes)", [&] {
    dist::save_sharded(impl_->optimizer, impl_->comm, impl_->shards.layout(), folder);
  });
}

void ZeroOptimizer::load_sharded(const std::filesystem::path& folder, bool reshard) {
  impl_->shards.wait_all();
  // Stage 3: the set holds this rank's pieces of the values; a gathered unit's other pieces
  // would be stale after them.
  if (impl_->units) impl_->units->release_all();
  dist::load_sharded(impl_->optimizer, impl_->comm, impl_->shards.layout(), folder, reshard);
}

ZeroOptimizer::State ZeroOptimizer::own_pieces() {
  impl_->shards.wait_all();
  return dist::own_pieces(impl_->optimizer, impl_->shards.layout());
}

void ZeroOptimizer::adopt_pieces(const State& pieces, const std::string& origin) {
  impl_->shards.wait_all();
  if (impl_->units) impl_->units->release_all();  // a gathered unit's other pieces would be stale
  // Every rank's pieces checked before any rank changes anything.
  CheckedPieces checked;
  comm::agree(impl_->comm, "ZeroOptimizer::adopt_pieces from " + origin,
              [&] { checked = check_pieces(impl_->optimizer, impl_->shards.layout(), pieces, origin); });
  dist::adopt_pieces(impl_->optimizer, checked, origin);
  if (impl_->units) return;
  impl_->shards.launch_all();  // the values whole again: every rank's new pieces gathered
  impl_->shards.wait_all();
}

void ZeroOptimizer::load_state(const std::filesystem::path& path) {
  impl_->shards.wait_all();
  impl_->optimizer.load_state(path);
}

// ---- Joinable (join.h): a joined rank steps its pieces with the others and gives its
// pieces to their gathers ----------------------------------------------------------------------

void ZeroOptimizer::join_opened(const JoinOptions* options) { impl_->join.opened(options); }
void ZeroOptimizer::begin_shadowing() { impl_->join.begin_shadowing(impl_->units.get()); }
void ZeroOptimizer::shadow_step(JoinStep& step) { impl_->join.shadow_step(step, impl_->shards); }
void ZeroOptimizer::finish_join(int) { impl_->join.finish(); }
comm::Communicator& ZeroOptimizer::join_communicator() const { return impl_->comm; }

}  // namespace gradsync::dist
