// The digits trainers' model and training run (trainer_support.h).
#include "trainer_support.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <tuple>

#include "gradsync/core/timeline.h"
#include "gradsync/io/registry_checkpoint.h"
#include "gradsync/nn/loss.h"
#include "gradsync/optim/adam.h"
#include "gradsync/optim/sgd.h"

namespace gradsync::examples {

std::shared_ptr<nn::Sequential> make_mlp(ParameterRegistry& registry, std::int64_t features, std::int64_t hidden,
                                         std::int64_t classes, Device device, std::uint64_t seed, DType dtype) {
  auto model = std::make_shared<nn::Sequential>(registry);
  model->add<nn::Linear>("fc1", features, hidden, dtype, device);
  model->add<nn::ReLU>();
  model->add<nn::Linear>("fc2", hidden, classes, dtype, device);
  model->initialize(seed);
  return model;
}

std::unique_ptr<optim::Optimizer> make_optimizer(const std::string& name, ParameterRegistry& registry, double lr,
                                                 double momentum, optim::MasterWeights master_weights) {
  if (name == "sgd") {
    return std::make_unique<optim::SGD>(registry,
                                        optim::SGD::Options{.lr = lr, .momentum = momentum, .dampening = 0.0,
                                                            .weight_decay = 0.0, .nesterov = false, .maximize = false},
                                        master_weights);
  }
  const optim::Adam::Options adam{.lr = lr, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0,
                                  .amsgrad = false, .maximize = false};
  if (name == "adam") return std::make_unique<optim::Adam>(registry, adam, master_weights);
  if (name == "adamw") {
    optim::Adam::Options decoupled = adam;
    decoupled.weight_decay = 0.01;
    return std::make_unique<optim::AdamW>(registry, decoupled, master_weights);
  }
  detail::throw_error("unknown optimizer '", name, "': expected sgd, adam or adamw");
}

double evaluate(nn::Module& model, const Dataset& data, const std::vector<std::int64_t>& rows, Device device) {
  if (rows.empty()) return 0.0;
  std::int64_t correct = 0;
  for (std::size_t begin = 0; begin < rows.size(); begin += 512) {
    const std::size_t end = std::min(rows.size(), begin + 512);
    Batch batch = gather(data, rows, static_cast<std::int64_t>(begin), static_cast<std::int64_t>(end), device);
    correct += nn::count_correct(model.forward(batch.images), batch.labels);
  }
  return static_cast<double>(correct) / static_cast<double>(rows.size());
}

const char* const kCommonHelp = R"(  --backend auto|mpi|gloo|nccl   --device cpu|cuda   --optimizer sgd|adam|adamw   --lr (0.05 sgd, else 0.003)
  --precision f32|bf16|fp16 (16-bit weights, f32 master weights; fp16 adds loss scaling)   --clip-norm C (0: off)
  --timeline PATH (a Chrome trace per rank: PATH with .rank<R> before the extension; or GRADSYNC_TIMELINE)
  --momentum 0.9   --epochs 20   --batch 64 (global)   --hidden 64   --seed 1
  --data FILE (images f32 [N, D], labels i64 [N]; default: the digits)   --input-scale S (digits: 1/16)
  --holdout 0.2   --no-shuffle   --init WEIGHTS.safetensors   --save CKPT.safetensors   --resume CKPT.safetensors
  --max-steps N   --metrics FILE.jsonl   --min-accuracy A   --check-replicas   --quiet
  --stragglers N (every N steps: the rank the others waited for, from the flight records)   --delay-rank R:MS
  --uneven (rank r of W trains on (2W - r) / 2W of its shard per epoch, then joins: uneven inputs))";

