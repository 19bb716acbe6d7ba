// What every communicator shares (collective.h): the argument checks, the descriptors, and the
// resolution of timeouts.
#include "collective.h"

#include <sstream>

#include "core/environment.h"
#include "core/staging.h"

namespace gradsync::comm {

// The timeouts every communicator resolves the same way (communicator.h).
std::chrono::milliseconds resolve_timeout(std::chrono::milliseconds requested) {
  if (requested.count() > 0) return requested;
  return environment::timeout().value_or(std::chrono::milliseconds(300000));
}

std::chrono::milliseconds resolve_rendezvous_timeout(std::chrono::milliseconds requested,
                                                     std::chrono::milliseconds operation_timeout) {
  if (requested.count() > 0) return requested;
  return environment::rendezvous_timeout().value_or(resolve_timeout(operation_timeout));
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::min: return "min";
    case ReduceOp::max: return "max";
    case ReduceOp::prod: return "prod";
  }
  return "?";
}

const char* op_kind_name(std::int64_t kind) {
  switch (static_cast<OpKind>(kind)) {
    case OpKind::allreduce: return "allreduce";
    case OpKind::broadcast: return "broadcast";
    case OpKind::allgather: return "allgather";
    case OpKind::allgatherv: return "allgatherv";
    case OpKind::reduce_scatter: return "reduce_scatter";
    case OpKind::coalesced: return "allreduce_coalesced";
    case OpKind::barrier: return "barrier";
    case OpKind::duplicate: return "duplicate";
    case OpKind::split: return "split";
  }
  return "?";
}

std::string Descriptor::str() const {
  std::ostringstream text;
  text << op_kind_name(kind) << " #" << seq;
  if (op >= 0) text << " (" << reduce_op_name(static_cast<ReduceOp>(op)) << ")";
  if (root >= 0) text << " root " << root;
  text << ", " << dtype_name(static_cast<DType>(dtype)) << " x " << count;
  return text.str();
}

std::int64_t Descriptor::fingerprint() const {
  // FNV-1a over the six words, folded to 62 bits so that -fingerprint never overflows.
  std::uint64_t hash = 1469598103934665603ull;
  for (const std::int64_t word : {seq, kind, dtype, count, root, op}) {
    for (int byte = 0; byte < 8; ++byte) {
      hash ^= (static_cast<std::uint64_t>(word) >> (8 * byte)) & 0xffu;
      hash *= 1099511628211ull;
    }
  }
  return static_cast<std::int64_t>(hash >> 2);
}

SplitPlace split_place(const std::vector<std::int64_t>& colors_and_keys, int my_rank) {
  const std::int64_t color = colors_and_keys[2 * static_cast<std::size_t>(my_rank)];
  if (color < 0) return {};
  std::vector<std::pair<std::int64_t, int>> group;  // (key, old rank) of every rank with this color
  for (std::size_t r = 0; 2 * r < colors_and_keys.size(); ++r) {
    if (colors_and_keys[2 * r] == color) group.emplace_back(colors_and_keys[2 * r + 1], static_cast<int>(r));
  }
  std::sort(group.begin(), group.end());
  SplitPlace place{0, static_cast<int>(group.size()), {}};
  for (const auto& member : group) place.members.push_back(member.second);
  while (place.members[static_cast<std::size_t>(place.rank)] != my_rank) ++place.rank;
  return place;
}

void require_agreement(const Descriptor& mine, const std::vector<Descriptor>& all, int my_rank) {
  for (std::size_t other = 0; other < all.size(); ++other) {
    if (!(all[other] == mine)) {
      detail::throw_error("collective mismatch: this rank (", my_rank, ") runs ", mine.str(), ", rank ", other,
                          " runs ", all[other].str());
    }
  }
}

void require_device(const Communicator& comm, const char* op, const Tensor& tensor) {
  GRADSYNC_CHECK(tensor.defined(), op, ": empty tensor handle");
  // A CPU communicator takes host tensors, and device tensors staged through pinned host
  // memory (comm/cpu/staging.cpp); NCCL takes tensors on its own GPU only.
  if (comm.device_type().is_cpu()) return;
  GRADSYNC_CHECK(tensor.device() == comm.device_type(), op, ": the ", comm.backend(), " communicator of rank ",
                 comm.rank(), " handles tensors on ", comm.device_type().str(), ", got ", tensor.describe(),
                 tensor.device().is_cpu() ? " (CPU tensors go through the MPI or Gloo backend)" : "");
}

