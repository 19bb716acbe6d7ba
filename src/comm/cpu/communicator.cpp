// The communicator over a CPU backend (MPI, Gloo): each operation's arguments are checked on the
// caller's thread, device tensors are swapped for pinned host stand-ins (staging.h), and
// the operation goes to the progress engine (engine.h), which runs it on the backend in
// submission order.
#include <functional>
#include <memory>
#include <string>

#include "backend.h"
#include "comm/collective.h"
#include "engine.h"
#include "staging.h"
#include "hierarchical.h"
#include "gradsync/kernels/ops.h"

namespace gradsync::comm {

namespace {

class CpuCommunicator final : public Communicator {
 public:
  CpuCommunicator(std::unique_ptr<Backend> backend, const CommOptions& options, const std::string& name)
      : engine_(std::make_shared<Engine>(std::move(backend), options, name)) {
    engine_->start();
  }

  ~CpuCommunicator() override { engine_->stop(); }

  int rank() const override { return engine_->backend().rank(); }
  int size() const override { return engine_->backend().size(); }
  const char* backend() const override { return engine_->backend().name(); }
  Device device_type() const override { return Device::cpu(); }
  std::string broken_reason() const override { return engine_->broken_reason(); }

  std::unique_ptr<Communicator> duplicate() override {
    // The new backend is made on the communication thread, in sequence with everything else.
    auto child = std::make_shared<std::unique_ptr<Backend>>();
    Backend& backend = engine_->backend();
    submit(Descriptor::of(OpKind::duplicate, DType::i64, 0), [&backend, child] { *child = backend.duplicate(); }, nullptr)
        ->wait();
    return std::make_unique<CpuCommunicator>(std::move(*child), engine_->options(), engine_->next_duplicate_name());
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    GRADSYNC_CHECK(color >= kNoColor, "split: rank ", rank(), "'s color ", color, " must be >= 0 (or kNoColor)");
    auto child = std::make_shared<std::unique_ptr<Backend>>();
    Backend& backend = engine_->backend();
    const int size = this->size();
    submit(Descriptor::of(OpKind::split, DType::i64, 2), [&backend, child, color, key, size] {
      // Every rank learns every (color, key) first: the groups and their orders are then the
      // same table everywhere, whatever the backend does with them.
      const std::int64_t mine[2] = {color, key};
      std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size));
      backend.allgather(mine, all.data(), 2, DType::i64);
      *child = backend.split(color, key, split_place(all, backend.rank()));
    }, nullptr)->wait();
    const std::string name = engine_->next_split_name(color);  // counted on every rank, member or not
    if (*child == nullptr) return nullptr;
    return std::make_unique<CpuCommunicator>(std::move(*child), engine_->options(), name);
  }

  // Every collective below works on host tensors; `staging` swaps each device tensor for a
  // pinned host view (staging.h), so the same bodies serve CUDA tensors.
  WorkHandle allreduce_async(Tensor& tensor, ReduceOp op) override {
    require_device(*this, "allreduce", tensor);
    require_reducible("allreduce", op, tensor);
    std::shared_ptr<Staging> staging;  // made only for a device tensor
    Tensor target = stage(staging, tensor, true, true);
    return submit(Descriptor::of(OpKind::allreduce, tensor.dtype(), tensor.numel(), -1, static_cast<std::int64_t>(op)),
                  [this, target, op]() mutable { reduce_in_place(target, op); }, std::move(staging));
  }

  WorkHandle broadcast_async(Tensor& tensor, int root) override {
    require_device(*this, "broadcast", tensor);
    require_rank(*this, "broadcast", root, "root");
    std::shared_ptr<Staging> staging;  // made only for a device tensor
    // Only the root's values travel; the others' are overwritten.
    Tensor target = stage(staging, tensor, rank() == root, rank() != root);
    Backend& backend = engine_->backend();
    return submit(Descriptor::of(OpKind::broadcast, tensor.dtype(), tensor.numel(), root),
                  [&backend, target, root] { backend.broadcast(target.data(), target.numel(), target.dtype(), root); },
                  std::move(staging));
  }

