// What the example trainers share, so each trainer file shows only its training loop. The parts,
// one idea each, in examples/common/:
//   flags.h        the command line
//   ranks.h        connecting the ranks (the communicator, this rank's device), the replicas' check
//   data.h         the digits data by global sample index (the split, each epoch's order, batches)
//   checkpoints.h  the checkpoint file, and restarts: the folder, `latest`, automatic resume
//   metrics.h      the metrics file
// and here: the digits MLP with its optimizer, and the training run the digits-style trainers
// (digits_ddp, horovod_style) share: their flags, the setup before the first step, the epochs.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "checkpoints.h"
#include "data.h"
#include "flags.h"
#include "metrics.h"
#include "ranks.h"
#include "gradsync/dist/data_parallel/sync_strategy.h"
#include "gradsync/nn/layers.h"
#include "gradsync/optim/grad_scaler.h"
#include "gradsync/optim/optimizer.h"

namespace gradsync::examples {

// features -> hidden -> ReLU -> classes, layers "fc1" and "fc2", PyTorch's initialization,
// parameters (and gradients) of `dtype`: f32, or bf16/f16 for mixed precision.
std::shared_ptr<nn::Sequential> make_mlp(ParameterRegistry& registry, std::int64_t features, std::int64_t hidden,
                                         std::int64_t classes, Device device, std::uint64_t seed,
                                         DType dtype = DType::f32);

// "sgd" (momentum 0.9 unless --momentum), "adam", "adamw"; with f32 master weights for a
// 16-bit model.
std::unique_ptr<optim::Optimizer> make_optimizer(const std::string& name, ParameterRegistry& registry, double lr,
                                                 double momentum,
                                                 optim::MasterWeights master_weights = optim::MasterWeights::none);

// Accuracy of the model on the held-out rows (local: every rank holds the same weights).
double evaluate(nn::Module& model, const Dataset& data, const std::vector<std::int64_t>& rows, Device device);

// ---- The training run every trainer shares ----------------------------------------------------

struct TrainerOptions {
  std::string backend, optimizer, data, init, save, resume, metrics;
  bool device_is_any_gpu = false;  // --device cuda (no index): the local rank's GPU
  std::string precision = "f32";  // f32 | bf16 | fp16 (16-bit parameters, f32 master weights)
  std::string timeline;           // --timeline PATH: a Chrome trace per rank (core/timeline.h)
  Device device;
  double lr = 0, momentum = 0, input_scale = 1, holdout = 0, min_accuracy = -1;
  double clip_norm = 0;  // clip gradients to this global norm (0: off)
  int epochs = 0;
  std::int64_t batch = 0, hidden = 0, max_steps = -1, passes = 1;
  std::uint64_t seed = 1;
  bool shuffle = true, check_replicas = false, quiet = false;
  bool batch_given = false;  // --batch on the command line: it must divide; the default is rounded
  std::int64_t stragglers = 0;  // --stragglers N: name the slowest rank every N steps (0: off)
  int delay_rank = -1;          // --delay-rank R:MS: slow rank R by MS per step (to see --stragglers name it)
  int delay_ms = 0;
  bool uneven = false;  // --uneven: rank r trains on (2W - r) / 2W of its shard each epoch, then joins
  RestartOptions restarts;  // --checkpoint-dir, --checkpoint-every, --kill-rank (checkpoints.h)
};
// `passes_flag` names the flag that splits a rank's batch ("--microbatches", "--backward-passes-per-step").
TrainerOptions parse_trainer_options(Flags& flags, const std::string& passes_flag);
extern const char* const kCommonHelp;

// Everything a run needs before its first step: the communicator, the data and this rank's
// shard, the batch arithmetic, the MLP with its optimizer, restored from --init / --resume.
struct Training {
  std::unique_ptr<comm::Communicator> comm;
  Device device;
  Dataset data;
  Split split;
  std::int64_t local_batch = 0;    // samples per rank per step
  std::int64_t micro = 0;          // samples per pass
  std::int64_t steps_per_epoch = 0;
  ParameterRegistry registry;
  std::shared_ptr<nn::Sequential> model;
  std::unique_ptr<optim::Optimizer> optimizer;
  std::unique_ptr<optim::GradScaler> scaler;  // fp16 only: dynamic loss scaling
  Progress progress;
  double last_grad_norm = std::numeric_limits<double>::quiet_NaN();  // the last step's total norm (NaN: not clipping)
  // What --save writes for the optimizer, called on every rank (collective with ZeRO); unset:
  // the optimizer's own state.
  std::function<OptimizerCheckpoint()> optimizer_checkpoint;
  // ZeRO stage 3, where a rank holds pieces of the parameters: `gather_model` makes every value
  // whole on every rank (collective) before the run saves or compares them; `evaluation_model`
  // is the module held-out evaluation runs, which gathers what it uses. Unset: nothing to gather,
  // `model`.
  std::function<void()> gather_model;
  nn::Module* evaluation_model = nullptr;
  std::string resumed_from;  // the checkpoint this run resumed from (--resume or the folder's latest); empty: none

  // The factor the loss gradient is multiplied by before the backward (the loss scale).
  double loss_scale() const;
  // The end of every trainer's step, for every precision: the loss scaler's unscale (fp16),
  // clipping (--clip-norm) through `clip(max_norm)`, which returns the total norm, then
  // `step()` (skipped when fp16 gradients overflowed on any rank) and the scaler's update.
  // `commit` (fault tolerance): first, the cross-group average and the coordinator's decision;
  // false leaves everything as it was (no unscale, no clip, no step, the scaler unchanged), and
  // true runs the rest on the average, which every group holds alike.
  // A checkpoint into the restarts folder: every rank takes part (ZeRO gathers the optimizer
  // state and, at stage 3, the model), then checkpoints.h writes it (rank 0).
  void checkpoint(const RestartOptions& restarts);
  void finish_step(const TrainerOptions& options, const std::function<double(double)>& clip,
                   const std::function<void()>& step, const std::function<bool()>& commit = {});
};
// `settings`: the trainer's own settings that must agree across ranks (require_same_settings),
// compared with the common ones before anything else happens; `trainer` names it in errors.
std::unique_ptr<Training> prepare_training(const TrainerOptions& options, const std::string& trainer,
                                           const std::vector<std::string>& settings = {});

// The epochs: `step(order, first_row)` trains one step on the rows order[first_row,
// first_row + local_batch) and returns its mean loss; the run handles progress, metrics, the
// per-epoch line (loss over all ranks, held-out accuracy, samples/s, elapsed), --max-steps,
// --check-replicas, --save and --min-accuracy. Returns the process exit code.
// Uneven inputs (--uneven): `enter` runs at the start of each epoch (enter the join), `join`
// when this rank is out of batches for the epoch; it returns the last rank to join.
struct UnevenInputs {
  std::function<void()> enter;
  std::function<int()> join;
};
// The number of steps rank `rank` of `world` takes per epoch: all of them, or with --uneven
// fewer the higher the rank (rank 0 takes them all, the last rank about half).
std::int64_t steps_this_epoch(const TrainerOptions& options, std::int64_t steps_per_epoch, int rank, int world);
int run_training(Training& training, const TrainerOptions& options, const std::string& name,
                 const std::function<double(const std::vector<std::int64_t>& order, std::int64_t first_row)>& step,
                 const UnevenInputs& uneven = {});

// --sync-strategy: single | multi | forced | auto (or the full names); empty: Composer's trainer
// default (MULTI with find_unused_parameters, else SINGLE).
dist::DDPSyncStrategy sync_strategy_from(const std::string& text, bool find_unused);

}  // namespace gradsync::examples
