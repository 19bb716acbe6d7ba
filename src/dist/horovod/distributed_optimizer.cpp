// The DistributedOptimizer (gradsync/dist/horovod/distributed_optimizer.h).
#include "gradsync/dist/horovod/distributed_optimizer.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include "gradsync/dist/horovod/adasum.h"
#include "gradsync/dist/hooks/powersgd.h"
#include "gradsync/dist/replicas/replicas.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/optim/clip.h"
#include "arguments.h"
#include "dist/join/loop.h"
#include "sparse_gradients.h"
#include "dist/reducer/step_status.h"

namespace gradsync::dist {

struct DistributedOptimizer::Impl {
  optim::Optimizer& optimizer;
  comm::Communicator& comm;
  DistributedOptimizerOptions options;

  std::vector<Parameter*> parameters;  // the wrapped ones, in registry order
  std::map<const Parameter*, std::string> name_of;
  std::set<const Parameter*> sparse;  // declared sparse and not sent as dense
  std::vector<Parameter*> sparse_in_order;  // the same, in registry order
  SparseGradients sparse_rows;
  std::map<const Parameter*, int> delay;
  std::set<const Parameter*> seen;  // had a backward pass since the last synchronization
  std::vector<std::vector<Parameter*>> groups;
  std::unique_ptr<Reducer> reducer;
  std::unique_ptr<ZeroOptimizer> zero;
  ParameterRegistry::Subscription subscription;
  bool distributed = false;
  bool adasum = false;
  bool synchronized = false;
  bool clipped = false;  // clip_grad_norm synchronized this window's gradients: step() must not again
  bool should_synchronize = true;
  bool warned = false;
  int next_passes = 0;  // set_backward_passes_per_step mid-window: applies from the next window
  std::string broken;   // the failure that ended distributed steps; local calls stay allowed

  Impl(optim::Optimizer& optimizer_, comm::Communicator& comm_, DistributedOptimizerOptions options_)
      : optimizer(optimizer_), comm(comm_), options(std::move(options_)) {}

