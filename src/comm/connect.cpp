// comm::connect: the backend choice and the environment rendezvous (gradsync/comm/connect.h).
#include "gradsync/comm/connect.h"

#include <cstdlib>
#include <string>

#include "gradsync/comm/gloo.h"
#include "gradsync/comm/mpi.h"
#include "gradsync/comm/nccl.h"
#include "gradsync/config.h"

namespace gradsync::comm {

namespace {

const char* environment(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

int integer_variable(const char* name, int fallback) {
  const char* text = environment(name);
  if (text == nullptr) return fallback;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  GRADSYNC_CHECK(end != text && *end == '\0' && value >= 0 && value < (1L << 30), "environment variable ", name,
                 "='", text, "' is not a non-negative integer");
  return static_cast<int>(value);
}

// The CPU communicator of a process not started by mpirun: Gloo through the rendezvous the
// environment describes.
std::unique_ptr<Communicator> gloo_from_environment(const CommOptions& options) {
  const int size = integer_variable("WORLD_SIZE", 1);
  const int rank = integer_variable("RANK", 0);
  GRADSYNC_CHECK(size >= 1 && rank < size, "RANK=", rank, " is outside WORLD_SIZE=", size);
  if (const char* folder = environment("GRADSYNC_GLOO_STORE_DIR"); folder != nullptr && size > 1) {
    return gloo_file_store(folder, rank, size, options);
  }
  const char* host = environment("MASTER_ADDR");
  const int port = integer_variable("MASTER_PORT", 0);
  GRADSYNC_CHECK(size == 1 || port > 0, "rank ", rank, " of WORLD_SIZE=", size,
                 ": set MASTER_PORT (and MASTER_ADDR, default 127.0.0.1) for the Gloo TCP rendezvous, or "
                 "GRADSYNC_GLOO_STORE_DIR for a shared folder");
  return gloo_tcp_store(host != nullptr ? host : "127.0.0.1", port, rank, size, options);
}

std::unique_ptr<Communicator> cpu_from_environment(const CommOptions& options) {
  if (launched_by_mpi() && mpi_available()) return mpi_world(options);
  return gloo_from_environment(options);
}

}  // namespace

int local_rank_from_environment(int fallback) {
  for (const char* name : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    if (environment(name) != nullptr) return integer_variable(name, fallback);
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
  if (chosen == "mpi") return mpi_world(options);
  if (chosen == "gloo") return gloo_from_environment(options);
  // NCCL: a CPU communicator carries the unique id, then is no longer needed. Each rank takes
  // the GPU of its local rank (one GPU holds one NCCL rank), whatever index `device` names:
  // "--device cuda" on every rank must not put them all on cuda:0.
  auto bootstrap = cpu_from_environment(options);
  return nccl_communicator(*bootstrap, options, -1);
}

}  // namespace gradsync::comm