TrainerOptions parse_trainer_options(Flags& flags, const std::string& passes_flag) {
  TrainerOptions o;
  o.backend = flags.text("--backend", "auto");
  const std::string device_text = flags.text("--device", "cpu");
  o.device = Device::parse(device_text);
  o.device_is_any_gpu = device_text == "cuda";
  o.passes = flags.count(passes_flag, 1);
  GRADSYNC_CHECK(o.passes > 0, passes_flag, " must be positive");
  o.optimizer = flags.text("--optimizer", "sgd");
  o.lr = flags.number("--lr", o.optimizer == "sgd" ? 0.05 : 0.003);
  o.momentum = flags.number("--momentum", 0.9);
  o.epochs = static_cast<int>(flags.count("--epochs", 20));
  o.batch = flags.count("--batch", 64);
  o.batch_given = flags.given("--batch");
  GRADSYNC_CHECK(o.batch > 0, "--batch ", o.batch, " must be positive");
  o.hidden = flags.count("--hidden", 64);
  o.seed = static_cast<std::uint64_t>(flags.integer("--seed", 1));
  o.data = flags.text("--data", default_data_path());
  o.input_scale = flags.number("--input-scale", o.data == default_data_path() ? 1.0 / 16 : 1.0);
  o.holdout = flags.number("--holdout", 0.2);
  o.shuffle = !flags.flag("--no-shuffle");
  o.init = flags.text("--init", "");
  o.save = flags.text("--save", "");
  o.resume = flags.text("--resume", "");
  o.max_steps = flags.integer("--max-steps", -1);
  o.metrics = flags.text("--metrics", "");
  o.stragglers = flags.count("--stragglers", 0, 0);
  GRADSYNC_CHECK(o.stragglers >= 0, "--stragglers ", o.stragglers, " must not be negative");
  if (const auto delay = flags.rank_and_number("--delay-rank", "MILLISECONDS")) {
    std::tie(o.delay_rank, o.delay_ms) = std::pair<int, int>(delay->first, static_cast<int>(delay->second));
  }
  o.min_accuracy = flags.number("--min-accuracy", -1);
  o.check_replicas = flags.flag("--check-replicas");
  o.quiet = flags.flag("--quiet");
  o.uneven = flags.flag("--uneven");
  GRADSYNC_CHECK(!(o.uneven && o.max_steps >= 0), "--uneven does not combine with --max-steps: ranks with different ",
                 "numbers of steps would stop in different epochs (use --epochs)");
  GRADSYNC_CHECK(!(o.uneven && o.stragglers > 0), "--uneven does not combine with --stragglers: its summary is a ",
                 "collective every N steps, and ranks with uneven inputs take different numbers of steps");
  o.restarts = parse_restart_options(flags);
  GRADSYNC_CHECK(!(o.uneven && o.restarts.checkpoint_every > 0), "--uneven does not combine with --checkpoint-every: ranks with ",
                 "uneven inputs reach a step count at different times (checkpoints are written at the end of each run)");
  o.precision = flags.text("--precision", "f32");
  GRADSYNC_CHECK(o.precision == "f32" || o.precision == "bf16" || o.precision == "fp16", "--precision ", o.precision,
                 ": expected f32, bf16 or fp16");
  o.clip_norm = flags.number("--clip-norm", 0.0);
  o.timeline = flags.text("--timeline", "");
  GRADSYNC_CHECK(o.clip_norm >= 0.0, "--clip-norm ", o.clip_norm, " must not be negative");
  return o;
}

