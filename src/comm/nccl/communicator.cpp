// The NCCL communicator: CUDA tensors, one GPU per rank (gradsync/comm/nccl/nccl.h).
//
// Each operation: check the arguments (collective.h, shared with the CPU communicators),
// record an event on the caller's stream, make our communication stream wait for it, queue
// the NCCL call on the communication stream, record a completion event. Work::wait polls that
// event together with ncclCommGetAsyncError, and aborts the communicator on timeout or error.
// The communicator is non-blocking (ncclConfig_t::blocking = 0): a call may answer
// ncclInProgress, and `settle` polls until NCCL has accepted it, under the same timeout, so
// that not even initialization can block forever.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdlib>
#include <mutex>
#include <sstream>
#include <thread>

#include "comm/collective.h"
#include "core/environment.h"
#include "core/cuda_check.h"
#include "core/staging.h"
#include "gradsync/core/stream.h"
#include "comm/records/flight_recorder.h"
#include "comm/records/operation_ledger.h"
#include "gradsync/comm/connect.h"
#include "gradsync/comm/nccl/nccl.h"
#include "gradsync/core/device.h"

namespace gradsync::comm {

namespace {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;  // native since NCCL 2.10: no separate division
    case ReduceOp::min: return ncclMin;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::prod: return ncclProd;
  }
  return ncclSum;
}

// A CUDA event, shared by a Work and the ledger's completion query of it.
class Event {
 public:
  Event() { GRADSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Shared by the communicator and its Work handles: the NCCL communicator, its stream, and
// the ledger of operations in flight (comm/records/operation_ledger.h), which owns the broken state and
// aborts the communicator on the first failure, whoever sees it.
class NcclState {
 public:
  NcclState(int rank, int size, int device, std::chrono::milliseconds timeout, const std::string& name)
      : rank_(rank), size_(size), device_(device), timeout_(timeout),
        recorder_(FlightRecorder::create(name, rank, size, "nccl")), ledger_("nccl", [this] {
          // Under the ledger's lock: no launch is using the handle.
          if (comm_ != nullptr) ncclCommAbort(comm_);
          comm_ = nullptr;
        }) {}

  ~NcclState() {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    if (comm_ != nullptr) {
      // Finalize flushes outstanding work; if it fails or does not settle in time, abort.
      ncclResult_t state = ncclCommFinalize(comm_);
      const auto start = std::chrono::steady_clock::now();
      while (state == ncclInProgress && std::chrono::steady_clock::now() - start < timeout_) {
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
        std::this_thread::yield();
      }
      if (state == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    if (caller_ready_ != nullptr) cudaEventDestroy(caller_ready_);
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);  // scratch_ goes back to the pool: nothing may still use it
      cudaStreamDestroy(stream_);
    }
    cudaSetDevice(previous);
  }

  void check(ncclResult_t result, const std::string& what) {
    if (result == ncclSuccess) return;
    if (result == ncclInProgress) return settle(what);
    std::lock_guard<std::recursive_mutex> lock(ledger_.mutex());
    fail(what + " failed: " + ncclGetErrorString(result) + " (" + ncclGetLastError(comm_) + ")");
  }

  // NCCL's asynchronous error state, read under the lock that the abort runs under, so the
  // handle can never be used after another thread aborted and cleared it.
  ncclResult_t async_error(const std::string& what) {
    std::lock_guard<std::recursive_mutex> lock(ledger_.mutex());
    if (comm_ == nullptr) fail(what + ": the communicator was aborted by an earlier failure: " + ledger_.broken_reason());
    ncclResult_t state = ncclSuccess;
    const ncclResult_t query = ncclCommGetAsyncError(comm_, &state);
    if (query != ncclSuccess) fail(what + ": ncclCommGetAsyncError failed: " + ncclGetErrorString(query));
    return state;
  }

  // Polls until NCCL has finished accepting the last call (non-blocking mode), or the timeout.
  void settle(const std::string& what) {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      const ncclResult_t state = async_error(what);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) fail(what + " failed asynchronously: " + ncclGetErrorString(state));
      if (std::chrono::steady_clock::now() - start > timeout_) {
        fail(what + " was not accepted by NCCL within " + std::to_string(timeout_.count()) + " ms");
      }
      std::this_thread::yield();
    }
  }

