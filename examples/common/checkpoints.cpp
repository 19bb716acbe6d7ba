// The trainers' checkpoints and automatic resume (checkpoints.h).
#include "checkpoints.h"

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "gradsync/io/registry_checkpoint.h"

namespace gradsync::examples {

void save_checkpoint(const std::string& path, const ParameterRegistry& registry, const OptimizerCheckpoint& optimizer,
                     const Progress& progress, const optim::GradScaler* scaler) {
  std::vector<io::NamedTensor> tensors;
  for (const Parameter& parameter : registry) tensors.push_back({parameter.name(), parameter.value()});
  for (const io::NamedTensor& state : optimizer.tensors) tensors.push_back(state);
  io::Metadata metadata = optimizer.metadata;
  metadata["epoch"] = std::to_string(progress.epoch);
  metadata["step_in_epoch"] = std::to_string(progress.step_in_epoch);
  metadata["global_step"] = std::to_string(progress.global_step);
  metadata["global_batch"] = std::to_string(progress.global_batch);
  if (scaler != nullptr) metadata.merge(scaler->state_metadata());
  io::save_safetensors(path, tensors, metadata);
}

Progress load_checkpoint(const std::string& path, ParameterRegistry& registry, optim::Optimizer& optimizer,
                         optim::GradScaler* scaler) {
  // Both loads validate everything before they change anything; the weights first.
  const io::Metadata metadata = io::load_registry(registry, path, {.load_grads = false, .allow_extra_tensors = true});
  optimizer.load_state(io::SafetensorsReader(path));
  if (scaler != nullptr && metadata.contains("grad_scaler.scale")) scaler->load_state(metadata);
  Progress progress;
  try {
    progress.epoch = std::stoi(metadata.at("epoch"));
    progress.step_in_epoch = std::stoll(metadata.at("step_in_epoch"));
    progress.global_step = std::stoll(metadata.at("global_step"));
    if (metadata.contains("global_batch")) progress.global_batch = std::stoll(metadata.at("global_batch"));
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
  o.checkpoint_every = flags.integer("--checkpoint-every", 0);
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