  void validate_and_build() {
    // Horovod's factory checks, in its order.
    GRADSYNC_CHECK(options.gradient_predivide_factor == 1.0 || options.op == Op::average,
                   "gradient_predivide_factor not supported with op != Average (op is ", op_name(options.op), ")");
    GRADSYNC_CHECK(options.gradient_predivide_factor > 0.0, "gradient_predivide_factor must be positive, got ",
                   options.gradient_predivide_factor);
    GRADSYNC_CHECK(options.backward_passes_per_step > 0, "backward_passes_per_step must be > 0");

    // The wrapped parameters, in registry order: the order every rank shares.
    for (std::size_t g = 0; g < optimizer.group_count(); ++g) {
      for (Parameter* parameter : optimizer.group_parameters(g)) parameters.push_back(parameter);
    }
    std::sort(parameters.begin(), parameters.end(),
              [](const Parameter* a, const Parameter* b) { return a->index() < b->index(); });
    if (options.op == Op::adasum) {
      for (const Parameter* parameter : parameters) {
        GRADSYNC_CHECK(parameter->dtype() != DType::f16 && parameter->dtype() != DType::bf16,
                       "Adasum with f32 master weights is not supported: parameter '", parameter->name(), "' is ",
                       dtype_name(parameter->dtype()), ", and Adasum combines the deltas of a local step in the "
                       "model's values, which the optimizer's f32 master copy would not see. Use op Average or Sum "
                       "for mixed precision");
      }
    }
    name_of = name_parameters(parameters, options.named_parameters);
    for (Parameter* parameter : options.sparse_parameters) {
      GRADSYNC_CHECK(parameter != nullptr && name_of.count(parameter), "sparse_parameters: ",
                     parameter ? "'" + parameter->name() + "'" : std::string("a null pointer"),
                     " is not a parameter of the wrapped optimizer");
      if (!options.sparse_as_dense) sparse.insert(parameter);
    }
    for (Parameter* parameter : parameters) {
      if (sparse.count(parameter)) sparse_in_order.push_back(parameter);
    }
    for (const Parameter* parameter : parameters) delay[parameter] = options.backward_passes_per_step;
    groups = form_groups(parameters, options.groups, name_of);

    distributed = comm.size() > 1 || options.reduce_with_one_rank;
    if (!distributed) return;  // Horovod: with one process nothing is hooked

    std::vector<const Parameter*> all(parameters.begin(), parameters.end());
    std::vector<std::string> names;
    for (const Parameter* parameter : parameters) names.push_back(name_of[parameter]);
    require_same_parameters(comm, all, names, "DistributedOptimizer");
    require_same_optimizer(optimizer, comm, "DistributedOptimizer");
    std::vector<std::string> settings{
        std::string("op ") + op_name(options.op), std::string("compression ") + compression_name(options.compression),
        "backward_passes_per_step " + std::to_string(options.backward_passes_per_step),
        "gradient_predivide_factor " + std::to_string(options.gradient_predivide_factor),
        "fusion_threshold_bytes " + std::to_string(options.fusion_threshold_bytes),
        "zero_stage " + std::to_string(options.zero_stage),
        std::string("reduce_with_one_rank ") + (options.reduce_with_one_rank ? "true" : "false"),
        std::string("sparse_as_dense ") + (options.sparse_as_dense ? "true" : "false")};
    if (options.powersgd) {
      const PowerSGDOptions& powersgd = options.powersgd->options();
      settings.push_back("powersgd rank " + std::to_string(powersgd.matrix_approximation_rank) + " start " +
                         std::to_string(powersgd.start_powerSGD_iter) + " seed " + std::to_string(powersgd.random_seed));
    } else {
      settings.push_back("powersgd off");
    }
    require_same_lines(comm, settings, "DistributedOptimizer", "options");

    adasum = options.op == Op::adasum;
    GRADSYNC_CHECK(options.zero_stage != 3, "zero_stage 3 is DataParallel's (DataParallelOptions::units with ",
                   "ZeroOptions{.stage = 3}): parameters sharded need an engine that gathers each unit around its use, ",
                   "and the DistributedOptimizer sees only gradients");
    GRADSYNC_CHECK(options.zero_stage >= 0 && options.zero_stage <= 2, "zero_stage ", options.zero_stage,
                   ": expected 0, 1 or 2");
    if (options.zero_stage > 0) {
      GRADSYNC_CHECK(!adasum, "zero_stage does not combine with op Adasum: Adasum takes a local step of every "
                              "parameter, which a sharded optimizer does not hold");
      GRADSYNC_CHECK(sparse.empty(), "zero_stage does not combine with sparse parameters ('", (*sparse.begin())->name(),
                     "'): their rows are allgathered, not bucketed, so no rank would own them; set sparse_as_dense");
    }
    if (options.powersgd) {
      GRADSYNC_CHECK(options.op == Op::average && options.gradient_predivide_factor == 1.0,
                     "powersgd: only with op Average and gradient_predivide_factor 1 (the hook averages), got op ",
                     op_name(options.op), ", factor ", options.gradient_predivide_factor);
      GRADSYNC_CHECK(options.compression == Compression::none,
                     "powersgd: no compression with it (P and Q are the compression)");
      GRADSYNC_CHECK(options.zero_stage < 2, "powersgd: zero_stage 2 reduce-scatters its buckets, which no hook does");
    }
    if (adasum) {
      GRADSYNC_CHECK((comm.size() & (comm.size() - 1)) == 0,
                     "Running Adasum with non-power of 2 ranks is not supported yet (this world has ", comm.size(),
                     " ranks)");
    }

    // Bucket order: reverse registration order, the order a backward pass produces gradients
    // in (the last layer's first), so the first bucket can launch while earlier layers are
    // still computing. Adasum reduces dense deltas of every parameter, sparse ones included.
    std::vector<Parameter*> dense;
    for (auto it = parameters.rbegin(); it != parameters.rend(); ++it) {
      if (adasum || !sparse.count(*it)) dense.push_back(*it);
    }
    std::vector<std::vector<Parameter*>> dense_groups;
    for (const auto& group : groups) {
      std::vector<Parameter*> members;
      for (Parameter* member : group) {
        if (!sparse.count(member)) members.push_back(member);
      }
      if (members.size() > 1) dense_groups.push_back(members);
    }
    if (!dense.empty()) {
      ReducerOptions reducer_options;
      reducer_options.bucket_limits = {std::max<std::size_t>(options.fusion_threshold_bytes, 1)};
      reducer_options.rule = BucketRule::fusion;
      reducer_options.compression = options.compression;
      reducer_options.reduce_scatter = options.zero_stage == 2;
      reducer_options.max_buckets_in_flight = options.zero_stage == 2 ? 2 : 0;  // as DataParallel's shard_gradients
      reducer_options.op = comm_op(options.op);
      if (options.powersgd) {
        reducer_options.hook = powersgd_hook(options.powersgd);  // it averages: no pre- or postscale
      } else if (options.op == Op::average) {
        // Horovod: prescale 1/f, postscale f/N; the mean, divided before the sum by f.
        reducer_options.prescale = 1.0 / options.gradient_predivide_factor;
        reducer_options.postscale = options.gradient_predivide_factor / comm.size();
      }
      if (adasum) reducer_options.hook = adasum_hook();
      reducer_options.user = "a DistributedOptimizer";
      reducer = std::make_unique<Reducer>(optimizer.registry(), comm, dense, adasum ? std::vector<std::vector<Parameter*>>{}
                                                                                    : dense_groups,
                                          reducer_options);
    }
    if (options.zero_stage > 0 && reducer) {
      zero = std::make_unique<ZeroOptimizer>(optimizer, *reducer, comm, ZeroOptions{.stage = options.zero_stage});
    }
    subscription = optimizer.registry().on_ready([this](Parameter& parameter) { on_ready(parameter); });
  }