  WorkHandle allgather_async(const Tensor& input, Tensor& output) override {
    require_allgather(*this, input, output);
    std::shared_ptr<Staging> staging;  // made only for a device tensor
    Tensor in = stage(staging, input, true, false);
    Tensor out = stage(staging, output, false, true);
    Backend& backend = engine_->backend();
    return submit(Descriptor::of(OpKind::allgather, input.dtype(), input.numel()),
                  [&backend, in, out] { backend.allgather(in.data(), out.data(), in.numel(), in.dtype()); },
                  std::move(staging));
  }

  WorkHandle allgatherv_async(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts) override {
    const std::int64_t total = require_allgatherv(*this, input, output, counts);
    std::shared_ptr<Staging> staging;  // made only for a device tensor
    Tensor in = stage(staging, input, true, false);
    Tensor out = stage(staging, output, false, true);
    Backend& backend = engine_->backend();
    return submit(Descriptor::of(OpKind::allgatherv, input.dtype(), total),
                  [&backend, in, out, counts] { backend.allgatherv(in.data(), out.data(), counts, in.dtype()); },
                  std::move(staging));
  }

  WorkHandle reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) override {
    require_reduce_scatter(*this, input, output, op);
    std::shared_ptr<Staging> staging;  // made only for a device tensor
    Tensor in = stage(staging, input, true, false);
    Tensor out = stage(staging, output, false, true);
    return submit(Descriptor::of(OpKind::reduce_scatter, input.dtype(), input.numel(), -1, static_cast<std::int64_t>(op)),
                  [this, in, out, op]() mutable { reduce_scatter(in, out, op); },
                  std::move(staging));
  }

  WorkHandle allreduce_coalesced_async(std::vector<Tensor> tensors, ReduceOp op) override {
    const std::int64_t total = require_coalesced(*this, tensors, op);
    const DType dtype = tensors[0].dtype();
    std::shared_ptr<Staging> staging;  // made only for a device tensor
    std::vector<Tensor> targets;
    for (const Tensor& tensor : tensors) targets.push_back(stage(staging, tensor, true, true));
    return submit(Descriptor::of(OpKind::coalesced, dtype, total, -1, static_cast<std::int64_t>(op)),
                  [this, targets, total, dtype, op]() mutable {
                    // One flat buffer: one collective instead of one per tensor.
                    Tensor flat = Tensor::empty({total}, dtype);
                    std::int64_t offset = 0;
                    for (const Tensor& tensor : targets) {
                      flat.view(static_cast<std::size_t>(offset), {tensor.numel()}).copy_from(tensor.flatten());
                      offset += tensor.numel();
                    }
                    reduce_in_place(flat, op);
                    offset = 0;
                    for (Tensor& tensor : targets) {
                      tensor.flatten().copy_from(flat.view(static_cast<std::size_t>(offset), {tensor.numel()}));
                      offset += tensor.numel();
                    }
                  },
                  std::move(staging));
  }

  WorkHandle barrier_async() override {
    Backend& backend = engine_->backend();
    return submit(Descriptor::of(OpKind::barrier, DType::f32, 0), [&backend] { backend.barrier(); }, nullptr);
  }

  WorkHandle send_async(const Tensor& tensor, int peer, int tag) override {
    require_device(*this, "send", tensor);
    require_peer(*this, "send", peer);
    std::shared_ptr<Staging> staging;  // made only for a device tensor
    Tensor source = stage(staging, tensor, true, false);
    Backend& backend = engine_->backend();
    return submit_p2p("send", tensor, peer, tag,
                      [&backend, source, peer, tag] { backend.send(source.data(), source.nbytes(), peer, tag); },
                      std::move(staging));
  }

  WorkHandle recv_async(Tensor& tensor, int peer, int tag) override {
    require_device(*this, "recv", tensor);
    require_peer(*this, "recv", peer);
    std::shared_ptr<Staging> staging;  // made only for a device tensor
    Tensor target = stage(staging, tensor, false, true);
    Backend& backend = engine_->backend();
    return submit_p2p("recv", tensor, peer, tag,
                      [&backend, target, peer, tag] { backend.recv(target.data(), target.nbytes(), peer, tag); },
                      std::move(staging));
  }

 private:
  WorkHandle submit(const Descriptor& descriptor, std::function<void()> body, std::shared_ptr<Staging> staging) {
    if (staging == nullptr) return engine_->submit_collective(descriptor, std::move(body), nullptr);
    return engine_->submit_collective(descriptor, staged(std::move(body), staging, op_kind_name(descriptor.kind)),
                                      staging);
  }

  WorkHandle submit_p2p(const char* op, const Tensor& tensor, int peer, int tag, std::function<void()> body,
                        std::shared_ptr<Staging> staging) {
    if (staging == nullptr) return engine_->submit_p2p(op, tensor, peer, tag, std::move(body), nullptr);
    return engine_->submit_p2p(op, tensor, peer, tag, staged(std::move(body), staging, op), staging);
  }

  // avg never reaches a backend: it is a sum, then a division by the world size.
  static ReduceOp backend_op(ReduceOp op) { return op == ReduceOp::avg ? ReduceOp::sum : op; }
  void finish_average(Tensor& result, ReduceOp op) {
    if (op == ReduceOp::avg) ops::scale(result, 1.0 / size());
  }

  // Every reduction of this communicator goes through these two. In reproducible mode they add
  // in rank order over the backend's point-to-point messages (algorithms/ordered_reduce.h);
  // otherwise the backend picks its fastest algorithm.
  void reduce_in_place(Tensor& tensor, ReduceOp op) {
    Backend& backend = engine_->backend();
    if (engine_->reproducible()) {
      algorithms::ordered_allreduce(backend.begin_algorithm(), static_cast<std::byte*>(tensor.data()), tensor.numel(),
                                    tensor.dtype(), backend_op(op), engine_->ordered_algorithm());
    } else {
      backend.allreduce(tensor.data(), tensor.numel(), tensor.dtype(), backend_op(op));
    }
    finish_average(tensor, op);
  }

  void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) {
    Backend& backend = engine_->backend();
    if (engine_->reproducible()) {
      const std::size_t chunk = output.nbytes();
      std::vector<std::size_t> offsets;
      for (int c = 0; c <= size(); ++c) offsets.push_back(static_cast<std::size_t>(c) * chunk);
      algorithms::ordered_reduce_scatter(backend.begin_algorithm(), static_cast<const std::byte*>(input.data()),
                                         static_cast<std::byte*>(output.data()), offsets, input.dtype(), backend_op(op));
    } else {
      backend.reduce_scatter(input.data(), output.data(), output.numel(), input.dtype(), backend_op(op));
    }
    finish_average(output, op);
  }

  // Device tensors: the copies to the host start now; the body waits for them, then queues the
  // copies back (staging.h).
  std::function<void()> staged(std::function<void()> body, const std::shared_ptr<Staging>& staging, std::string what) {
    const std::string who = std::string("the ") + engine_->backend().name() + " communicator of rank " +
                            std::to_string(rank());
    return streams_.start(std::move(body), staging, std::move(what), who, engine_->timeout());
  }

  // Declared before engine_ so that they outlive it: the destructor stops the engine (its
  // thread queues copies on them) before any member goes.
  StagingStreams streams_;
  std::shared_ptr<Engine> engine_;
};

}  // namespace

std::unique_ptr<Communicator> make_cpu_communicator(std::unique_ptr<Backend> backend, const CommOptions& options) {
  return std::make_unique<CpuCommunicator>(with_hierarchy(std::move(backend), options), options, "");
}

void Communicator::allreduce(const Tensor& input, Tensor& output, ReduceOp op) {
  output.copy_from(input);
  allreduce(output, op);
}

}  // namespace gradsync::comm
