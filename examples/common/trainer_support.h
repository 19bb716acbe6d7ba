// What the example trainers share, so each trainer file shows only its training loop:
// command-line flags, the data set (safetensors: images f32 [N, D], labels i64 [N]), the
// held-out split and per-rank shards, the MLP, optimizers by name, checkpoints (weights and
// optimizer state, with the training progress) and the metrics file.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gradsync/comm/communicator.h"
#include "gradsync/comm/flight_recorder.h"
#include "gradsync/dist/sync_strategy.h"
#include "gradsync/nn/layers.h"
#include "gradsync/optim/grad_scaler.h"
#include "gradsync/optim/optimizer.h"

namespace gradsync::examples {

// --name value and --switch flags. Reading a flag marks it known; finish() rejects the rest.
class Flags {
 public:
  Flags(int argc, char** argv);
  std::string text(const std::string& name, const std::string& fallback);
  std::int64_t integer(const std::string& name, std::int64_t fallback);
  double number(const std::string& name, double fallback);
  bool flag(const std::string& name);  // a switch without value
  bool given(const std::string& name) const;  // on the command line (not its fallback)
  void finish() const;                 // throws naming unknown flags

 private:
  std::map<std::string, std::string> values_;
  std::set<std::string> switches_;
  std::set<std::string> known_;
};

struct Dataset {
  Tensor images;  // f32 [count, features], scaled
  Tensor labels;  // i64 [count]
  std::int64_t count = 0;
  std::int64_t features = 0;
  std::int64_t classes = 0;
};

// The digits file shipped in examples/data.
std::string default_data_path();
// Reads a data set; images are multiplied by `input_scale`.
Dataset load_dataset(const std::string& path, double input_scale);

// Held-out split: the last `holdout` fraction of a seeded permutation (or of the file order
// when shuffle is off). The same on every rank.
struct Split {
  std::vector<std::int64_t> train;
  std::vector<std::int64_t> heldout;
};
Split split_dataset(const Dataset& data, double holdout, std::uint64_t seed, bool shuffle);

// The rows rank r reads in one epoch, in order. The epoch is one seeded permutation of the whole
// training set, cut into global batches of `local_batch` x `world` samples by global sample
// index; rank r reads slice r of each. So the samples of step s do not depend on the number of
// ranks, and a run resumed on another world size (the same global batch) reads, from the step it
// resumes at, exactly the samples the interrupted run would have.
std::vector<std::int64_t> epoch_order(const std::vector<std::int64_t>& train, std::uint64_t seed, int epoch, int rank,
                                      int world, std::int64_t local_batch, bool shuffle);

// The rows order[begin, end) as a batch on `device`.
struct Batch {
  Tensor images;
  Tensor labels;  // on the host (the loss reads them there)
};
Batch gather(const Dataset& data, const std::vector<std::int64_t>& order, std::int64_t begin, std::int64_t end,
             Device device);

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

// Checkpoints: one safetensors file holding the weights (under their parameter names, so
// PyTorch's safetensors loader reads them directly), the optimizer state
// ("optimizer.state.<param>.<buffer>") and, in the metadata, the optimizer's groups and steps
// and the training progress. One file written atomically: a save that fails leaves the previous
// checkpoint whole, weights and optimizer state together.
struct Progress {
  int epoch = 0;             // the epoch to run next
  std::int64_t step_in_epoch = 0;
  std::int64_t global_step = 0;
  std::int64_t global_batch = 0;  // what the run trains with; a resumed run keeps it
};
// With fp16, the loss scaler's state rides along in the metadata.
// The optimizer's part of a checkpoint: its state tensors and metadata (an unsharded
// optimizer's own; with ZeRO, the consolidated state every rank's pieces make).
struct OptimizerCheckpoint {
  std::vector<io::NamedTensor> tensors;
  io::Metadata metadata;
};
void save_checkpoint(const std::string& path, const ParameterRegistry& registry, const OptimizerCheckpoint& optimizer,
                     const Progress& progress, const optim::GradScaler* scaler = nullptr);
Progress load_checkpoint(const std::string& path, ParameterRegistry& registry, optim::Optimizer& optimizer,
                         optim::GradScaler* scaler = nullptr);
// The checkpoint a folder's `latest` names; empty when the folder has none yet.
std::string latest_checkpoint(const std::string& folder);

// One JSON object per line: {"step":..,"epoch":..,"loss":..[,"accuracy":..]}. Disabled when
// the path is empty; only rank 0 writes.
class Metrics {
 public:
  Metrics(const std::string& path, bool writer);
  ~Metrics();
  // grad_norm: the total gradient norm before clipping, written when it is a number.
  void step(std::int64_t step, int epoch, double loss, double grad_norm,
            const std::vector<std::pair<const char*, double>>& extra = {});  // more "name": value fields
  void epoch(std::int64_t step, int epoch, double loss, double accuracy);
  void stragglers(std::int64_t step, const comm::StragglerReport& report);

 private:
  std::FILE* file_ = nullptr;
};

// ---- The training run every trainer shares ----------------------------------------------------

// The ranks of the job and this rank's device: `device` as --device names it (any_gpu: plain
// "cuda", which means the GPU of this rank's local rank); NCCL picks its own.
struct Ranks {
  std::unique_ptr<comm::Communicator> comm;
  Device device;
};
Ranks connect_ranks(const std::string& backend, Device device, bool any_gpu);

// The flags common to the trainers (each adds its own before calling finish()).
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
  // Restarts (torchrun --max-restarts): every N steps a checkpoint in the folder, named by its
  // step, then the folder's `latest` pointer renamed into place; a run with the folder resumes
  // from `latest` by itself.
  std::string checkpoint_dir;
  std::int64_t checkpoint_every = 0;
  int kill_rank = -1;  // --kill-rank R:STEP: rank R SIGKILLs itself after step STEP, first attempt only
  std::int64_t kill_step = 0;
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
  void finish_step(const TrainerOptions& options, const std::function<double(double)>& clip,
                   const std::function<void()>& step);
};
std::unique_ptr<Training> prepare_training(const TrainerOptions& options);

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

// Every rank holds bit-identical weights (an allgather of a checksum of the bits); throws
// naming the first rank that differs.
void require_identical_replicas(comm::Communicator& comm, const ParameterRegistry& registry);

}  // namespace gradsync::examples