  // The registry's readiness signal: one backward pass produced this gradient.
  void on_ready(Parameter& parameter) {
    if (!name_of.count(&parameter)) return;  // not ours (another optimizer's)
    GRADSYNC_CHECK(!sparse.count(&parameter), "parameter '", name_of[&parameter],
                   "' is declared sparse: give its gradient with set_sparse_grad()");
    count_pass(parameter);
  }

  void count_pass(Parameter& parameter) {
    int& remaining = delay[&parameter];
    GRADSYNC_CHECK(!(seen.count(&parameter) && remaining <= 0),
                   "Gradients were computed more than backward_passes_per_step times before call to step(). "
                   "Increase backward_passes_per_step to accumulate gradients locally. If a GradScaler skipped "
                   "the last step, call synchronize() before scaler.step() and step inside skip_synchronize() "
                   "(optim/grad_scaler.h). (parameter '",
                   name_of[&parameter], "', backward_passes_per_step ", options.backward_passes_per_step, ")");
    --remaining;
    seen.insert(&parameter);
    if (remaining == 0 && !adasum && reducer && reducer->contains(parameter)) reducer->ready(parameter);
  }

  bool pending() const { return !seen.empty() || (reducer && !reducer->broken() && reducer->round_started()); }

  void reset_counters() {
    if (next_passes > 0) options.backward_passes_per_step = std::exchange(next_passes, 0);
    for (auto& [parameter, remaining] : delay) remaining = options.backward_passes_per_step;
    seen.clear();
  }

  void require_usable(const char* what) const {
    GRADSYNC_CHECK(broken.empty(), "DistributedOptimizer::", what, ": an earlier failure ended distributed steps ",
                   "(zero_grad and load_state still work; reconnect to go on). The failure was: ", broken);
  }

  // Runs one distributed action; a failure leaves nothing pending (the Reducer has waited for
  // its buckets, the counters start a new window, sparse rows are dropped) and is remembered.
  template <typename Action>
  void guarded(const char* what, Action&& action) {
    require_usable(what);
    try {
      action();
    } catch (const std::exception& error) {
      broken = error.what();
      reset_counters();
      sparse_rows.clear();
      throw;
    }
  }

  void synchronize() {
    guarded("synchronize", [&] { synchronize_unguarded(); });
  }

  // One synchronization: the buckets, the status allreduce with one word per rank (who has
  // joined, dist/reducer/step_status.h), the sparse allgathers, the waits. `join_flags` are this rank's
  // flags when it is a shadow synchronization (join()).
  Census synchronize_unguarded(int join_flags = 0) {
    if (!distributed || adasum) {
      if (!distributed) sparse_rows.densify_locally(parameters);
      synchronized = true;
      return {};
    }
    if (reducer) reducer->finish();
    StepStatus status(/*parameters=*/0, comm);
    status.set_flags(join_flags);
    status.exchange(comm, [&] {
      sparse_rows.reduce(comm, sparse_in_order, options.compression, options.op == Op::average);
      if (reducer) reducer->wait();
    });
    reset_counters();
    synchronized = true;
    return status.census();
  }