  // A newly queued operation, done when `event` (recorded after it) completes.
  std::shared_ptr<OperationLedger::Operation> track(const std::string& what, std::shared_ptr<Event> event) {
    return ledger_.track(what, [event, device = device_] {
      detail::CudaDeviceGuard current(device);  // whichever thread asks
      return cudaEventQuery(event->get()) == cudaSuccess;
    });
  }

  // Waits for a tracked operation: polls its event and NCCL's asynchronous error state;
  // aborts the communicator on timeout or error. Succeeds only for data actually reduced.
  void wait(OperationLedger::Operation& operation, const Event& event, std::chrono::milliseconds timeout) {
    const std::string& what = operation.description();
    ledger_.wait(operation, timeout.count() > 0 ? timeout : timeout_, [&] {
      const cudaError_t status = cudaEventQuery(event.get());
      if (status != cudaSuccess && status != cudaErrorNotReady) {
        fail(what + ": CUDA reported " + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
      }
      const ncclResult_t state = async_error(what);
      if (state != ncclSuccess && state != ncclInProgress) {
        fail(what + " failed asynchronously: " + ncclGetErrorString(state));
      }
    });
  }

  // Marks the communicator broken, settles the verdict of every operation in flight, aborts
  // it (so that GPU kernels waiting for peers end and no rank blocks forever), and throws.
  // The first failure dumps the flight record (when asked to), and the error says where.
  [[noreturn]] void fail(const std::string& message) { ledger_.fail(message + recorder_->on_failure(message)); }
  void require_usable(const std::string& what) { ledger_.require_usable(what); }
  OperationLedger& ledger() { return ledger_; }

  int rank_;
  int size_;
  int device_;
  std::chrono::milliseconds timeout_;
  ncclComm_t comm_ = nullptr;  // used only under ledger_.mutex(); the abort clears it
  cudaStream_t stream_ = nullptr;
  cudaEvent_t caller_ready_ = nullptr;  // reused for every launch's ordering after the caller
  detail::PooledBuffer scratch_;        // barrier and agreement-check payloads
  std::shared_ptr<FlightRecorder> recorder_;  // an operation starts when queued: the GPU runs it in order

 private:
  OperationLedger ledger_;
};

class NcclWork final : public Work {
 public:
  explicit NcclWork(std::shared_ptr<NcclState> state) : state_(std::move(state)), done_(std::make_shared<Event>()) {}

  // Called once the event is recorded after the operation.
  void track(const std::string& description, std::int64_t record) {
    operation_ = state_->track(description, done_);
    record_ = record;
  }
  cudaEvent_t event() const { return done_->get(); }

  // Completed: the data was reduced, or the operation was lost to an abort (wait() throws).
  bool is_completed() const override {
    const OperationLedger::Verdict verdict = state_->ledger().poll(*operation_);
    if (verdict == OperationLedger::Verdict::succeeded) state_->recorder_->completed(record_);
    return verdict != OperationLedger::Verdict::pending;
  }
  void wait(std::chrono::milliseconds timeout) override {
    try {
      state_->wait(*operation_, *done_, timeout);
    } catch (const std::exception& error) {
      state_->recorder_->failed(record_, error.what(), /*timed_out=*/false);
      throw;
    }
    state_->recorder_->completed(record_);
  }
  const std::string& description() const override { return operation_->description(); }