std::unique_ptr<Training> prepare_training(const TrainerOptions& options, const std::string& trainer,
                                           const std::vector<std::string>& settings) {
  auto t = std::make_unique<Training>();
  Ranks ranks = connect_ranks(options.backend, options.device, options.device_is_any_gpu);
  t->comm = std::move(ranks.comm);
  t->device = ranks.device;
  // What every rank must run alike, compared before the data or the model are touched.
  std::vector<std::string> all{
      "--batch " + std::to_string(options.batch) + (options.batch_given ? "" : " (the default)"),
      "passes per step " + std::to_string(options.passes),
      file_setting("--data", options.data),
      number_setting("--input-scale", options.input_scale),
      number_setting("--holdout", options.holdout),
      "--hidden " + std::to_string(options.hidden),
      "--precision " + options.precision,
      "--optimizer " + options.optimizer,
      number_setting("--lr", options.lr),
      number_setting("--momentum", options.momentum),
      number_setting("--clip-norm", options.clip_norm),
      "--seed " + std::to_string(options.seed),
      std::string("--no-shuffle ") + (options.shuffle ? "off" : "on"),
      "--epochs " + std::to_string(options.epochs),
      "--max-steps " + std::to_string(options.max_steps),
      std::string("--uneven ") + (options.uneven ? "on" : "off"),
      "--stragglers " + std::to_string(options.stragglers),
      "--checkpoint-every " + std::to_string(options.restarts.checkpoint_every),
      file_setting("--init", options.init),
  };
  all.insert(all.end(), settings.begin(), settings.end());
  require_same_settings(*t->comm, all, trainer);
  if (!options.timeline.empty()) timeline::start(options.timeline, t->comm->rank());
  const int world = t->comm->size();
  t->data = load_dataset(options.data, options.input_scale);
  t->split = split_dataset(t->data, options.holdout, options.seed, options.shuffle);
  // The checkpoint to resume from: --resume, else the latest of --checkpoint-dir (restarts).
  const std::string resume = resume_point(options.restarts, options.resume);
  // The global batch is split evenly over ranks and passes. A resumed run keeps the one it was
  // trained with, whatever the number of ranks now (it must split evenly over them); a --batch
  // that does not split is an error; the default is rounded down to one that does, saying so,
  // so that the trainers run on any number of ranks as they are.
  const std::int64_t unit = world * options.passes;
  const std::int64_t resumed_batch = resume.empty() ? 0 : checkpoint_global_batch(resume);
  GRADSYNC_CHECK(resumed_batch == 0 || !options.batch_given || options.batch == resumed_batch, "--batch ", options.batch,
                 ": ", resume, " was trained with a global batch of ", resumed_batch, ", which a resumed run keeps");
  GRADSYNC_CHECK(resumed_batch == 0 || resumed_batch % unit == 0, resume, " was trained with a global batch of ",
                 resumed_batch, ", which does not split evenly into ", world, " ranks x ", options.passes,
                 " passes: resume on a number of ranks that divides it");
  GRADSYNC_CHECK(options.batch % unit == 0 || !options.batch_given, "--batch ", options.batch, " must divide into ",
                 world, " ranks x ", options.passes, " passes");
  const std::int64_t batch = resumed_batch > 0 ? resumed_batch : std::max(unit, options.batch / unit * unit);
  if (batch != options.batch && resumed_batch == 0 && t->comm->rank() == 0 && !options.quiet) {
    std::printf("note: the default global batch %lld is %lld here (%d ranks x %lld passes x %lld); --batch sets it\n",
                static_cast<long long>(options.batch), static_cast<long long>(batch), world,
                static_cast<long long>(options.passes), static_cast<long long>(batch / unit));
  }
  t->local_batch = batch / world;
  t->micro = t->local_batch / options.passes;
  t->steps_per_epoch = static_cast<std::int64_t>(t->split.train.size()) / world / t->local_batch;
  GRADSYNC_CHECK(t->steps_per_epoch > 0, "a global batch of ", batch, " is larger than the training set (",
                 t->split.train.size(), " samples)");
  // Mixed precision: 16-bit weights and gradients (what is stored and communicated), f32 master
  // weights in the optimizer; fp16's narrow exponent range also needs loss scaling.
  const DType dtype = options.precision == "bf16" ? DType::bf16 : options.precision == "fp16" ? DType::f16 : DType::f32;
  t->model = make_mlp(t->registry, t->data.features, options.hidden, t->data.classes, t->device, options.seed, dtype);
  t->optimizer = make_optimizer(options.optimizer, t->registry, options.lr, options.momentum,
                                dtype == DType::f32 ? optim::MasterWeights::none : optim::MasterWeights::f32);
  // The scaler's agreement allreduce is a collective of its own, which a joined rank does not
  // shadow (docs/join.md); the reduced gradients it checks are bit-identical on every rank, so
  // with --uneven each rank decides alone, alike.
  if (dtype == DType::f16) {
    t->scaler = std::make_unique<optim::GradScaler>(optim::GradScalerOptions{}, options.uneven ? nullptr : t->comm.get());
  }
  // --init may be an f32 file for a 16-bit model: the model gets the rounded values, the master
  // weights the exact ones.
  if (!options.init.empty()) {
    io::load_registry(t->registry, options.init, {.convert_dtypes = true});
    t->optimizer->load_master_weights(io::SafetensorsReader(options.init));
  }
  if (!resume.empty()) {
    if (t->comm->rank() == 0 && !options.quiet) std::printf("resuming from %s\n", resume.c_str());
    t->progress = load_checkpoint(resume, t->registry, *t->optimizer, t->scaler.get());
    t->resumed_from = resume;
  }
  t->progress.global_batch = batch;
  return t;
}