  // gradsync/dist/join/join.h's Joinable, for hvd.join(): what cannot be shadowed, and one shadow step.
  void require_joinable() const {
    GRADSYNC_CHECK(!zero, "join is not supported with zero_stage: a joined rank would have to keep stepping its pieces; "
                          "use DataParallel with dist::Join and ZeroOptimizer, which does");
    GRADSYNC_CHECK(!adasum, "join is not supported with Adasum: its reduction happens inside a local optimizer step, "
                            "which a rank without data cannot take");
    GRADSYNC_CHECK(!(reducer && reducer->round_started()),
                   "join() with this backward's reductions already launched: call step() or synchronize() first");
  }

  void shadow_step(JoinStep& step) {
    // Zeros: a partial accumulation window (or anything left in the buffers) must not reach the
    // others' average.
    reset_counters();
    sparse_rows.clear();
    for (Parameter* parameter : parameters) parameter->zero_grad(/*set_to_undefined=*/true);
    const Census census = synchronize_unguarded(step.first ? kJoined | kJoinedThisStep : kJoined);
    step.synchronized = true;
    step.joined = census.joined;
    step.world = comm.size();
    step.last_joiner = census.last_joiner;
  }

  void finish_join() {
    for (Parameter* parameter : parameters) parameter->zero_grad(/*set_to_undefined=*/true);
    synchronized = false;
  }

