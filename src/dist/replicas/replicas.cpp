// Making and checking identical replicas (gradsync/dist/replicas/replicas.h).
#include "gradsync/dist/replicas/replicas.h"

#include <cstring>
#include <sstream>

#include <nlohmann/json.hpp>

namespace gradsync::dist {

namespace {

std::string describe(const Parameter& parameter, const std::string& name) {
  std::ostringstream text;
  text << "'" << name << "' " << dtype_name(parameter.dtype()) << "[";
  for (std::size_t d = 0; d < parameter.shape().size(); ++d) text << (d ? ", " : "") << parameter.shape()[d];
  text << "]" << (parameter.device().is_cpu() ? " on cpu" : " on cuda");
  if (parameter.grad_dtype() != parameter.dtype()) text << " with " << dtype_name(parameter.grad_dtype()) << " gradients";
  return text.str();
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::string line;
  std::istringstream in(text);
  while (std::getline(in, line)) lines.push_back(line);
  return lines;
}

Tensor words_of(const std::string& bytes) {
  const std::int64_t words = static_cast<std::int64_t>((bytes.size() + 3) / 4);
  Tensor packed = Tensor::zeros({words}, DType::i32);
  if (!bytes.empty()) std::memcpy(packed.data(), bytes.data(), bytes.size());
  return packed;
}

}  // namespace

std::string broadcast_bytes(comm::Communicator& comm, const std::string& bytes, int root) {
  Tensor length = Tensor::zeros({1}, DType::i64);
  length.data_as<std::int64_t>()[0] = static_cast<std::int64_t>(bytes.size());
  comm.broadcast_host(length, root);
  const auto size = static_cast<std::size_t>(length.data_as<std::int64_t>()[0]);
  Tensor packed = comm.rank() == root ? words_of(bytes) : Tensor::zeros({static_cast<std::int64_t>((size + 3) / 4)}, DType::i32);
  comm.broadcast_host(packed, root);
  return std::string(static_cast<const char*>(packed.data()), size);
}

void require_same_lines(comm::Communicator& comm, const std::vector<std::string>& lines, const std::string& who,
                        const std::string& what, const std::string& item) {
  if (comm.size() == 1) return;
  std::string mine;
  for (const std::string& line : lines) mine += line + "\n";

  // Everyone's description: lengths first, then the bytes (as i32 words).
  Tensor my_length = Tensor::zeros({1}, DType::i64);
  my_length.data_as<std::int64_t>()[0] = static_cast<std::int64_t>((mine.size() + 3) / 4);
  Tensor lengths = Tensor::zeros({comm.size()}, DType::i64);
  comm.allgather_host(my_length, lengths);
  std::vector<std::int64_t> counts(lengths.data_as<std::int64_t>(), lengths.data_as<std::int64_t>() + comm.size());
  std::int64_t total = 0;
  for (const std::int64_t count : counts) total += count;
  Tensor everyone = Tensor::zeros({total}, DType::i32);
  comm.allgatherv_host(words_of(mine), everyone, counts);

  const std::vector<std::string> my_lines = split_lines(mine);
  std::int64_t offset = 0;
  for (int other = 0; other < comm.size(); ++other) {
    const auto words = counts[static_cast<std::size_t>(other)];
    std::string theirs(reinterpret_cast<const char*>(everyone.data_as<std::int32_t>() + offset),
                       static_cast<std::size_t>(words) * 4);
    theirs.resize(std::strlen(theirs.c_str()));  // drop the zero padding
    offset += words;
    if (theirs == mine) continue;
    const std::vector<std::string> their_lines = split_lines(theirs);
    std::size_t first = 0;
    while (first < my_lines.size() && first < their_lines.size() && my_lines[first] == their_lines[first]) ++first;
    const auto absent = [&](std::size_t count) { return "absent (" + std::to_string(count) + " " + what + ")"; };
    std::ostringstream message;
    message << who << ": the ranks do not hold the same " << what << ". " << item << " #" << first << " is "
            << (first < my_lines.size() ? my_lines[first] : absent(my_lines.size())) << " on rank " << comm.rank()
            << " but " << (first < their_lines.size() ? their_lines[first] : absent(their_lines.size())) << " on rank "
            << other;
    throw Error(message.str());
  }
}

void require_same_parameters(comm::Communicator& comm, const std::vector<const Parameter*>& parameters,
                             const std::vector<std::string>& names, const std::string& who) {
  std::vector<std::string> lines;
  for (std::size_t i = 0; i < parameters.size(); ++i) lines.push_back(describe(*parameters[i], names[i]));
  require_same_lines(comm, lines, who, "parameters", "Parameter");
}

void require_same_optimizer(const optim::Optimizer& optimizer, comm::Communicator& comm, const std::string& who) {
  // The kind, then every group's members and hyperparameters, one line each.
  std::vector<std::string> lines{std::string("optimizer ") + optimizer.name() + " with " +
                                 std::to_string(optimizer.group_count()) + " group(s)"};
  for (std::size_t g = 0; g < optimizer.group_count(); ++g) {
    std::ostringstream line;
    line << "group " << g << " (" << optimizer.group_parameters(g).size() << " parameters):";
    line.precision(17);
    for (const auto& [name, value] : optimizer.hyperparameters(g)) line << " " << name << "=" << value;
    lines.push_back(line.str());
  }
  require_same_lines(comm, lines, who, "optimizer configuration");
}

void broadcast_parameters(ParameterRegistry& registry, comm::Communicator& comm, int root) {
  GRADSYNC_CHECK(registry.finalized(), "broadcast_parameters: finalize the registry first");
  std::vector<const Parameter*> all;
  std::vector<std::string> names;
  for (const Parameter& parameter : registry) {
    all.push_back(&parameter);
    names.push_back(parameter.name());
  }
  require_same_parameters(comm, all, names, "broadcast_parameters");
  for (const Arena& arena : registry.arenas()) {
    Tensor values = arena.values;  // one collective per arena: a few large messages
    comm.broadcast(values, root);
  }
}

void broadcast_state(comm::Communicator& comm, std::vector<io::NamedTensor>& tensors, io::Metadata& metadata, int root) {
  // One message describes the state (metadata, names, dtypes, shapes), one carries every
  // tensor's bytes.
  nlohmann::json description;
  if (comm.rank() == root) {
    description["metadata"] = metadata;
    description["tensors"] = nlohmann::json::array();
    for (const io::NamedTensor& tensor : tensors) {
      description["tensors"].push_back({tensor.name, dtype_safetensors_name(tensor.tensor.dtype()), tensor.tensor.shape()});
    }
  }
  description = nlohmann::json::parse(broadcast_bytes(comm, comm.rank() == root ? description.dump() : std::string(), root));
  const auto aligned = [](std::size_t bytes) { return (bytes + 7) / 8 * 8; };
  std::size_t total = 0;
  if (comm.rank() != root) {
    tensors.clear();
    for (const auto& entry : description["tensors"]) {
      const Shape shape = entry[2].get<Shape>();
      tensors.push_back({entry[0].get<std::string>(), Tensor::empty(shape, dtype_from_safetensors_name(entry[1].get<std::string>()))});
    }
    metadata = description["metadata"].get<io::Metadata>();
  }
  for (const io::NamedTensor& tensor : tensors) total += aligned(tensor.tensor.nbytes());
  Tensor packed = Tensor::zeros({static_cast<std::int64_t>(total / 8)}, DType::f64);  // 8-byte words
  char* bytes = static_cast<char*>(packed.data());
  std::size_t at = 0;
  for (const io::NamedTensor& tensor : tensors) {
    if (comm.rank() == root) {
      const Tensor host = tensor.tensor.device().is_cpu() ? tensor.tensor : tensor.tensor.to(Device::cpu());
      std::memcpy(bytes + at, host.data(), host.nbytes());
    }
    at += aligned(tensor.tensor.nbytes());
  }
  comm.broadcast_host(packed, root);
  if (comm.rank() == root) return;
  at = 0;
  for (io::NamedTensor& tensor : tensors) {
    std::memcpy(tensor.tensor.data(), bytes + at, tensor.tensor.nbytes());
    at += aligned(tensor.tensor.nbytes());
  }
}

void broadcast_optimizer_state(optim::Optimizer& optimizer, comm::Communicator& comm, int root) {
  // The state travels as the contents of the optimizer's own checkpoint (state_tensors and
  // state_metadata), so load_state validates it exactly as it validates a file.
  std::vector<io::NamedTensor> tensors;
  io::Metadata metadata;
  if (comm.rank() == root) {
    tensors = optimizer.state_tensors();
    metadata = optimizer.state_metadata();
  }
  broadcast_state(comm, tensors, metadata, root);
  if (comm.rank() == root) return;
  optimizer.load_state(tensors, metadata,
                       "rank " + std::to_string(root) + "'s optimizer state (broadcast_optimizer_state)");
}

}  // namespace gradsync::dist
