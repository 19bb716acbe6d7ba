// Connecting the trainers' ranks (ranks.h).
#include "ranks.h"

#include <cstdio>

#include "gradsync/comm/connect.h"
#include "gradsync/dist/replicas/replicas.h"
#include "gradsync/io/checksum.h"

namespace gradsync::examples {

Ranks connect_ranks(const std::string& backend, Device device, bool any_gpu) {
  Ranks ranks;
  // The communicator; with NCCL the GPU is the one chosen for this rank.
  ranks.comm = comm::connect(backend, device);
  // With Gloo or MPI and --device cuda, the GPU of this rank's local rank too (several ranks
  // share one when there are fewer GPUs than ranks); their tensors are staged through host memory.
  ranks.device = ranks.comm->device_type().is_cuda() ? ranks.comm->device_type() : device;
  if (ranks.device.is_cuda() && any_gpu && cuda_device_count() > 0) {
    ranks.device = Device::cuda(comm::local_rank_from_environment(ranks.comm->rank()) % cuda_device_count());
  }
  return ranks;
}

void require_same_settings(comm::Communicator& comm, const std::vector<std::string>& settings,
                           const std::string& trainer) {
  dist::require_same_lines(comm, settings, trainer, "settings", "Setting");
}

std::string file_setting(const std::string& flag, const std::string& path) {
  if (path.empty()) return flag + " none";
  const io::FileChecksum checksum = io::checksum_file(path);
  return flag + " " + std::to_string(checksum.bytes) + " bytes, xxh64 " + io::hex_digest(checksum.xxh64);
}

std::string number_setting(const std::string& flag, double value) {
  char text[64];
  std::snprintf(text, sizeof text, "%.17g", value);
  return flag + " " + text;
}

void require_identical_replicas(comm::Communicator& comm, const ParameterRegistry& registry) {
  // FNV-1a over every parameter's bytes, in registration order.
  std::uint64_t hash = 1469598103934665603ull;
  for (const Parameter& parameter : registry) {
    const Tensor host = parameter.value().to(Device::cpu());
    const auto* bytes = static_cast<const unsigned char*>(host.data());
    for (std::size_t i = 0; i < host.nbytes(); ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
  }
  Tensor mine = Tensor::zeros({1}, DType::i64);
  mine.data_as<std::int64_t>()[0] = static_cast<std::int64_t>(hash);
  Tensor all = Tensor::zeros({comm.size()}, DType::i64);
  comm.allgather_host(mine, all);
  for (int r = 0; r < comm.size(); ++r) {
    GRADSYNC_CHECK(all.data_as<std::int64_t>()[r] == mine.data_as<std::int64_t>()[0], "rank ", comm.rank(),
                   " and rank ", r, " hold different weights after training");
  }
}

}  // namespace gradsync::examples