  // Horovod's Adasum optimizer: a local step, then the Adasum of every rank's delta, added to
  // the starting point. The gradient buffers carry the deltas through the Reducer (so the
  // bucketing and the per-tensor rule are the Reducer's); afterwards they hold the reduced delta.
  void adasum_step() {
    sparse_rows.densify_locally(parameters);
    std::vector<Tensor> start;
    for (Parameter* parameter : parameters) start.push_back(parameter->value().clone());
    optimizer.step();
    for (std::size_t i = 0; i < parameters.size(); ++i) {
      Tensor& delta = parameters[i]->grad_for_overwrite();
      delta.copy_from(parameters[i]->value());
      ops::axpy(-1.0, start[i], delta);
    }
    if (reducer) reducer->synchronize();
    for (std::size_t i = 0; i < parameters.size(); ++i) {
      Tensor& value = parameters[i]->value();
      value.copy_from(start[i]);
      ops::axpy(1.0, parameters[i]->grad(), value);
    }
    reset_counters();
  }
};

DistributedOptimizer::DistributedOptimizer(optim::Optimizer& optimizer, comm::Communicator& comm,
                                           DistributedOptimizerOptions options)
    : impl_(std::make_unique<Impl>(optimizer, comm, std::move(options))) {
  impl_->validate_and_build();
}

DistributedOptimizer::~DistributedOptimizer() = default;

void DistributedOptimizer::synchronize() { impl_->synchronize(); }
int DistributedOptimizer::join() {
  impl_->require_joinable();
  if (!impl_->distributed) return 0;
  int last_joiner = impl_->comm.rank();
  impl_->guarded("join", [&] { last_joiner = run_join_loop({this}, /*throw_on_early_termination=*/false); });
  return last_joiner;
}

void DistributedOptimizer::join_opened(const JoinOptions*) {}  // hvd.join: the active ranks need no Join
void DistributedOptimizer::require_joinable() const { impl_->require_joinable(); }
void DistributedOptimizer::shadow_step(JoinStep& step) { impl_->shadow_step(step); }
void DistributedOptimizer::finish_join(int) { impl_->finish_join(); }
comm::Communicator& DistributedOptimizer::join_communicator() const { return impl_->comm; }

void DistributedOptimizer::step() {
  if (!impl_->distributed) {
    impl_->sparse_rows.densify_locally(impl_->parameters);
    impl_->reset_counters();
    impl_->optimizer.step();
    return;
  }
  if (impl_->adasum) return impl_->guarded("step", [&] { impl_->adasum_step(); });
  impl_->require_usable("step");
  if (impl_->should_synchronize && !impl_->clipped) {
    if (impl_->synchronized && !impl_->warned) {
      impl_->warned = true;
      warn("optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize(). "
           "This can cause training slowdown. You may want to consider using optimizer.skip_synchronize() context "
           "if you use optimizer.synchronize() in your code.");
    }
    impl_->synchronize();
  }
  impl_->synchronized = false;
  impl_->clipped = false;
  impl_->zero ? impl_->zero->step() : impl_->optimizer.step();  // ZeRO: this rank's pieces, then the gathers
}

double DistributedOptimizer::clip_grad_norm(double max_norm, double norm_type, bool error_if_nonfinite) {
  if (!impl_->distributed) {
    impl_->sparse_rows.densify_locally(impl_->parameters);
  } else if (!impl_->adasum) {
    synchronize();
    impl_->clipped = true;
  }
  return optim::clip_grad_norm(impl_->optimizer, max_norm, norm_type, error_if_nonfinite);
}

void DistributedOptimizer::zero_grad(bool set_to_undefined) {
  GRADSYNC_CHECK(!impl_->pending(),
                 "optimizer.zero_grad() was called after the backward pass but before optimizer.step() or "
                 "optimizer.synchronize(). This is prohibited as it can cause a race condition.");
  impl_->optimizer.zero_grad(set_to_undefined);
  impl_->sparse_rows.clear();
  impl_->clipped = false;
}

DistributedOptimizer::SkipSynchronize::SkipSynchronize(DistributedOptimizer& optimizer)
    : optimizer_(optimizer), previous_(optimizer.impl_->should_synchronize) {
  GRADSYNC_CHECK(!optimizer.impl_->adasum, "Skipping synchronization is not supported when using Adasum optimizer.");
  optimizer.impl_->should_synchronize = false;
}

DistributedOptimizer::SkipSynchronize::~SkipSynchronize() { optimizer_.impl_->should_synchronize = previous_; }

void DistributedOptimizer::set_backward_passes_per_step(int passes) {
  GRADSYNC_CHECK(passes > 0, "backward_passes_per_step must be > 0");
  if (impl_->pending()) {
    // Mid-window some gradients may already be with the Reducer: resetting their counters
    // would hand them over twice. The new count starts with the next window.
    impl_->next_passes = passes;
    return;
  }
  impl_->options.backward_passes_per_step = passes;
  for (auto& [parameter, remaining] : impl_->delay) remaining = passes;
}

int DistributedOptimizer::backward_passes_per_step() const {
  return impl_->next_passes > 0 ? impl_->next_passes : impl_->options.backward_passes_per_step;
}

void DistributedOptimizer::set_sparse_grad(Parameter& parameter, const Tensor& indices, const Tensor& rows) {
  GRADSYNC_CHECK(impl_->name_of.count(&parameter), "set_sparse_grad: '", parameter.name(),
                 "' is not a parameter of the wrapped optimizer");
  const bool declared = std::find(impl_->options.sparse_parameters.begin(), impl_->options.sparse_parameters.end(),
                                  &parameter) != impl_->options.sparse_parameters.end();
  GRADSYNC_CHECK(declared, "set_sparse_grad: '", parameter.name(),
                 "' was not declared in sparse_parameters (every rank must know which gradients are sparse)");
  SparseGradients::validate(parameter, indices, rows);
  if (impl_->options.sparse_as_dense) {
    // Densified into the gradient (adding to what earlier passes left), it is a dense gradient
    // like any other.
    SparseGradients::add_into_gradient(parameter, indices, rows);
    impl_->optimizer.registry().mark_ready(parameter);
    return;
  }
  impl_->sparse_rows.accumulate(parameter, indices, rows);
  if (impl_->distributed) impl_->count_pass(parameter);
}

void DistributedOptimizer::load_state(const std::filesystem::path& path) {
  GRADSYNC_CHECK(!impl_->pending(), "load_state while gradients are being reduced: call step() or synchronize() first");
  impl_->optimizer.load_state(path);
  impl_->reset_counters();
  impl_->synchronized = false;
  impl_->should_synchronize = true;
}

optim::Optimizer& DistributedOptimizer::optimizer() const { return impl_->optimizer; }
const ZeroOptimizer* DistributedOptimizer::zero() const { return impl_->zero.get(); }
const Reducer* DistributedOptimizer::reducer() const { return impl_->reducer.get(); }

std::vector<std::vector<std::string>> DistributedOptimizer::group_names() const {
  std::vector<std::vector<std::string>> names;
  for (const auto& group : impl_->groups) {
    names.emplace_back();
    for (const Parameter* member : group) names.back().push_back(impl_->name_of.at(member));
  }
  return names;
}

}  // namespace gradsync::dist