 private:
  std::shared_ptr<NcclState> state_;
  std::shared_ptr<Event> done_;
  std::shared_ptr<OperationLedger::Operation> operation_;
  std::int64_t record_ = -1;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Communicator& bootstrap, const CommOptions& options, int device)
      : state_(std::make_shared<NcclState>(bootstrap.rank(), bootstrap.size(), device, resolve_timeout(options.timeout),
                                           "")) {
    check_agreement_ = options.check_agreement || environment::debug_collectives();
    // NCCL picks its rings, trees and channel counts per call: the order it adds in is not ours
    // to fix. Saying so beats silently giving up the bitwise guarantee.
    GRADSYNC_CHECK(!options.reproducible && !environment::reproducible(), "rank ", bootstrap.rank(),
                   ": reproducible mode (CommOptions::reproducible, GRADSYNC_REPRODUCIBLE) needs a CPU communicator "
                   "(Gloo or MPI): NCCL does not fix the order in which it adds the ranks' values");
    DeviceGuard guard(device);

    // Rank 0 creates the id; the bootstrap communicator carries it to everyone.
    ncclUniqueId id{};
    if (bootstrap.rank() == 0) {
      const ncclResult_t result = ncclGetUniqueId(&id);
      GRADSYNC_CHECK(result == ncclSuccess, "ncclGetUniqueId failed: ", ncclGetErrorString(result));
    }
    static_assert(sizeof(ncclUniqueId) % sizeof(std::int32_t) == 0);
    Tensor id_words = Tensor::wrap(&id, {static_cast<std::int64_t>(sizeof(id) / sizeof(std::int32_t))}, DType::i32);
    bootstrap.broadcast(id_words, 0);

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t result = ncclCommInitRankConfig(&state_->comm_, state_->size_, id, state_->rank_, &config);
    if (result != ncclSuccess && result != ncclInProgress) {
      detail::throw_error("ncclCommInitRankConfig (rank ", state_->rank_, " of ", state_->size_, ", cuda:", device,
                          ") failed: ", ncclGetErrorString(result));
    }
    state_->settle("ncclCommInitRankConfig (rank " + std::to_string(state_->rank_) + " of " +
                   std::to_string(state_->size_) + ")");
    create_stream_and_buffers();
  }

  // A communicator over a handle ncclCommSplit made (duplicate()).
  NcclCommunicator(std::shared_ptr<NcclState> state, bool check_agreement)
      : state_(std::move(state)), check_agreement_(check_agreement) {
    create_stream_and_buffers();
  }

  // ncclCommSplit with one color: the same ranks, its own NCCL communicator and stream.
  std::unique_ptr<Communicator> duplicate() override {
    std::lock_guard<std::mutex> lock(launch_mutex_);
    const std::string what = "ncclCommSplit (duplicate #" + std::to_string(duplicates_++) + ")";
    return split_as(0, state_->rank_, SplitPlace{state_->rank_, state_->size_, {}}, what,
                    state_->recorder_->name() + "/" + std::to_string(duplicates_));
  }

  // ncclCommSplit. Every rank first learns every (color, key), as on the CPU backends: the
  // group's places (split_place) are then known before NCCL makes it, and checked against it.
  std::unique_ptr<Communicator> split(int color, int key) override {
    GRADSYNC_CHECK(color >= kNoColor, "split: rank ", rank(), "'s color ", color, " must be >= 0 (or kNoColor)");
    Tensor mine = Tensor::empty({2}, DType::i64);
    mine.data_as<std::int64_t>()[0] = color;
    mine.data_as<std::int64_t>()[1] = key;
    Tensor all = Tensor::empty({2 * static_cast<std::int64_t>(size())}, DType::i64);
    allgather_host(mine, all);
    const std::vector<std::int64_t> table(all.data_as<std::int64_t>(), all.data_as<std::int64_t>() + all.numel());
    std::lock_guard<std::mutex> lock(launch_mutex_);
    const std::string what = "ncclCommSplit (split #" + std::to_string(splits_) + ", color " + std::to_string(color) + ")";
    return split_as(color, key, split_place(table, rank()), what,
                    state_->recorder_->name() + "/split" + std::to_string(splits_++) + "." + std::to_string(color));
  }

  std::string broken_reason() const override { return state_->ledger().broken_reason(); }

  int rank() const override { return state_->rank_; }
  int size() const override { return state_->size_; }
  const char* backend() const override { return "nccl"; }
  Device device_type() const override { return Device::cuda(state_->device_); }

