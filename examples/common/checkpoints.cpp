// The trainers' checkpoints and automatic resume (checkpoints.h).
#include "checkpoints.h"

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "gradsync/io/checksum.h"
#include "gradsync/io/registry_checkpoint.h"

namespace gradsync::examples {

namespace {

// The model file's pointer to its optimizer file: that file's XXH64, from which its name follows
// (<stem>.optimizer-<xxh64>.safetensors): not the name itself, so that two saves of one state
// under two names are the same bytes.
constexpr const char* kOptimizerXxh64 = "checkpoint.optimizer_xxh64";

// <stem>.optimizer-<id>.safetensors beside the model file.
std::filesystem::path optimizer_file(const std::filesystem::path& model, const std::string& id) {
  return model.parent_path() / (model.stem().string() + ".optimizer-" + id + ".safetensors");
}


}  // namespace

void save_checkpoint(const std::string& path, const ParameterRegistry& registry, const OptimizerCheckpoint& optimizer,
                     const Progress& progress, const optim::GradScaler* scaler, const ModelFile* model_file) {
  io::Metadata progress_metadata{{"epoch", std::to_string(progress.epoch)},
                                 {"step_in_epoch", std::to_string(progress.step_in_epoch)},
                                 {"global_step", std::to_string(progress.global_step)},
                                 {"global_batch", std::to_string(progress.global_batch)}};
  if (progress.position >= 0) progress_metadata["position"] = std::to_string(progress.position);
  std::vector<io::NamedTensor> weights;
  for (const Parameter& parameter : registry) weights.push_back({parameter.name(), parameter.value()});
  io::Metadata metadata = optimizer.metadata;
  metadata.merge(io::Metadata(progress_metadata));
  if (scaler != nullptr) metadata.merge(scaler->state_metadata());
  if (model_file == nullptr) {  // one file
    for (const io::NamedTensor& state : optimizer.tensors) weights.push_back(state);
    io::save_safetensors(path, weights, metadata);
    return;
  }
  namespace fs = std::filesystem;
  // The optimizer file is named by its own checksum: the same state is the same name (two runs
  // that end alike write the same bytes), and no save overwrites the file an older model file names.
  const fs::path partial = optimizer_file(path, "partial");
  io::save_safetensors(partial, optimizer.tensors, metadata);
  const std::string id = io::hex_digest(io::checksum_file(partial).xxh64);
  const fs::path beside = optimizer_file(path, id);
  fs::rename(partial, beside);
  for (const io::NamedTensor& extra : model_file->extra) weights.push_back(extra);
  io::Metadata model_metadata = model_file->metadata;
  model_metadata.merge(progress_metadata);
  model_metadata[kOptimizerXxh64] = id;
  io::save_safetensors(path, weights, model_metadata);
  // The previous saves' optimizer files are no longer named: removed.
  const std::string prefix = fs::path(path).stem().string() + ".optimizer-";
  for (const fs::directory_entry& entry : fs::directory_iterator(beside.parent_path().empty() ? "." : beside.parent_path())) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with(prefix) && name.ends_with(".safetensors") && name != beside.filename().string()) {
      std::error_code ignored;
      fs::remove(entry.path(), ignored);
    }
  }
}

Progress load_checkpoint(const std::string& path, ParameterRegistry& registry, optim::Optimizer& optimizer,
                         optim::GradScaler* scaler) {
  // The optimizer's file: this one, or the one it names (checked to be of the same save).
  const io::SafetensorsReader file(path);
  std::string optimizer_path = path;
  if (file.metadata().contains(kOptimizerXxh64)) {
    const std::string id = file.metadata().at(kOptimizerXxh64);
    GRADSYNC_CHECK(id.size() == 16 && id.find_first_not_of("0123456789abcdef") == std::string::npos, path, ": '",
                   kOptimizerXxh64, "' is '", id, "', not 16 lowercase hex digits");
    optimizer_path = optimizer_file(path, id).string();
    GRADSYNC_CHECK(std::filesystem::exists(optimizer_path), path, " keeps its optimizer state in ", optimizer_path,
                   ", which is not there (copy or rename the two files together)");
    // Named by its checksum: a file that is not the one saved with this model file is found.
    GRADSYNC_CHECK(io::hex_digest(io::checksum_file(optimizer_path).xxh64) == id, optimizer_path,
                   " is not the optimizer state saved with ", path, " (its XXH64 differs)");
  }
  const io::SafetensorsReader state(optimizer_path);
  // The checksum proves the file is whole, not that it is this save's: another save's optimizer
  // file, named in an edited model file, has a matching checksum too. Both carry the progress.
  for (const char* key : {"global_step", "epoch", "step_in_epoch"}) {
    const auto mine = file.metadata().find(key), theirs = state.metadata().find(key);
    GRADSYNC_CHECK(mine == file.metadata().end() || (theirs != state.metadata().end() && theirs->second == mine->second),
                   optimizer_path, " is not the optimizer state saved with ", path, " (its ", key, " is ",
                   theirs == state.metadata().end() ? std::string("missing") : theirs->second, ", the model file's ",
                   mine->second, ")");
  }
  // Both loads validate everything before they change anything; the weights first.
  const io::Metadata metadata = io::load_registry(registry, path, {.load_grads = false, .allow_extra_tensors = true});
  optimizer.load_state(state);
  if (scaler != nullptr && state.metadata().contains("grad_scaler.scale")) scaler->load_state(state.metadata());
  Progress progress;
  try {
    progress.epoch = std::stoi(metadata.at("epoch"));
    progress.step_in_epoch = std::stoll(metadata.at("step_in_epoch"));
    progress.global_step = std::stoll(metadata.at("global_step"));
    if (metadata.contains("global_batch")) progress.global_batch = std::stoll(metadata.at("global_batch"));
    if (metadata.contains("position")) progress.position = std::stoll(metadata.at("position"));
  } catch (const std::exception&) {
    detail::throw_error(path, ": no training progress in its metadata (epoch, step_in_epoch, global_step)");
  }
  return progress;
}