void require_same_device(const char* op, const Tensor& a, const Tensor& b) {
  GRADSYNC_CHECK(a.device() == b.device(), op, ": input and output must be on one device, got ", a.describe(), " and ",
                 b.describe());
}

void require_rank(const Communicator& comm, const char* op, int value, const char* what) {
  GRADSYNC_CHECK(value >= 0 && value < comm.size(), op, ": ", what, " ", value, " is not a rank of this ", comm.size(),
                 "-rank communicator");
}

void require_peer(const Communicator& comm, const char* op, int peer) {
  require_rank(comm, op, peer, "peer");
  GRADSYNC_CHECK(peer != comm.rank(), op, ": rank ", comm.rank(), " cannot exchange with itself");
}

void require_reducible(const char* op, ReduceOp reduce, const Tensor& tensor) {
  GRADSYNC_CHECK(reduce != ReduceOp::avg || is_floating(tensor.dtype()), op, ": avg of ", tensor.describe(),
                 " is not defined for integers (use sum)");
}

void require_allgather(const Communicator& comm, const Tensor& input, const Tensor& output) {
  require_device(comm, "allgather", input);
  require_device(comm, "allgather", output);
  require_same_device("allgather", input, output);
  GRADSYNC_CHECK(input.dtype() == output.dtype() && output.numel() == input.numel() * comm.size(), "allgather: output ",
                 output.describe(), " must hold ", comm.size(), " x ", input.describe());
}

std::int64_t require_allgatherv(const Communicator& comm, const Tensor& input, const Tensor& output,
                                const std::vector<std::int64_t>& counts) {
  require_device(comm, "allgatherv", input);
  require_device(comm, "allgatherv", output);
  require_same_device("allgatherv", input, output);
  const auto me = static_cast<std::size_t>(comm.rank());
  GRADSYNC_CHECK(static_cast<int>(counts.size()) == comm.size(), "allgatherv: ", counts.size(), " counts for ",
                 comm.size(), " ranks");
  GRADSYNC_CHECK(counts[me] == input.numel(), "allgatherv: counts[", comm.rank(), "] = ", counts[me],
                 " but this rank's input is ", input.describe());
  std::int64_t total = 0;
  for (const std::int64_t count : counts) {
    GRADSYNC_CHECK(count >= 0, "allgatherv: negative count ", count);
    total += count;
  }
  GRADSYNC_CHECK(input.dtype() == output.dtype() && output.numel() == total, "allgatherv: output ", output.describe(),
                 " must hold ", total, " elements of ", dtype_name(input.dtype()));
  return total;
}

void require_reduce_scatter(const Communicator& comm, const Tensor& input, const Tensor& output, ReduceOp op) {
  require_device(comm, "reduce_scatter", input);
  require_device(comm, "reduce_scatter", output);
  require_same_device("reduce_scatter", input, output);
  GRADSYNC_CHECK(input.dtype() == output.dtype() && input.numel() == output.numel() * comm.size(),
                 "reduce_scatter: input ", input.describe(), " must hold ", comm.size(), " x ", output.describe());
  require_reducible("reduce_scatter", op, input);
}

std::int64_t require_coalesced(const Communicator& comm, const std::vector<Tensor>& tensors, ReduceOp op) {
  GRADSYNC_CHECK(!tensors.empty(), "allreduce_coalesced: no tensors");
  std::int64_t total = 0;
  for (const Tensor& tensor : tensors) {
    require_device(comm, "allreduce_coalesced", tensor);
    GRADSYNC_CHECK(tensor.dtype() == tensors[0].dtype(), "allreduce_coalesced: mixed dtypes ", tensors[0].describe(),
                   " and ", tensor.describe());
    require_same_device("allreduce_coalesced", tensors[0], tensor);
    total += tensor.numel();
  }
  require_reducible("allreduce_coalesced", op, tensors[0]);
  return total;
}

std::string describe_p2p(const char* op, std::int64_t sequence, const Tensor& tensor, int peer, int tag) {
  std::ostringstream text;
  text << op << " p2p#" << sequence << " (" << (std::string(op) == "send" ? "to" : "from") << " rank " << peer
       << ", tag " << tag << ", " << dtype_name(tensor.dtype()) << " x " << tensor.numel() << ")";
  return text.str();
}