  WorkHandle allreduce_async(Tensor& tensor, ReduceOp op) override {
    require_device(*this, "allreduce", tensor);
    require_reducible("allreduce", op, tensor);
    return launch(Descriptor::of(OpKind::allreduce, tensor.dtype(), tensor.numel(), -1, static_cast<std::int64_t>(op)),
                  [&](const std::string& what) {
                    state_->check(ncclAllReduce(tensor.data(), tensor.data(), static_cast<size_t>(tensor.numel()),
                                                nccl_type(tensor.dtype()), nccl_op(op), state_->comm_, state_->stream_),
                                  what);
                  });
  }

  WorkHandle broadcast_async(Tensor& tensor, int root) override {
    require_device(*this, "broadcast", tensor);
    require_rank(*this, "broadcast", root, "root");
    return launch(Descriptor::of(OpKind::broadcast, tensor.dtype(), tensor.numel(), root), [&](const std::string& what) {
      state_->check(ncclBroadcast(tensor.data(), tensor.data(), static_cast<size_t>(tensor.numel()),
                                  nccl_type(tensor.dtype()), root, state_->comm_, state_->stream_),
                    what);
    });
  }

  WorkHandle allgather_async(const Tensor& input, Tensor& output) override {
    require_allgather(*this, input, output);
    return launch(Descriptor::of(OpKind::allgather, input.dtype(), input.numel()), [&](const std::string& what) {
      state_->check(ncclAllGather(input.data(), output.data(), static_cast<size_t>(input.numel()),
                                  nccl_type(input.dtype()), state_->comm_, state_->stream_),
                    what);
    });
  }

  WorkHandle allgatherv_async(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts) override {
    const std::int64_t total = require_allgatherv(*this, input, output, counts);
    // NCCL has no allgatherv: one broadcast per rank into its slice, grouped into one launch.
    return launch(Descriptor::of(OpKind::allgatherv, input.dtype(), total), [&](const std::string& what) {
      const std::size_t element = dtype_size(input.dtype());
      state_->check(ncclGroupStart(), what);
      std::size_t offset = 0;
      for (int root = 0; root < size(); ++root) {
        const auto count = static_cast<std::size_t>(counts[static_cast<std::size_t>(root)]);
        void* slice = static_cast<char*>(output.data()) + offset * element;
        state_->check(ncclBroadcast(root == rank() ? input.data() : slice, slice, count, nccl_type(input.dtype()), root,
                                    state_->comm_, state_->stream_),
                      what);
        offset += count;
      }
      state_->check(ncclGroupEnd(), what);
    });
  }

