// comm::connect: the backend choice and the environment rendezvous (gradsync/comm/connect.h).
#include "gradsync/comm/connect.h"

#include <algorithm>
#include <cctype>
#include <optional>
#include <string>

#include "gradsync/comm/gloo/gloo.h"
#include "gradsync/comm/mpi/mpi.h"
#include "gradsync/comm/nccl/nccl.h"
#include "gradsync/config.h"
#include "core/environment.h"
#include "comm/records/flight_recorder.h"

namespace gradsync::comm {

namespace {

// The CPU communicator of a process not started by an MPI launcher: Gloo through the
// rendezvous the environment describes.
std::unique_ptr<Communicator> gloo_from_environment(const CommOptions& options) {
  const LaunchEnvironment launch = launch_from_environment();
  // Waiting for late peers is exactly when an operator asks for a dump (SIGUSR1): the rank
  // answers it from here on, not only once it has a communicator.
  const ConnectingScope connecting(launch.rank, launch.store_dir.empty()
                                                    ? "the rendezvous at " + launch.host + ":" + std::to_string(launch.port)
                                                    : "the rendezvous in " + launch.store_dir);
  if (!launch.store_dir.empty() && launch.size > 1) {
    return gloo_file_store(launch.store_dir, launch.rank, launch.size, options);
  }
  GRADSYNC_CHECK(launch.size == 1 || launch.port > 0, "rank ", launch.rank, " of ", launch.size, " (launched by ",
                 launch.launcher, "): set MASTER_PORT (and MASTER_ADDR, default 127.0.0.1) for the Gloo TCP "
                 "rendezvous, or GRADSYNC_GLOO_STORE_DIR for a shared folder");
  if (launch.torch_store) {
    return gloo_torch_store(launch.host, launch.port, launch.rank, launch.size, launch.store_prefix, options);
  }
  return gloo_tcp_store(launch.host, launch.port, launch.rank, launch.size, options);
}

std::unique_ptr<Communicator> cpu_from_environment(const CommOptions& options) {
  if (launched_by_mpi() && mpi_available()) return mpi_world(options);
  return gloo_from_environment(options);
}

}  // namespace

std::string first_host_of_nodelist(std::string_view nodelist) {
  const auto malformed = [&](const char* why) {
    detail::throw_error("Slurm host list '", nodelist, "': ", why);
  };
  // The first top-level item: up to the first comma outside brackets.
  std::string_view item = nodelist;
  int depth = 0;
  for (std::size_t i = 0; i < nodelist.size(); ++i) {
    if (nodelist[i] == '[') ++depth;
    if (nodelist[i] == ']' && --depth < 0) malformed("unbalanced ']'");
    if (nodelist[i] == ',' && depth == 0) {
      item = nodelist.substr(0, i);
      break;
    }
  }
  const auto digits = [](std::string_view text) {
    return !text.empty() && text.find_first_not_of("0123456789") == std::string_view::npos;
  };
  // Each bracket group contributes its first entry: "01-04,07" -> "01" (zero padding kept). Every
  // entry of a group is checked: a number, or an ascending range of numbers.
  std::string host;
  for (std::size_t i = 0; i < item.size(); ++i) {
    if (item[i] == ']') malformed("unbalanced ']'");
    if (std::isspace(static_cast<unsigned char>(item[i]))) malformed("white space in a host name");
    if (item[i] != '[') {
      host += item[i];
      continue;
    }
    const std::size_t close = item.find(']', i);
    if (close == std::string_view::npos) malformed("unbalanced '['");
    const std::string_view group = item.substr(i + 1, close - i - 1);
    for (std::size_t start = 0; start <= group.size();) {
      const std::size_t end = std::min(group.find(',', start), group.size());
      const std::string_view entry = group.substr(start, end - start);
      const std::size_t dash = entry.find('-');
      const std::string_view low = entry.substr(0, dash);
      const std::string_view high = dash == std::string_view::npos ? low : entry.substr(dash + 1);
      if (entry.empty()) malformed("an empty range");
      if (!digits(low) || !digits(high)) malformed("a range that is not numbers");
      if (low.size() > 9 || high.size() > 9 || std::stoll(std::string(high)) < std::stoll(std::string(low))) {
        malformed("a descending or oversized range");
      }
      start = end + 1;
    }
    host += group.substr(0, group.find_first_of(",-"));
    i = close;
  }
  if (host.empty()) malformed("no host");
  return host;
}

LaunchEnvironment launch_from_environment() {
  using environment::launcher;
  using environment::launcher_integer;
  LaunchEnvironment launch;
  launch.store_dir = environment::gloo_store_dir().value_or("");
  const std::optional<std::string> host = launcher("MASTER_ADDR");
  if (launcher("RANK") || launcher("WORLD_SIZE")) {
    launch.launcher = "torchrun";
    launch.size = launcher_integer("WORLD_SIZE", 1);
    launch.rank = launcher_integer("RANK", 0);
    launch.host = host.value_or("127.0.0.1");
    launch.port = launcher_integer("MASTER_PORT", 0);
  } else if (launcher("SLURM_PROCID") && launcher("SLURM_NTASKS")) {
    launch.launcher = "slurm";
    launch.size = launcher_integer("SLURM_NTASKS", 1);
    launch.rank = launcher_integer("SLURM_PROCID", 0);
    if (host) {
      launch.host = *host;
    } else {
      for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"}) {
        GRADSYNC_CHECK(!environment::is_set(name) || launcher(name), name, " is set but empty; set MASTER_ADDR to ",
                       "rank 0's host");
      }
      std::optional<std::string> nodelist = launcher("SLURM_STEP_NODELIST");
      if (!nodelist) nodelist = launcher("SLURM_JOB_NODELIST");
      GRADSYNC_CHECK(nodelist || launch.size == 1, "srun task ", launch.rank, " of ", launch.size,
                     ": neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set; set MASTER_ADDR to rank 0's host");
      launch.host = nodelist ? first_host_of_nodelist(*nodelist) : "127.0.0.1";
    }
    // Every task of the job computes the same port from the job id.
    const int job = launcher_integer("SLURM_JOB_ID", 0);
    launch.port = launcher("MASTER_PORT") ? launcher_integer("MASTER_PORT", 0) : 20000 + job % 20000;
  } else {
    launch.launcher = "single";
    launch.host = host.value_or("127.0.0.1");
    launch.port = launcher_integer("MASTER_PORT", 0);
  }
  GRADSYNC_CHECK(launch.size >= 1 && launch.rank < launch.size, "rank ", launch.rank, " is outside a world of ",
                 launch.size, " (launched by ", launch.launcher, ")");
  launch.local_rank = local_rank_from_environment(0);
  // Under torchrun every attempt of the group meets under its own prefix: a restarted group never
  // reads what the previous attempt wrote into the agent's store (which outlives it).
  launch.torch_store = environment::torch_store();
  if (launch.torch_store) {
    launch.store_prefix = "/gradsync/" + launcher("TORCHELASTIC_RUN_ID").value_or("none") + "/" +
                          launcher("TORCHELASTIC_RESTART_COUNT").value_or("0") + "/";
  }
  return launch;
}

