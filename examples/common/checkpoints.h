// The trainers' checkpoints and automatic resume (examples/common/): the one file a checkpoint is,
// and the folder a run restarted by torchrun --max-restarts resumes from by itself.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flags.h"
#include "gradsync/comm/communicator.h"
#include "gradsync/io/safetensors.h"
#include "gradsync/optim/grad_scaler.h"
#include "gradsync/optim/optimizer.h"

namespace gradsync::examples {

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
  std::int64_t position = -1;     // --replica-groups: the samples the committed steps consumed (-1: not such a run)
};
// With fp16, the loss scaler's state rides along in the metadata.
// The optimizer's part of a checkpoint: its state tensors and metadata (an unsharded
// optimizer's own; with ZeRO, the consolidated state every rank's pieces make).
struct OptimizerCheckpoint {
  std::vector<io::NamedTensor> tensors;
  io::Metadata metadata;
};
//
// A model file a framework loads as it is (the GPT's --save: nanoGPT's model takes it with
// load_state_dict(strict=True)): the weights and `extra` (tensors that model has beyond the
// registry's, such as nanoGPT's tied lm_head.weight) alone in the file, with `metadata` (its
// config) and the progress; the optimizer state beside it in <stem>.optimizer-<xxh64>.safetensors,
// named by its own checksum, which the model file records. The optimizer file is written first
// under its new name, then the model file replaced atomically, then the previous optimizer file
// removed: a crash at any point leaves a model file and the optimizer file it names, both whole.
struct ModelFile {
  std::vector<io::NamedTensor> extra;
  io::Metadata metadata;
};
void save_checkpoint(const std::string& path, const ParameterRegistry& registry, const OptimizerCheckpoint& optimizer,
                     const Progress& progress, const optim::GradScaler* scaler = nullptr,
                     const ModelFile* model_file = nullptr);
// Either form; the optimizer state from the file the model file names when it names one.
Progress load_checkpoint(const std::string& path, ParameterRegistry& registry, optim::Optimizer& optimizer,
                         optim::GradScaler* scaler = nullptr);
// The checkpoint a folder's `latest` names; empty when the folder has none yet.
std::string latest_checkpoint(const std::string& folder);

// ---- Restarts: a folder of checkpoints, `latest` naming the newest ----------------------------

// --checkpoint-dir D --checkpoint-every N: every N steps (and at the end of the run) a checkpoint
// D/step_<N>.safetensors, then D/latest renamed into place naming it; a run given D resumes from
// D/latest by itself. --kill-rank R:STEP: rank R SIGKILLs itself after step STEP in the first
// attempt only (fault injection, to see a restart resume).
struct RestartOptions {
  std::string checkpoint_dir;
  std::int64_t checkpoint_every = 0;
  int kill_rank = -1;
  std::int64_t kill_step = 0;
};
RestartOptions parse_restart_options(Flags& flags);
extern const char* const kRestartHelp;

// The checkpoint a run resumes from: `resume` (--resume) when given, else the folder's latest;
// empty: a fresh start. A --checkpoint-dir that exists and is not a folder is an error here,
// before the first step, not at the first write.
std::string resume_point(const RestartOptions& restarts, const std::string& resume);
// The global batch a checkpoint was trained with (0: the checkpoint does not say).
std::int64_t checkpoint_global_batch(const std::string& path);
// Whether a checkpoint into the folder is due after `global_step`.
bool checkpoint_due(const RestartOptions& restarts, std::int64_t global_step);
// A checkpoint into the folder, called on every rank once the optimizer's part is in hand (with
// ZeRO, gathering it is collective): rank 0 writes step_<N>.safetensors (atomically), renames a
// new `latest` into place, then removes all but the two newest; a barrier makes it complete
// before any rank goes on. A kill at any moment leaves `latest` naming a whole checkpoint.
void checkpoint_into_folder(const RestartOptions& restarts, comm::Communicator& comm, const ParameterRegistry& registry,
                            const OptimizerCheckpoint& optimizer, const Progress& progress,
                            const optim::GradScaler* scaler = nullptr);
// --kill-rank: SIGKILLs this process when it is rank R after step STEP, in a run's first attempt
// (TORCHELASTIC_RESTART_COUNT unset or 0), saying so on stderr first.
void kill_if_asked(const RestartOptions& restarts, int rank, std::int64_t global_step, const std::string& trainer);

}  // namespace gradsync::examples