double Training::loss_scale() const { return scaler ? scaler->scale() : 1.0; }

void Training::finish_step(const TrainerOptions& options, const std::function<double(double)>& clip,
                           const std::function<void()>& step, const std::function<bool()>& commit) {
  if (commit && !commit()) return;
  if (scaler) scaler->unscale(*optimizer);  // deferred: clipping sees the unscaled gradients
  last_grad_norm = options.clip_norm > 0 ? clip(options.clip_norm) : std::numeric_limits<double>::quiet_NaN();
  if (scaler) {
    scaler->step(*optimizer, step);  // skipped, on every rank, when a gradient overflowed
    scaler->update();
  } else {
    step();
  }
}

namespace {

// What a checkpoint holds for the optimizer: the trainer's own (ZeRO's consolidated state, a
// collective), else the optimizer's state.
OptimizerCheckpoint optimizer_checkpoint_of(Training& t) {
  if (t.optimizer_checkpoint) return t.optimizer_checkpoint();
  return OptimizerCheckpoint{t.optimizer->state_tensors(), t.optimizer->state_metadata()};
}

}  // namespace

void Training::checkpoint(const RestartOptions& restarts) {
  if (gather_model) gather_model();
  examples::checkpoint_into_folder(restarts, *comm, registry, optimizer_checkpoint_of(*this), progress, scaler.get());
}

std::int64_t steps_this_epoch(const TrainerOptions& options, std::int64_t steps_per_epoch, int rank, int world) {
  if (!options.uneven) return steps_per_epoch;
  return std::max<std::int64_t>(1, steps_per_epoch * (2 * world - rank) / (2 * world));
}