int local_rank_from_environment(int fallback) {
  for (const char* name : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    if (environment::launcher(name)) return environment::launcher_integer(name, fallback);
  }
  return fallback;
}

std::string choose_backend(std::string_view backend, Device device) {
  if (backend == "auto") {
    if (device.is_cuda() && GRADSYNC_WITH_NCCL && nccl_available()) return "nccl";
    if (launched_by_mpi() && mpi_available()) return "mpi";
    GRADSYNC_CHECK(gloo_available(), "backend auto: this build has neither MPI (or it was not launched by mpirun) nor Gloo");
    return "gloo";
  }
  if (backend == "nccl") {
    GRADSYNC_CHECK(GRADSYNC_WITH_NCCL, "backend nccl: gradsync was built without NCCL (needs CUDA and libnccl)");
    GRADSYNC_CHECK(nccl_available(), "backend nccl: ", nccl_unavailable_reason());
    return "nccl";
  }
  if (backend == "mpi") {
    GRADSYNC_CHECK(mpi_available(), "backend mpi: gradsync was built without MPI (install libopenmpi-dev and reconfigure)");
    return "mpi";
  }
  if (backend == "gloo") {
    GRADSYNC_CHECK(gloo_available(), "backend gloo: gradsync was built without Gloo (install libgloo-dev and reconfigure)");
    return "gloo";
  }
  detail::throw_error("unknown backend '", backend, "': expected one of auto, nccl, mpi, gloo");
}

std::unique_ptr<Communicator> connect(std::string_view backend, Device device, const CommOptions& options) {
  const std::string chosen = choose_backend(backend, device);
  if (chosen == "mpi") {
    auto world = mpi_world(options);
    // MPI's ranks come from mpirun (or srun --mpi): a process that torchrun started is an MPI
    // world of its own, and would train alone while believing it trains with the others.
    const int launched_world = environment::launcher_integer("WORLD_SIZE", 0);
    GRADSYNC_CHECK(launched_world <= 1 || launched_world == world->size(), "backend mpi: this process is rank ",
                   environment::launcher_integer("RANK", 0), " of ", launched_world, " (WORLD_SIZE, from torchrun or a ",
                   "launcher like it) but MPI sees a world of ", world->size(),
                   ": MPI ranks come from mpirun; under torchrun use the gloo backend (auto chooses it)");
    return world;
  }
  if (chosen == "gloo") return gloo_from_environment(options);
  // NCCL: a CPU communicator carries the unique id, then is no longer needed. Each rank takes
  // the GPU of its local rank (one GPU holds one NCCL rank), whatever index `device` names:
  // "--device cuda" on every rank must not put them all on cuda:0.
  auto bootstrap = cpu_from_environment(options);
  return nccl_communicator(*bootstrap, options, -1);
}

}  // namespace gradsync::comm
