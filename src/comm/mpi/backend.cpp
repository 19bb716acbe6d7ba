// The MPI backend: MPI's nonblocking collectives, polled until done or until the timeout,
// so that no call blocks forever. f16/bf16 reduce through user-defined MPI operations that
// combine in f32 (src/comm/algorithms/reduce_functions.cpp); avg is sum then a division.
//
// Large messages, and small allreduces on power-of-two worlds, run the algorithms of
// src/comm/algorithms/ (rings, recursive doubling, the chain broadcast) over this backend's
// nonblocking point-to-point messages instead of MPI_Iallreduce and friends: Open MPI's
// nonblocking collectives (libnbc) send the whole buffer at every step, where the ring moves
// 2(n-1)/n of it in total and reduces one segment while the next is in flight. That is what
// the blocking MPI_Allreduce does for large messages, and it keeps the timeout
// (bench_collectives, docs/communication.md).
// The C API only: the deprecated C++ bindings do not compile cleanly under -Werror.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <array>
#include <cstring>
#include <vector>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "comm/algorithms/chain_broadcast.h"
#include "comm/algorithms/recursive_doubling.h"
#include "comm/algorithms/ring_allgather.h"
#include "comm/algorithms/ring_allreduce.h"
#include "comm/algorithms/ring_reduce_scatter.h"
#include "comm/cpu/backend.h"
#include "core/environment.h"
#include "gradsync/comm/mpi/mpi.h"
#include "comm/algorithms/reduce_functions.h"

namespace gradsync::comm {

namespace {

// Every MPI call of this process goes through one lock: several communicators (each Reducer
// duplicates its own) have a communication thread each, and MPI_THREAD_SERIALIZED allows one
// call at a time. Calls are short (nonblocking starts and MPI_Test polls), so the threads
// interleave at call granularity. Recursive: an argument may itself call MPI (mpi_op).
std::recursive_mutex& mpi_mutex() {
  static std::recursive_mutex mutex;
  return mutex;
}

void check_mpi(int status, const char* call) {
  if (status == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  {
    std::lock_guard<std::recursive_mutex> lock(mpi_mutex());
    MPI_Error_string(status, text, &length);
  }
  detail::throw_error("MPI call ", call, " failed: ", std::string(text, static_cast<std::size_t>(length)));
}

#define GRADSYNC_MPI_CHECK(call)                                   \
  do {                                                             \
    int mpi_status_;                                               \
    {                                                              \
      std::lock_guard<std::recursive_mutex> mpi_lock_(mpi_mutex()); \
      mpi_status_ = (call);                                        \
    }                                                              \
    check_mpi(mpi_status_, #call);                                 \
  } while (0)

// Set once any MPI communicator of this process broke (a timeout, an abort): MPI_Finalize
// would then wait forever for the lost peer, so the process ends the job with MPI_Abort.
std::atomic<bool>& any_broken() {
  static std::atomic<bool> broken{false};
  return broken;
}

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::f16:
    case DType::bf16: return MPI_UINT16_T;  // moved as bits, reduced by our own operations
  }
  return MPI_BYTE;
}

// User-defined MPI operations for the 16-bit floats, created once per (dtype, op).
template <DType kDType, ReduceOp kOp>
void half_reduce(void* in, void* inout, int* length, MPI_Datatype*) {
  static const ReduceFunction reduce = reduce_function(kDType, kOp);
  reduce(inout, in, inout, static_cast<std::size_t>(*length));
}

MPI_Op mpi_op(DType dtype, ReduceOp op) {
  if (dtype != DType::f16 && dtype != DType::bf16) {
    switch (op) {
      case ReduceOp::sum: return MPI_SUM;
      case ReduceOp::prod: return MPI_PROD;
      case ReduceOp::min: return MPI_MIN;
      case ReduceOp::max: return MPI_MAX;
      case ReduceOp::avg: break;
    }
    detail::throw_error("MPI: avg reaches the backend as sum");
  }
  static std::once_flag created;
  static std::array<MPI_Op, 8> ops;  // [f16 sum, prod, min, max, bf16 sum, prod, min, max]
  std::call_once(created, [] {
    MPI_User_function* functions[8] = {
        &half_reduce<DType::f16, ReduceOp::sum>,  &half_reduce<DType::f16, ReduceOp::prod>,
        &half_reduce<DType::f16, ReduceOp::min>,  &half_reduce<DType::f16, ReduceOp::max>,
        &half_reduce<DType::bf16, ReduceOp::sum>, &half_reduce<DType::bf16, ReduceOp::prod>,
        &half_reduce<DType::bf16, ReduceOp::min>, &half_reduce<DType::bf16, ReduceOp::max>};
    for (int i = 0; i < 8; ++i) GRADSYNC_MPI_CHECK(MPI_Op_create(functions[i], /*commute=*/1, &ops[static_cast<std::size_t>(i)]));
  });
  const std::size_t base = dtype == DType::f16 ? 0 : 4;
  switch (op) {
    case ReduceOp::sum: return ops[base + 0];
    case ReduceOp::prod: return ops[base + 1];
    case ReduceOp::min: return ops[base + 2];
    case ReduceOp::max: return ops[base + 3];
    case ReduceOp::avg: break;
  }
  detail::throw_error("MPI: avg reaches the backend as sum");
}

int int_count(std::int64_t count, const char* op) {
  GRADSYNC_CHECK(count <= std::numeric_limits<int>::max(), "MPI ", op, ": ", count,
                 " elements exceed MPI's int count; split the tensor");
  return static_cast<int>(count);
}

// Finalizes MPI at exit when we initialized it. After a failure MPI_Finalize blocks on the
// peer that stopped answering (it synchronizes with every rank), so a broken job ends with
// MPI_Abort instead: mpirun then stops the other ranks too, and the exit status is non-zero.
struct MpiLifetime {
  bool we_initialized = false;
  ~MpiLifetime() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!we_initialized || finalized) return;
    if (any_broken()) {
      std::fprintf(stderr,
                   "gradsync: an MPI communicator of this process broke (timeout or lost peer); ending the job with "
                   "MPI_Abort, since MPI_Finalize would wait for the lost peer forever\n");
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 3);
    }
    MPI_Finalize();
  }
};
MpiLifetime& lifetime() {
  static MpiLifetime instance;
  return instance;
}