int run_training(Training& t, const TrainerOptions& options, const std::string& name,
                 const std::function<double(const std::vector<std::int64_t>&, std::int64_t)>& step,
                 const UnevenInputs& uneven) {
  using Clock = std::chrono::steady_clock;
  comm::Communicator& comm = *t.comm;
  const int rank = comm.rank();
  Metrics metrics(options.metrics, rank == 0);
  comm::StragglerMonitor stragglers(comm);
  const auto start = Clock::now();
  bool stopped = false;
  nn::Module& evaluated = t.evaluation_model != nullptr ? *t.evaluation_model : *t.model;
  double accuracy = evaluate(evaluated, t.data, t.split.heldout, t.device);
  for (int epoch = t.progress.epoch; epoch < options.epochs && !stopped; ++epoch) {
    const auto epoch_start = Clock::now();
    const std::vector<std::int64_t> order =
        epoch_order(t.split.train, options.seed, epoch, rank, comm.size(), t.local_batch, options.shuffle);
    double loss_sum = 0;
    std::int64_t samples = 0;
    GRADSYNC_CHECK(!options.uneven || (uneven.join && t.progress.step_in_epoch == 0), name,
                   ": --uneven needs a trainer that joins, and a checkpoint saved at the end of an epoch");
    if (options.uneven && uneven.enter) uneven.enter();
    const std::int64_t my_steps = steps_this_epoch(options, t.steps_per_epoch, rank, comm.size());
    for (std::int64_t s = t.progress.step_in_epoch; s < my_steps; ++s) {
      if (rank == options.delay_rank) std::this_thread::sleep_for(std::chrono::milliseconds(options.delay_ms));
      const double loss = step(order, s * t.local_batch);
      loss_sum += loss * static_cast<double>(t.local_batch);
      samples += t.local_batch;
      t.progress = {epoch, s + 1, t.progress.global_step + 1, t.progress.global_batch};
      // The fields gpt_ddp's records carry too (the learning rate, the seconds since the start).
      metrics.step(t.progress.global_step, epoch + 1, loss, t.last_grad_norm,
                   {{"lr", t.optimizer ? t.optimizer->lr(0) : 0.0},
                    {"seconds", std::chrono::duration<double>(Clock::now() - start).count()}});
      stragglers.step();
      if (options.stragglers > 0 && t.progress.global_step % options.stragglers == 0) {
        const comm::StragglerReport report = stragglers.collect();  // collective: the same step everywhere
        metrics.stragglers(t.progress.global_step, report);
        if (rank == 0 && !options.quiet) {
          std::printf("step %lld: %s\n", static_cast<long long>(t.progress.global_step), report.line().c_str());
        }
      }
      if (checkpoint_due(options.restarts, t.progress.global_step)) t.checkpoint(options.restarts);
      kill_if_asked(options.restarts, rank, t.progress.global_step, name);
      if (options.max_steps >= 0 && t.progress.global_step >= options.max_steps) {
        stopped = true;
        break;
      }
    }
    if (options.uneven) {
      // Out of batches: shadow the others until every rank is out, then carry on from the
      // replica of the rank that took every step (its step count too).
      const int last = uneven.join();
      Tensor global_step = Tensor::from_vector(std::vector<double>{static_cast<double>(t.progress.global_step)}, {1});
      comm.broadcast(global_step, last);
      t.progress.global_step = static_cast<std::int64_t>(global_step.to_double_vector()[0]);
      if (rank == 0 && !options.quiet) {
        std::printf("epoch %3d: uneven inputs, the ranks took %lld down to %lld steps; rank %d joined last\n", epoch + 1,
                    static_cast<long long>(my_steps),
                    static_cast<long long>(steps_this_epoch(options, t.steps_per_epoch, comm.size() - 1, comm.size())),
                    last);
      }
    }
    if (!stopped) t.progress = {epoch + 1, 0, t.progress.global_step, t.progress.global_batch};
    // The epoch's loss over all ranks: one small allreduce at the same place on every rank.
    Tensor totals = Tensor::from_vector(std::vector<double>{loss_sum, static_cast<double>(samples)}, {2});
    comm.allreduce_host(totals, comm::ReduceOp::sum);
    const std::vector<double> sum = totals.to_double_vector();
    const double mean_loss = sum[1] > 0 ? sum[0] / sum[1] : 0.0;
    accuracy = evaluate(evaluated, t.data, t.split.heldout, t.device);
    metrics.epoch(t.progress.global_step, epoch + 1, mean_loss, accuracy);
    if (rank == 0 && !options.quiet) {
      const double seconds = std::chrono::duration<double>(Clock::now() - epoch_start).count();
      std::printf("epoch %3d/%d  loss %.4f  held-out accuracy %.2f%%  %8.0f samples/s  elapsed %.2f s\n", epoch + 1,
                  options.epochs, mean_loss, accuracy * 100, sum[1] / seconds,
                  std::chrono::duration<double>(Clock::now() - start).count());
    }
  }
  if (t.gather_model && (options.check_replicas || !options.save.empty())) t.gather_model();
  if (options.check_replicas) require_identical_replicas(comm, t.registry);
  if (!options.restarts.checkpoint_dir.empty()) t.checkpoint(options.restarts);
  if (!options.save.empty()) {
    // Every rank takes part (ZeRO gathers the pieces of the optimizer state); rank 0 writes.
    const OptimizerCheckpoint optimizer_state = optimizer_checkpoint_of(t);
    if (rank == 0) save_checkpoint(options.save, t.registry, optimizer_state, t.progress, t.scaler.get());
  }
  comm.barrier();  // the checkpoint is complete before any rank reports success
  timeline::stop();
  if (rank == 0) std::printf("final held-out accuracy: %.2f%%\n", accuracy * 100);
  if (options.min_accuracy >= 0 && accuracy < options.min_accuracy) {
    if (rank == 0) std::fprintf(stderr, "%s: held-out accuracy %.4f is below --min-accuracy %.4f\n", name.c_str(), accuracy,
                                options.min_accuracy);
    return 2;
  }
  return 0;
}

dist::DDPSyncStrategy sync_strategy_from(const std::string& text, bool find_unused) {
  if (text.empty()) return dist::default_sync_strategy(find_unused);  // Composer's trainer default
  if (text == "single" || text == "multi") return dist::parse_sync_strategy(text + "_auto_sync");
  if (text == "forced") return dist::parse_sync_strategy("forced_sync");
  return dist::parse_sync_strategy(text);
}

}  // namespace gradsync::examples