  WorkHandle reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) override {
    require_reduce_scatter(*this, input, output, op);
    return launch(Descriptor::of(OpKind::reduce_scatter, input.dtype(), input.numel(), -1, static_cast<std::int64_t>(op)),
                  [&](const std::string& what) {
                    state_->check(ncclReduceScatter(input.data(), output.data(), static_cast<size_t>(output.numel()),
                                                    nccl_type(input.dtype()), nccl_op(op), state_->comm_, state_->stream_),
                                  what);
                  });
  }

  WorkHandle allreduce_coalesced_async(std::vector<Tensor> tensors, ReduceOp op) override {
    const std::int64_t total = require_coalesced(*this, tensors, op);
    // NCCL fuses the calls of a group into one launch: no flat copy is needed.
    return launch(Descriptor::of(OpKind::coalesced, tensors[0].dtype(), total, -1, static_cast<std::int64_t>(op)),
                  [&](const std::string& what) {
                    state_->check(ncclGroupStart(), what);
                    for (Tensor& tensor : tensors) {
                      state_->check(ncclAllReduce(tensor.data(), tensor.data(), static_cast<size_t>(tensor.numel()),
                                                  nccl_type(tensor.dtype()), nccl_op(op), state_->comm_, state_->stream_),
                                    what);
                    }
                    state_->check(ncclGroupEnd(), what);
                  });
  }

  WorkHandle barrier_async() override {
    return launch(Descriptor::of(OpKind::barrier, DType::f32, 0), [&](const std::string& what) {
      state_->check(ncclAllReduce(state_->scratch_.data(), state_->scratch_.data(), 1, ncclInt32, ncclSum, state_->comm_, state_->stream_),
                    what);
    });
  }

  // NCCL matches point-to-point calls in order per peer; it has no tags, so `tag` only names
  // the operation in messages.
  WorkHandle send_async(const Tensor& tensor, int peer, int tag) override {
    require_device(*this, "send", tensor);
    require_peer(*this, "send", peer);
    return launch_p2p([&](std::int64_t sequence) { return describe_p2p("send", sequence, tensor, peer, tag); },
                      [&](const std::string& what) {
      state_->check(ncclSend(tensor.data(), tensor.nbytes(), ncclInt8, peer, state_->comm_, state_->stream_), what);
    });
  }

  WorkHandle recv_async(Tensor& tensor, int peer, int tag) override {
    require_device(*this, "recv", tensor);
    require_peer(*this, "recv", peer);
    return launch_p2p([&](std::int64_t sequence) { return describe_p2p("recv", sequence, tensor, peer, tag); },
                      [&](const std::string& what) {
      state_->check(ncclRecv(tensor.data(), tensor.nbytes(), ncclInt8, peer, state_->comm_, state_->stream_), what);
    });
  }

 private:
  using DeviceGuard = detail::CudaDeviceGuard;  // our GPU current for one launch

  // The communicator of this rank's group at `place` (nullptr for kNoColor, after taking part:
  // ncclCommSplit is collective over every rank). Called under launch_mutex_.
  std::unique_ptr<Communicator> split_as(int color, int key, const SplitPlace& place, const std::string& what,
                                         const std::string& name) {
    auto child = std::make_shared<NcclState>(place.rank, place.size, state_->device_, state_->timeout_, name);
    {
      std::lock_guard<std::recursive_mutex> state_lock(state_->ledger().mutex());
      state_->require_usable(what);
      DeviceGuard device(state_->device_);
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      state_->check(ncclCommSplit(state_->comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child->comm_, &config),
                    what);
    }
    if (color < 0) return nullptr;
    child->settle(what);
    int nccl_rank = -1;
    int nccl_size = 0;
    child->check(ncclCommUserRank(child->comm_, &nccl_rank), what);
    child->check(ncclCommCount(child->comm_, &nccl_size), what);
    GRADSYNC_CHECK(nccl_rank == place.rank && nccl_size == place.size, what, ": NCCL placed rank ", rank(), " at ",
                   nccl_rank, " of ", nccl_size, ", the split's table at ", place.rank, " of ", place.size);
    return std::make_unique<NcclCommunicator>(std::move(child), check_agreement_);
  }

  template <typename Enqueue>
  WorkHandle launch(Descriptor descriptor, Enqueue&& enqueue) {
    std::lock_guard<std::mutex> lock(launch_mutex_);
    descriptor.seq = collective_sequence_++;
    const std::string what = descriptor.str();
    // Held while NCCL reads the handle: a concurrent abort waits for the enqueue to finish.
    std::lock_guard<std::recursive_mutex> state_lock(state_->ledger().mutex());
    state_->require_usable(what);
    DeviceGuard device(state_->device_);
    order_after_caller();
    if (check_agreement_) check_agreement(descriptor, what);
    const std::int64_t record = state_->recorder_->issued({.collective = descriptor});
    state_->recorder_->started(record);
    if (descriptor.count > 0 || descriptor.kind == static_cast<std::int64_t>(OpKind::barrier)) enqueue(what);
    return finish(what, record);
  }

  // `name(sequence)` describes the operation; the sequence number is taken under the lock.
  template <typename Name, typename Enqueue>
  WorkHandle launch_p2p(Name&& name, Enqueue&& enqueue) {
    std::lock_guard<std::mutex> lock(launch_mutex_);
    const std::string what = name(p2p_sequence_++);
    std::lock_guard<std::recursive_mutex> state_lock(state_->ledger().mutex());
    state_->require_usable(what);
    DeviceGuard device(state_->device_);
    order_after_caller();
    const std::int64_t record = state_->recorder_->issued({.collective = {p2p_sequence_ - 1, 0, 0, 0, -1, -1}, .p2p = "p2p"});
    state_->recorder_->started(record);
    enqueue(what);
    return finish(what, record);
  }

  void create_stream_and_buffers() {
    DeviceGuard device(state_->device_);
    GRADSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&state_->stream_, cudaStreamNonBlocking));
    GRADSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&state_->caller_ready_, cudaEventDisableTiming));
    state_->scratch_ =
        detail::lease_device(sizeof(Descriptor) * static_cast<std::size_t>(state_->size_ + 1), Device::cuda(state_->device_));
  }

  // The communication stream waits for everything the caller queued so far on its current
  // stream (gradsync/core/stream.h: the engine's own, or the legacy default stream where
  // gradsync's kernels write gradients by default) before this operation. One event, reused:
  // a wait captures the event's state when it is queued.
  void order_after_caller() {
    auto* caller = static_cast<cudaStream_t>(current_cuda_stream(Device::cuda(state_->device_)));
    GRADSYNC_CUDA_CHECK(cudaEventRecord(state_->caller_ready_, caller != nullptr ? caller : cudaStreamLegacy));
    GRADSYNC_CUDA_CHECK(cudaStreamWaitEvent(state_->stream_, state_->caller_ready_, 0));
  }

  WorkHandle finish(const std::string& what, std::int64_t record) {
    auto work = std::make_shared<NcclWork>(state_);
    GRADSYNC_CUDA_CHECK(cudaEventRecord(work->event(), state_->stream_));
    work->track(what, record);
    return work;
  }

  // Debug mode: an allgather of every rank's descriptor, read back on the host.
  void check_agreement(const Descriptor& mine, const std::string& what) {
    auto* device_words = static_cast<Descriptor*>(state_->scratch_.data());
    GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(device_words + size(), &mine, sizeof(Descriptor), cudaMemcpyHostToDevice,
                                        state_->stream_));
    state_->check(ncclAllGather(device_words + size(), device_words, kDescriptorWords, ncclInt64, state_->comm_,
                                state_->stream_),
                  what + " (agreement check)");
    std::vector<Descriptor> all(static_cast<std::size_t>(size()));
    GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(all.data(), device_words, sizeof(Descriptor) * all.size(),
                                        cudaMemcpyDeviceToHost, state_->stream_));
    auto copied = std::make_shared<Event>();
    GRADSYNC_CUDA_CHECK(cudaEventRecord(copied->get(), state_->stream_));
    auto operation = state_->track(what + " (agreement check)", copied);
    state_->wait(*operation, *copied, std::chrono::milliseconds{0});
    require_agreement(mine, all, rank());
  }

  std::shared_ptr<NcclState> state_;
  bool check_agreement_ = false;
  std::mutex launch_mutex_;
  std::int64_t collective_sequence_ = 0;
  std::int64_t p2p_sequence_ = 0;
  int duplicates_ = 0;
  int splits_ = 0;
};

}  // namespace

bool nccl_available() { return cuda_device_count() > 0; }

std::string nccl_unavailable_reason() {
  return cuda_device_count() > 0 ? "" : cuda_unavailable_reason();
}

std::unique_ptr<Communicator> nccl_communicator(Communicator& bootstrap, const CommOptions& options, int device) {
  GRADSYNC_CHECK(bootstrap.device_type().is_cpu(), "nccl_communicator: bootstrap over a CPU communicator (MPI or Gloo), got ",
                 bootstrap.backend());
  const int devices = cuda_device_count();
  GRADSYNC_CHECK(devices > 0, "nccl_communicator (rank ", bootstrap.rank(), "): ", cuda_unavailable_reason());
  if (device < 0) device = local_rank_from_environment(bootstrap.rank()) % devices;
  GRADSYNC_CHECK(device < devices, "nccl_communicator (rank ", bootstrap.rank(), "): cuda:", device,
                 " does not exist; ", devices, " device(s) visible");
  return std::make_unique<NcclCommunicator>(bootstrap, options, device);
}

}  // namespace gradsync::comm