class MpiBackend final : public Backend {
 public:
  // Over MPI_COMM_WORLD's ranks: a private communicator for the collectives and one for the
  // ring's messages, which can then never match a user's send.
  MpiBackend() {
    GRADSYNC_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
    GRADSYNC_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &ring_comm_));
    configure();
  }
  // Over two communicators already duplicated for it (duplicate()).
  MpiBackend(MPI_Comm comm, MPI_Comm ring_comm) : comm_(comm), ring_comm_(ring_comm) { configure(); }

  void configure() {
    GRADSYNC_MPI_CHECK(MPI_Comm_set_errhandler(ring_comm_, MPI_ERRORS_RETURN));
    GRADSYNC_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    GRADSYNC_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    GRADSYNC_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  }
  ~MpiBackend() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !broken_) {
      std::lock_guard<std::recursive_mutex> lock(mpi_mutex());
      MPI_Comm_free(&ring_comm_);
      MPI_Comm_free(&comm_);
    }
  }

  // MPI_Comm_idup, polled against the timeout like every other call.
  std::unique_ptr<Backend> make_duplicate() override {
    MPI_Comm comm = MPI_COMM_NULL;
    MPI_Comm ring = MPI_COMM_NULL;
    MPI_Request request;
    GRADSYNC_MPI_CHECK(MPI_Comm_idup(comm_, &comm, &request));
    complete(request, "MPI_Comm_idup");
    GRADSYNC_MPI_CHECK(MPI_Comm_idup(ring_comm_, &ring, &request));
    complete(request, "MPI_Comm_idup");
    auto child = std::make_unique<MpiBackend>(comm, ring);
    child->set_timeout(timeout_);
    return child;
  }

  // The polling loop of the call in flight sees the flag and gives up. (MPI cannot cancel a
  // started collective: the request stays pending, the communicator is never used again, and
  // the process ends with MPI_Abort rather than MPI_Finalize.)
  // MPI_Comm_split orders a color's ranks by key, then by rank, as split_place does. There is no
  // nonblocking split to poll; every rank has just answered the split's allgather, so all are
  // here and none waits long.
  std::unique_ptr<Backend> make_split(int color, int key, const SplitPlace& place) override {
    MPI_Comm comm = MPI_COMM_NULL;
    MPI_Comm ring = MPI_COMM_NULL;
    {
      std::lock_guard<std::recursive_mutex> lock(mpi_mutex());
      GRADSYNC_MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &comm));
      GRADSYNC_MPI_CHECK(MPI_Comm_split(ring_comm_, color < 0 ? MPI_UNDEFINED : color, key, &ring));
    }
    if (color < 0) return nullptr;
    auto child = std::make_unique<MpiBackend>(comm, ring);
    GRADSYNC_CHECK(child->rank() == place.rank && child->size() == place.size, "split: MPI placed rank ", rank_,
                   " at ", child->rank(), " of ", child->size(), ", the split's table at ", place.rank, " of ", place.size);
    child->set_timeout(timeout_);
    return child;
  }

  void abort() override { aborted_ = true; }

  const char* name() const override { return "mpi"; }
  algorithms::Transport& begin_algorithm() override { return transport_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void set_timeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }

  void allreduce(void* data, std::int64_t count, DType dtype, ReduceOp op) override {
    auto* bytes = static_cast<std::byte*>(data);
    if (size_ > 1 && static_cast<std::size_t>(count) * dtype_size(dtype) >= kRingThresholdBytes) {
      return algorithms::ring_allreduce(transport_, bytes, count, dtype, op);
    }
    if (size_ > 1 && (size_ & (size_ - 1)) == 0) {
      return algorithms::recursive_doubling_allreduce(transport_, bytes, count, dtype, op);
    }
    MPI_Request request;
    GRADSYNC_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, data, int_count(count, "allreduce"), mpi_type(dtype),
                                      mpi_op(dtype, op), comm_, &request));
    complete(request, "MPI_Iallreduce");
  }

  void broadcast(void* data, std::int64_t count, DType dtype, int root) override {
    const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
    if (size_ > 1 && bytes >= kRingThresholdBytes) {
      // Two ranks: one hop, nothing to pipeline, one message. More: segments, so that every
      // link of the chain is busy at once.
      return algorithms::chain_broadcast(transport_, static_cast<std::byte*>(data), bytes, root,
                                         size_ == 2 ? bytes : algorithms::segment_size(bytes / 4, dtype_size(dtype)));
    }
    MPI_Request request;
    GRADSYNC_MPI_CHECK(MPI_Ibcast(data, int_count(count, "broadcast"), mpi_type(dtype), root, comm_, &request));
    complete(request, "MPI_Ibcast");
  }

  void allgather(const void* input, void* output, std::int64_t count, DType dtype) override {
    const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
    if (size_ > 1 && bytes * static_cast<std::size_t>(size_) >= kRingThresholdBytes) {
      std::vector<std::size_t> offsets;
      for (int chunk = 0; chunk <= size_; ++chunk) offsets.push_back(bytes * static_cast<std::size_t>(chunk));
      return algorithms::ring_allgather(transport_, static_cast<std::byte*>(output), offsets, dtype_size(dtype),
                                        /*first_owned=*/0, static_cast<const std::byte*>(input));
    }
    MPI_Request request;
    const int n = int_count(count, "allgather");
    GRADSYNC_MPI_CHECK(MPI_Iallgather(input, n, mpi_type(dtype), output, n, mpi_type(dtype), comm_, &request));
    complete(request, "MPI_Iallgather");
  }

  void allgatherv(const void* input, void* output, const std::vector<std::int64_t>& counts, DType dtype) override {
    const std::size_t element = dtype_size(dtype);
    std::vector<std::size_t> offsets{0};
    for (const std::int64_t count : counts) offsets.push_back(offsets.back() + static_cast<std::size_t>(count) * element);
    if (size_ > 1 && offsets.back() >= kRingThresholdBytes) {
      // ZeRO's parameter gathers: the ring, as allgather (Open MPI's nonblocking allgatherv is
      // several times slower at these sizes).
      return algorithms::ring_allgather(transport_, static_cast<std::byte*>(output), offsets, element,
                                        /*first_owned=*/0, static_cast<const std::byte*>(input));
    }
    std::vector<int> receive_counts;
    std::vector<int> displacements;
    std::int64_t offset = 0;
    for (const std::int64_t count : counts) {
      receive_counts.push_back(int_count(count, "allgatherv"));
      displacements.push_back(int_count(offset, "allgatherv"));
      offset += count;
    }
    MPI_Request request;
    GRADSYNC_MPI_CHECK(MPI_Iallgatherv(input, receive_counts[static_cast<std::size_t>(rank_)], mpi_type(dtype), output,
                                       receive_counts.data(), displacements.data(), mpi_type(dtype), comm_, &request));
    complete(request, "MPI_Iallgatherv");
  }

  void reduce_scatter(const void* input, void* output, std::int64_t count, DType dtype, ReduceOp op) override {
    if (size_ > 1 && static_cast<std::size_t>(count) * dtype_size(dtype) * static_cast<std::size_t>(size_) >= kRingThresholdBytes) {
      return algorithms::ring_reduce_scatter(transport_, static_cast<const std::byte*>(input),
                                             static_cast<std::byte*>(output), count, dtype, op);
    }
    MPI_Request request;
    GRADSYNC_MPI_CHECK(MPI_Ireduce_scatter_block(input, output, int_count(count, "reduce_scatter"), mpi_type(dtype),
                                                 mpi_op(dtype, op), comm_, &request));
    complete(request, "MPI_Ireduce_scatter_block");
  }

  void barrier() override {
    MPI_Request request;
    GRADSYNC_MPI_CHECK(MPI_Ibarrier(comm_, &request));
    complete(request, "MPI_Ibarrier");
  }

  void send(const void* data, std::size_t nbytes, int peer, int tag) override {
    MPI_Request request;
    GRADSYNC_MPI_CHECK(MPI_Isend(data, int_count(static_cast<std::int64_t>(nbytes), "send"), MPI_BYTE, peer, tag, comm_,
                                 &request));
    complete(request, "MPI_Isend");
  }

  void recv(void* data, std::size_t nbytes, int peer, int tag) override {
    MPI_Request request;
    GRADSYNC_MPI_CHECK(MPI_Irecv(data, int_count(static_cast<std::int64_t>(nbytes), "recv"), MPI_BYTE, peer, tag, comm_,
                                 &request));
    complete(request, "MPI_Irecv");
  }

 private:
  // From this size on, the algorithms of src/comm/algorithms/ beat MPI's nonblocking collectives.
  static constexpr std::size_t kRingThresholdBytes = 32 << 10;
  // The algorithms' point-to-point messages: nonblocking sends and receives on ring_comm_
  // (so they never match a user's message on comm_), completed by complete(). The transport
  // outlives calls, and so does its scratch memory.
  class Message final : public algorithms::PendingMessage {
   public:
    Message(MpiBackend& backend, MPI_Request request) : backend_(backend), request_(request) {}
    void wait(const char* what) override { backend_.complete(request_, what); }

   private:
    MpiBackend& backend_;
    MPI_Request request_;
  };
  class PointToPoint final : public algorithms::Transport {
   public:
    explicit PointToPoint(MpiBackend& backend) : backend_(backend) {}
    int rank() const override { return backend_.rank_; }
    int size() const override { return backend_.size_; }
    // Two ranks: a ring step is one exchange with nothing to forward, and Open MPI's shared-memory
    // transport copies a large message once, by the receiver; segments only add messages
    // (bench_collectives --runs 3, 2 ranks, with the AVX2 reduction: 64 KiB-4 MiB 1.01-1.17x
    // MPI_Allreduce whole against 1.05-1.49x in segments).
    std::size_t ring_segment(std::size_t chunk_bytes, std::size_t element) const override {
      return size() == 2 ? std::max(chunk_bytes / element * element, element)
                         : algorithms::Transport::ring_segment(chunk_bytes, element);
    }
    algorithms::Message send(const std::byte* data, std::size_t bytes, int peer, int tag) override {
      MPI_Request request;
      GRADSYNC_MPI_CHECK(MPI_Isend(data, int_count(static_cast<std::int64_t>(bytes), "send"), MPI_BYTE, peer, tag,
                                   backend_.ring_comm_, &request));
      return std::make_unique<Message>(backend_, request);
    }
    algorithms::Message receive(std::byte* data, std::size_t bytes, int peer, int tag) override {
      MPI_Request request;
      GRADSYNC_MPI_CHECK(MPI_Irecv(data, int_count(static_cast<std::int64_t>(bytes), "recv"), MPI_BYTE, peer, tag,
                                   backend_.ring_comm_, &request));
      return std::make_unique<Message>(backend_, request);
    }

   private:
    MpiBackend& backend_;
  };

  // Polls the request until it completes or the timeout passes. Nonblocking collectives
  // progress only inside MPI calls, so the thread keeps calling MPI_Test: a few hundred times
  // back to back first (a small operation completes within microseconds, and a yield is a
  // system call of about one), then yielding the core between calls (on an oversubscribed
  // machine the peer ranks need it), and sleeping only once an operation has been pending for
  // a long time.
  void complete(MPI_Request& request, const char* call) {
    constexpr int kBusyPolls = 256;
    for (int poll = 0; poll < kBusyPolls; ++poll) {
      int done = 0;
      GRADSYNC_MPI_CHECK(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
      if (done) return;
    }
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      int done = 0;
      GRADSYNC_MPI_CHECK(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
      if (done) return;
      const auto elapsed = std::chrono::steady_clock::now() - start;
      if (elapsed > timeout_ || aborted_) {
        broken_ = true;  // the request stays pending; this communicator cannot be used again
        any_broken() = true;
        if (aborted_) detail::throw_error(call, " was aborted: the communicator broke while it was in flight");
        detail::throw_error(call, " did not complete within ", timeout_.count(), " ms");
      }
      if (elapsed > std::chrono::seconds(1)) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      } else {
        std::this_thread::yield();
      }
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm ring_comm_ = MPI_COMM_NULL;
  PointToPoint transport_{*this};
  int rank_ = 0;
  int size_ = 1;
  std::chrono::milliseconds timeout_{300000};
  bool broken_ = false;
  std::atomic<bool> aborted_{false};
};

}  // namespace