// ---- Control-plane collectives on host tensors ---------------------------------------------

namespace {

void require_host_tensor(const char* op, const Tensor& tensor) {
  GRADSYNC_CHECK(tensor.defined() && tensor.device().is_cpu(), op, ": expects a host tensor, got ",
                 tensor.defined() ? tensor.describe() : std::string("an empty handle"));
}

// A host tensor's stand-in on the device: a pooled device buffer (no cudaMalloc/cudaFree per
// control collective: cudaFree synchronises the whole device), seen as a tensor.
struct DeviceStage {
  DeviceStage(const Tensor& like, Device device)
      : buffer(detail::lease_device(like.nbytes(), device)),
        tensor(Tensor::wrap(buffer.data(), like.shape(), like.dtype(), device)) {}
  detail::PooledBuffer buffer;
  Tensor tensor;
};

// The Work of a staged allreduce: waits for the device operation, then copies the result back.
// The stage goes back to the pool only once the operation is over, waited for or not.
class StagedWork final : public Work {
 public:
  StagedWork(WorkHandle inner, std::unique_ptr<DeviceStage> stage, Tensor host)
      : inner_(std::move(inner)), stage_(std::move(stage)), host_(std::move(host)) {}
  ~StagedWork() override {
    if (copied_) return;
    try {
      inner_->wait();
    } catch (const std::exception&) {
      // Failed or lost: the communicator is aborted, nothing runs on the buffer any more.
    }
  }
  bool is_completed() const override { return inner_->is_completed(); }
  void wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);
    if (!copied_) {
      host_.copy_from(stage_->tensor);
      copied_ = true;
    }
  }
  const std::string& description() const override { return inner_->description(); }

 private:
  WorkHandle inner_;
  std::unique_ptr<DeviceStage> stage_;
  Tensor host_;
  bool copied_ = false;
};

}  // namespace

namespace {
thread_local bool caller_waits = false;
}  // namespace

CallerWaits::CallerWaits() : previous_(caller_waits) { caller_waits = true; }
CallerWaits::~CallerWaits() { caller_waits = previous_; }
bool CallerWaits::take() {
  const bool waiting = caller_waits;
  caller_waits = false;
  return waiting;
}

WorkHandle Communicator::allreduce_host_async(Tensor& host, ReduceOp op) {
  require_host_tensor("allreduce_host", host);
  if (device_type().is_cpu()) return allreduce_async(host, op);
  auto stage = std::make_unique<DeviceStage>(host, device_type());
  stage->tensor.copy_from(host);
  WorkHandle inner = allreduce_async(stage->tensor, op);
  return std::make_shared<StagedWork>(std::move(inner), std::move(stage), host);
}

void Communicator::broadcast_host(Tensor& host, int root) {
  require_host_tensor("broadcast_host", host);
  if (device_type().is_cpu()) return broadcast(host, root);
  DeviceStage stage(host, device_type());
  stage.tensor.copy_from(host);
  broadcast(stage.tensor, root);
  host.copy_from(stage.tensor);
}

void Communicator::allgather_host(const Tensor& input, Tensor& output) {
  require_host_tensor("allgather_host", input);
  require_host_tensor("allgather_host", output);
  if (device_type().is_cpu()) return allgather(input, output);
  DeviceStage staged_input(input, device_type());
  DeviceStage staged_output(output, device_type());
  staged_input.tensor.copy_from(input);
  allgather(staged_input.tensor, staged_output.tensor);
  output.copy_from(staged_output.tensor);
}

void Communicator::allgatherv_host(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts) {
  require_host_tensor("allgatherv_host", input);
  require_host_tensor("allgatherv_host", output);
  if (device_type().is_cpu()) return allgatherv(input, output, counts);
  DeviceStage staged_input(input, device_type());
  DeviceStage staged_output(output, device_type());
  staged_input.tensor.copy_from(input);
  allgatherv(staged_input.tensor, staged_output.tensor, counts);
  output.copy_from(staged_output.tensor);
}

std::unique_ptr<Communicator> Communicator::split(int, int) {
  detail::throw_error("split: the ", backend(), " communicator of rank ", rank(),
                      " cannot make sub-communicators yet (Gloo and MPI can)");
}

}  // namespace gradsync::comm