std::string latest_checkpoint(const std::string& folder) {
  std::ifstream in(std::filesystem::path(folder) / "latest");
  std::string name;
  if (!(in >> name)) return "";
  const std::filesystem::path path = std::filesystem::path(folder) / name;
  GRADSYNC_CHECK(std::filesystem::exists(path), folder, "/latest names ", name, ", which is not there");
  return path.string();
}

const char* const kRestartHelp = R"(  --checkpoint-dir D --checkpoint-every N (a checkpoint every N steps and at the end, D/latest naming it; a run
    with D resumes from D/latest by itself: restarts under torchrun --max-restarts)
  --kill-rank R:STEP (fault injection: rank R SIGKILLs itself after step STEP, in the first attempt only))";

RestartOptions parse_restart_options(Flags& flags) {
  RestartOptions o;
  o.checkpoint_dir = flags.text("--checkpoint-dir", "");
  o.checkpoint_every = flags.count("--checkpoint-every", 0, 0);
  GRADSYNC_CHECK(o.checkpoint_every >= 0, "--checkpoint-every ", o.checkpoint_every, " must not be negative");
  GRADSYNC_CHECK(o.checkpoint_every == 0 || !o.checkpoint_dir.empty(), "--checkpoint-every needs --checkpoint-dir");
  if (const auto kill = flags.rank_and_number("--kill-rank", "STEP")) std::tie(o.kill_rank, o.kill_step) = *kill;
  return o;
}

std::string resume_point(const RestartOptions& restarts, const std::string& resume) {
  if (!resume.empty() || restarts.checkpoint_dir.empty()) return resume;
  const std::filesystem::path folder(restarts.checkpoint_dir);
  GRADSYNC_CHECK(!std::filesystem::exists(folder) || std::filesystem::is_directory(folder), "--checkpoint-dir ",
                 restarts.checkpoint_dir, " is not a folder");
  return latest_checkpoint(restarts.checkpoint_dir);
}

std::int64_t checkpoint_global_batch(const std::string& path) {
  const io::Metadata metadata = io::SafetensorsReader(path).metadata();
  return metadata.contains("global_batch") ? std::stoll(metadata.at("global_batch")) : 0;
}

bool checkpoint_due(const RestartOptions& restarts, std::int64_t global_step) {
  return restarts.checkpoint_every > 0 && global_step % restarts.checkpoint_every == 0;
}

void checkpoint_into_folder(const RestartOptions& restarts, comm::Communicator& comm, const ParameterRegistry& registry,
                            const OptimizerCheckpoint& optimizer, const Progress& progress,
                            const optim::GradScaler* scaler) {
  if (comm.rank() == 0) {
    namespace fs = std::filesystem;
    const fs::path folder(restarts.checkpoint_dir);
    fs::create_directories(folder);
    const std::string name = "step_" + std::to_string(progress.global_step) + ".safetensors";
    save_checkpoint((folder / name).string(), registry, optimizer, progress, scaler);
    {
      std::ofstream out(folder / "latest.partial");
      out << name << "\n";
      GRADSYNC_CHECK(out.good(), "cannot write ", (folder / "latest.partial").string());
    }
    fs::rename(folder / "latest.partial", folder / "latest");
    std::vector<std::pair<std::int64_t, fs::path>> steps;
    for (const fs::directory_entry& entry : fs::directory_iterator(folder)) {
      const std::string file = entry.path().filename().string();
      if (file.starts_with("step_") && file.ends_with(".safetensors")) {
        steps.emplace_back(std::stoll(file.substr(5, file.size() - 5 - 12)), entry.path());
      }
    }
    std::sort(steps.rbegin(), steps.rend());
    for (std::size_t i = 2; i < steps.size(); ++i) fs::remove(steps[i].second);
  }
  comm.barrier();
}

void kill_if_asked(const RestartOptions& restarts, int rank, std::int64_t global_step, const std::string& trainer) {
  if (rank != restarts.kill_rank || global_step != restarts.kill_step) return;
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (attempt != nullptr && std::string(attempt) != "0") return;
  std::fprintf(stderr, "%s: rank %d kills itself after step %lld (--kill-rank)\n", trainer.c_str(), rank,
               static_cast<long long>(global_step));
  std::fflush(stderr);
  std::raise(SIGKILL);
}

}  // namespace gradsync::examples