bool mpi_available() { return true; }

bool launched_by_mpi() { return environment::launched_by_mpi(); }

std::unique_ptr<Communicator> mpi_world(const CommOptions& options) {
  int initialized = 0;
  GRADSYNC_MPI_CHECK(MPI_Initialized(&initialized));
  if (!initialized) {
    int provided = 0;
    GRADSYNC_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided));
    lifetime().we_initialized = true;
    // Errors raised while progressing a request may be reported on MPI_COMM_WORLD (Open MPI
    // does for a truncated message): they must come back to us as codes, not abort the job.
    GRADSYNC_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    GRADSYNC_CHECK(provided >= MPI_THREAD_SERIALIZED, "MPI provides thread level ", provided,
                   " but gradsync's communication thread needs MPI_THREAD_SERIALIZED");
  } else {
    int provided = 0;
    GRADSYNC_MPI_CHECK(MPI_Query_thread(&provided));
    GRADSYNC_CHECK(provided >= MPI_THREAD_SERIALIZED, "MPI was initialized with thread level ", provided,
                   "; gradsync's communication thread needs MPI_THREAD_SERIALIZED (use MPI_Init_thread)");
  }
  return make_cpu_communicator(std::make_unique<MpiBackend>(), options);
}

}  // namespace gradsync::comm
