// digits_ddp: an MLP learns to read handwritten digits (UCI, 1,797 8x8 images), data-parallel
// through DataParallel, the DDP way.
//
// What it demonstrates, in the order a step runs:
//   1. comm::connect picks the backend from the launch (mpirun -> MPI, torchrun-style
//      variables -> Gloo, --device cuda with GPUs -> NCCL), or --backend names it
//      (prepare_training in common/, with the data, the batch arithmetic and the MLP).
//   2. nn::prepare_ddp_module wraps the model when there is more than one rank (Composer's
//      rule); the wrapper checks that every rank holds the same parameters and broadcasts rank
//      0's weights.
//   3. Each rank reads its slice of every global batch (common/: epoch_order, by global sample
//      index, so that a run resumed on another number of ranks reads on where it stopped). A
//      global batch of --batch samples is --batch/W per rank, cut into --microbatches microbatches; the loss gradient of each is scaled so that
//      the accumulated gradient is the mean over the rank's samples, and DDP's average over
//      ranks makes it the mean over the global batch.
//   4. Each microbatch runs inside nn::SyncContext with the chosen strategy (single, multi,
//      forced, auto): the backward signals each layer's gradients, last layer first, and the
//      buckets reduce while earlier layers still compute.
//   5. With --uneven each rank has a different number of batches per epoch: the epoch runs
//      inside dist::Join, and a rank out of batches shadows the others' synchronized steps
//      until every rank is out (PyTorch's Join; --divide-by-active: the average over the
//      ranks still active instead of the world size).
//   6. One optimizer step per global batch, ended the same way for every precision
//      (Training::finish_step): with --precision fp16 the loss gradient was multiplied by the
//      loss scale and the step is skipped when a gradient overflowed; with --clip-norm the
//      synchronized gradients are clipped to that global norm first. Each epoch prints the loss,
//      the held-out accuracy, samples/s and the elapsed time (run_training in common/).
//
//   With --zero 3 the parameters are sharded too (dist/zero.h): each Linear is a unit, which
//   nn::ShardedSequential gathers before the layer's forward and backward and releases after
//   them, since there is no autograd for gradsync to hook.
//
//   mpirun -np 2 build/examples/digits_ddp                    (scripts/run.sh does this)
//   scripts/launch.sh 4 build/examples/digits_ddp --backend gloo --microbatches 2 --sync-strategy forced
//   build/examples/digits_ddp --help
#include <cstdio>
#include <optional>

#include "common/replica_groups.h"
#include "common/slow_links.h"
#include "common/trainer_support.h"
#include "gradsync/comm/connect.h"
#include "gradsync/dist/horovod/distributed_optimizer.h"
#include "gradsync/dist/join/join.h"
#include "gradsync/dist/hooks/powersgd.h"
#include "gradsync/dist/zero/zero.h"
#include "gradsync/nn/data_parallel_module.h"
#include "gradsync/io/safetensors.h"
#include "gradsync/nn/loss.h"
#include "gradsync/nn/sharded_sequential.h"
#include "gradsync/optim/clip.h"

using namespace gradsync;

namespace {

// PowerSGD's state for a checkpoint (every rank calls it: the error feedback is gathered).
std::vector<io::NamedTensor> powersgd_tensors(const dist::PowerSGDState& state, comm::Communicator& comm) {
  std::vector<io::NamedTensor> tensors;
  for (const auto& [key, tensor] : state.state_dict()) {
    if (key.rfind("error.", 0) == 0) {
      Tensor all = Tensor::empty({comm.size(), tensor.numel()}, tensor.dtype());
      comm.allgather_host(tensor, all);
      tensors.push_back({"powersgd." + key, all});
    } else {
      tensors.push_back({"powersgd." + key, tensor});
    }
  }
  return tensors;
}

// The state back from a checkpoint, this rank's row of each error feedback; a checkpoint from a
// run without PowerSGD leaves the state fresh.
void load_powersgd(dist::PowerSGDState& state, const io::SafetensorsReader& file, const comm::Communicator& comm) {
  std::map<std::string, Tensor> saved;
  for (const io::TensorInfo& info : file.tensors()) {
    const std::string& name = info.name;
    if (name.rfind("powersgd.", 0) != 0) continue;
    const std::string key = name.substr(9);
    Tensor tensor = file.read(name);
    if (key.rfind("error.", 0) == 0) {
      GRADSYNC_CHECK(tensor.shape().size() == 2 && tensor.shape()[0] == comm.size(), file.path().string(), ": ", name,
                     " holds the error feedback of ", tensor.shape().empty() ? 0 : tensor.shape()[0],
                     " ranks; this run has ", comm.size(), " (PowerSGD's state resumes on the same number of ranks)");
      tensor = tensor.view(static_cast<std::size_t>(comm.rank() * tensor.shape()[1]), {tensor.shape()[1]}).clone();
    }
    saved[key] = tensor;
  }
  if (!saved.empty()) state.load_state_dict(saved);
}

}  // namespace

int main(int argc, char** argv) try {
  examples::line_buffered_progress();
  examples::Flags flags(argc, argv);
  if (flags.flag("--help")) {
    std::printf("digits_ddp flags:\n  --microbatches 1   --sync-strategy single|multi|forced|auto   --find-unused   "
                "--bucket-cap-mb MB (DDP's bucket_cap_mb)\n  --divide-by-active (with --uneven: Join's divide_by_initial_world_size off)\n"
                "  --zero 0|1|2|3 (ZeRO: 1 shards the optimizer state over the ranks, 2 the gradients too, 3 the parameters too)\n"
                "  --powersgd-rank R (PowerSGD compression of rank R; 0: off)   --powersgd-start N (plain steps first: 10)\n%s\n%s\n%s\n",
                examples::kCommonHelp, examples::kSlowLinkHelp, examples::kRestartHelp);
    std::printf("%s\n", examples::kReplicaGroupHelp);
    return 0;
  }
  const examples::TrainerOptions options = examples::parse_trainer_options(flags, "--microbatches");
  const bool find_unused = flags.flag("--find-unused");
  const double bucket_cap_mb = flags.number("--bucket-cap-mb", 0.0);  // 0: Composer's default (DDP's buckets)
  const dist::DDPSyncStrategy strategy = examples::sync_strategy_from(flags.text("--sync-strategy", ""), find_unused);
  const bool divide_by_active = flags.flag("--divide-by-active");
  const int zero_stage = static_cast<int>(flags.integer("--zero", 0));
  const int powersgd_rank = static_cast<int>(flags.count("--powersgd-rank", 0, 0));
  const std::int64_t powersgd_start = flags.integer("--powersgd-start", 10);
  const examples::SlowLinkOptions slow_options = examples::parse_slow_link_options(flags);
  const examples::ReplicaGroupOptions replica_options = examples::parse_replica_group_options(flags);
  flags.finish();
  GRADSYNC_CHECK(!replica_options.enabled() ||
                     (powersgd_rank == 0 && !slow_options.enabled() && !options.uneven && options.save.empty()),
                 "--replica-groups runs without --powersgd-rank, --local-sgd / --diloco, --uneven and --save (the ",
                 "groups' checkpoints go to --checkpoint-dir, written by one group; docs/fault_tolerance.md)");
  GRADSYNC_CHECK(!slow_options.enabled() || (zero_stage == 0 && powersgd_rank == 0 && !options.uneven &&
                                             !options.check_replicas && options.restarts.checkpoint_every == 0 &&
                                             options.resume.empty()),
                 "--local-sgd / --diloco run without --zero, --powersgd-rank, --uneven, --check-replicas and ",
                 "checkpoints in digits_ddp (the replicas differ between synchronizations)");
  GRADSYNC_CHECK(zero_stage >= 0 && zero_stage <= 3, "--zero ", zero_stage, ": expected 0, 1, 2 or 3");
  GRADSYNC_CHECK(zero_stage == 0 || !options.uneven || options.precision != "fp16", "--zero with --uneven does not ",
                 "combine with --precision fp16: a step the loss scaler skips would leave the joined ranks waiting for it ",
                 "(docs/zero.md)");

  // 1-2. The run, and the model made data-parallel.
  auto training = examples::prepare_training(
      options, "digits_ddp",
      {std::string("--find-unused ") + (find_unused ? "on" : "off"), examples::number_setting("--bucket-cap-mb", bucket_cap_mb),
       std::string("--sync-strategy ") + dist::sync_strategy_name(strategy),
       std::string("--divide-by-active ") + (divide_by_active ? "on" : "off"), "--zero " + std::to_string(zero_stage),
       "--powersgd-rank " + std::to_string(powersgd_rank), "--powersgd-start " + std::to_string(powersgd_start)});
  // Slow links: LocalSGD or DiLoCo across the ranks (or across --inner-group groups).
  examples::require_same_settings(*training->comm, examples::slow_link_settings(slow_options), "digits_ddp");
  std::optional<examples::SlowLinks> slow;
  if (slow_options.enabled() && training->comm->size() > 1) slow.emplace(slow_options, training->registry, *training->comm);
  std::optional<double> cap;
  if (bucket_cap_mb > 0) cap = bucket_cap_mb;
  const bool sharded_parameters = zero_stage == 3 && training->comm->size() > 1;
  std::shared_ptr<nn::ShardedSequential> sharded_layers;
  std::shared_ptr<nn::Module> model;
  if (sharded_parameters) {  // one unit per Linear, one bucket per unit
    sharded_layers = std::make_shared<nn::ShardedSequential>(training->model);
    dist::DataParallelOptions ddp_options{.find_unused_parameters = find_unused, .shard_gradients = true};
    ddp_options.units = sharded_layers->units();
    model = std::make_shared<nn::DistributedDataParallel>(sharded_layers, *training->comm, ddp_options);
  } else if (slow) {  // its gradients averaged inside a group, or over the world in the warm-up only
    model = std::make_shared<nn::DistributedDataParallel>(
        training->model, slow->inner(), dist::DataParallelOptions{.bucket_cap_mb = cap, .find_unused_parameters = find_unused});
  } else if ((cap || zero_stage > 0) && training->comm->size() > 1) {
    model = std::make_shared<nn::DistributedDataParallel>(
        training->model, *training->comm,
        dist::DataParallelOptions{.bucket_cap_mb = cap, .find_unused_parameters = find_unused,
                                  .shard_gradients = zero_stage >= 2});
  } else {
    model = nn::prepare_ddp_module(training->model, *training->comm, find_unused);
  }
  // DataParallel checks the model across ranks; the optimizer is ours to check (a rank started
  // with another --optimizer or --lr would otherwise train apart silently).
  dist::require_same_optimizer(*training->optimizer, *training->comm, "digits_ddp");
  // ZeRO: this rank keeps the optimizer state of its pieces of each bucket only (one rank:
  // nothing to shard).
  auto* ddp = dynamic_cast<nn::DistributedDataParallel*>(model.get());  // null with one rank
  std::unique_ptr<dist::ZeroOptimizer> zero;
  if (zero_stage > 0 && ddp) {
    // A --resume checkpoint was loaded whole into the optimizer: sharding keeps this rank's pieces.
    zero = std::make_unique<dist::ZeroOptimizer>(*training->optimizer, ddp->data_parallel(),
                                                 dist::ZeroOptions{.stage = zero_stage});
    if (sharded_layers) {
      sharded_layers->attach(*zero);
      training->evaluation_model = sharded_layers.get();
      // Saving (and --check-replicas) reads every value: every unit gathered first; the next
      // step releases them.
      training->gather_model = [&] { sharded_layers->gather_all(); };
    }
    // --save writes the consolidated state: the same file an unsharded run writes and loads.
    training->optimizer_checkpoint = [&] {
      dist::ZeroOptimizer::State state = zero->consolidated_state();
      return examples::OptimizerCheckpoint{std::move(state.tensors), std::move(state.metadata)};
    };
  }
  // PowerSGD: each bucket's matrices cross the wire as two thin factors (dist/powersgd.h).
  std::shared_ptr<dist::PowerSGDState> powersgd;
  if (powersgd_rank > 0 && ddp) {
    powersgd = std::make_shared<dist::PowerSGDState>(dist::PowerSGDOptions{
        .matrix_approximation_rank = powersgd_rank, .start_powerSGD_iter = powersgd_start, .random_seed = 0});
    ddp->data_parallel().register_comm_hook(dist::powersgd_hook(powersgd));
    // Its state rides in the checkpoint: the counters, P, Q and the generator as they are (the
    // same on every rank), each rank's error feedback gathered into one [ranks, n] tensor.
    if (!training->resumed_from.empty()) {
      load_powersgd(*powersgd, io::SafetensorsReader(training->resumed_from), *training->comm);
    }
    auto base = training->optimizer_checkpoint;
    training->optimizer_checkpoint = [&training, powersgd, base] {
      examples::OptimizerCheckpoint checkpoint =
          base ? base()
               : examples::OptimizerCheckpoint{training->optimizer->state_tensors(), training->optimizer->state_metadata()};
      for (io::NamedTensor& tensor : powersgd_tensors(*powersgd, *training->comm)) checkpoint.tensors.push_back(std::move(tensor));
      return checkpoint;
    };
  }
  if (training->comm->rank() == 0 && !options.quiet) {
    std::printf("digits_ddp: %d rank(s) on %s (%s), %zu train / %zu held-out samples, %s in %s, global batch %lld = %d x "
                "%lld microbatch(es) of %lld, sync %s\n",
                training->comm->size(), training->comm->backend(), training->device.str().c_str(),
                training->split.train.size(), training->split.heldout.size(), options.optimizer.c_str(),
                options.precision.c_str(),
                static_cast<long long>(training->local_batch * training->comm->size()), training->comm->size(),
                static_cast<long long>(options.passes),
                static_cast<long long>(training->micro), dist::sync_strategy_name(strategy));
    if (slow) std::printf("slow links: %s\n", slow->describe().c_str());
    if (zero) {
      std::int64_t owned = 0;
      for (std::size_t arena = 0; arena < training->registry.arenas().size(); ++arena) {
        owned += training->optimizer->state_elements(arena);
      }
      std::printf("ZeRO stage %d: rank 0 keeps optimizer state for %lld of %lld parameter elements\n", zero_stage,
                  static_cast<long long>(owned), static_cast<long long>(training->registry.total_numel()));
    }
  }

  // Across replica groups: the quorum, the commit, the recovery of a newcomer.
  std::optional<examples::ReplicaGroupRun> replicas;
  if (replica_options.enabled()) replicas.emplace(replica_options, *training, options, zero.get());

  // 3, 4, 6. One step: the microbatches, each in the strategy's context, then the optimizer.
  const auto step = [&](const std::vector<std::int64_t>& order, std::int64_t first_row) {
    double step_loss = 0;
    std::optional<dist::DataParallel::NoSync> local_only;  // slow links: this step's gradients stay local
    if (slow && !slow->synchronizes_gradients()) local_only.emplace(ddp->data_parallel());
    for (std::int64_t mb = 0; mb < options.passes; ++mb) {
      nn::SyncContext sync(*model, mb + 1 == options.passes, strategy);
      const std::int64_t begin = first_row + mb * training->micro;
      const examples::Batch batch = examples::gather(training->data, order, begin, begin + training->micro, training->device);
      const nn::LossResult loss = nn::softmax_cross_entropy(
          model->forward(batch.images), batch.labels, training->loss_scale() / static_cast<double>(training->local_batch));
      model->backward(loss.grad);  // signals each gradient; synchronized backwards reduce as they go
      sync.close();                // FORCED reduces everything here, after the last microbatch
      step_loss += loss.loss / static_cast<double>(options.passes);
    }
    // The backward has synchronized the gradients: every rank clips the same ones alike.
    // With ZeRO, clipping sums the ranks' pieces and the step updates this rank's pieces, then
    // gathers every parameter.
    training->finish_step(
        options,
        [&](double max_norm) {
          return zero ? zero->clip_grad_norm(max_norm) : optim::clip_grad_norm(*training->optimizer, max_norm);
        },
        [&] {
          if (replicas) replicas->maybe_die("gather");
          zero ? zero->step() : training->optimizer->step();
        },
        // Fault tolerance: the gradients averaged across the replica groups, and the rest of the
        // step (unscale, clip, step) only when the coordinator commits it, on that average.
        replicas ? std::function<bool()>([&] { return replicas->commit(); }) : std::function<bool()>());
    training->optimizer->zero_grad();
    if (slow) slow->step();
    return step_loss;
  };
  // 5. Uneven inputs: each epoch inside a Join; the optimizer's state is made equal too.
  std::optional<dist::Join> join;
  const examples::UnevenInputs uneven{
      .enter = [&] {
        if (!ddp) return;
        // A ZeroOptimizer joins with its DataParallel: a joined rank keeps stepping its pieces.
        std::vector<dist::Joinable*> participants{&ddp->data_parallel()};
        if (zero) participants.push_back(zero.get());
        join.emplace(participants, dist::JoinOptions{.divide_by_initial_world_size = !divide_by_active},
                     training->optimizer.get());
      },
      .join = [&] {
        const int last = join ? join->join() : 0;
        join.reset();
        return last;
      }};
  const int status = replicas ? replicas->run("digits_ddp", step)
                              : examples::run_training(*training, options, "digits_ddp", step, uneven);
  if (powersgd && training->comm->rank() == 0 && !options.quiet) {
    std::printf("PowerSGD rank %d from step %lld: in its steps %lld gradient elements went to collectives for %lld (%.1fx fewer)\n",
                powersgd_rank, static_cast<long long>(powersgd_start),
                static_cast<long long>(powersgd->numel_after_compression()),
                static_cast<long long>(powersgd->numel_before_compression()),
                static_cast<double>(powersgd->numel_before_compression()) /
                    static_cast<double>(std::max<std::int64_t>(powersgd->numel_after_compression(), 1)));
  }
  return status;
} catch (const std::exception& error) {
  return comm::report_fatal_error("digits_ddp", error);
}
