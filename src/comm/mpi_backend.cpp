// The MPI backend: MPI's nonblocking collectives, polled until done or until the timeout,
// so that no call blocks forever. f16/bf16 reduce through user-defined MPI operations that
// combine in f32 (src/comm/reduce_functions.cpp); avg is sum then a division.
//
// Small allreduces on power-of-two worlds run recursive doubling, large ones our own ring
// (reduce-scatter, then allgather), both over nonblocking point-to-point messages instead of
// MPI_Iallreduce: Open MPI's nonblocking allreduce (libnbc)
// sends the whole buffer at every step, where the ring moves 2(n-1)/n of it in total and
// reduces one segment while the next is in flight. That is what the blocking MPI_Allreduce
// does for large messages, and it keeps the timeout (bench_collectives, docs/communication.md).
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

#include "backend.h"
#include "core/environment.h"
#include "gradsync/comm/mpi.h"
#include "reduce_functions.h"

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
  std::unique_ptr<Backend> duplicate() override {
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
  void abort() override { aborted_ = true; }

  const char* name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void set_timeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }

  void allreduce(void* data, std::int64_t count, DType dtype, ReduceOp op) override {
    if (size_ > 1 && static_cast<std::size_t>(count) * dtype_size(dtype) >= kRingThresholdBytes) {
      return ring_allreduce(static_cast<std::byte*>(data), count, dtype, op);
    }
    if (size_ > 1 && (size_ & (size_ - 1)) == 0) {
      return doubling_allreduce(static_cast<std::byte*>(data), count, dtype, op);
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
      return chain_broadcast(static_cast<std::byte*>(data), bytes, root,
                             size_ == 2 ? bytes : segment_size(bytes / 4, dtype_size(dtype)));
    }
    MPI_Request request;
    GRADSYNC_MPI_CHECK(MPI_Ibcast(data, int_count(count, "broadcast"), mpi_type(dtype), root, comm_, &request));
    complete(request, "MPI_Ibcast");
  }

  void allgather(const void* input, void* output, std::int64_t count, DType dtype) override {
    const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
    if (size_ > 1 && bytes * static_cast<std::size_t>(size_) >= kRingThresholdBytes) {
      return ring_allgather(static_cast<std::byte*>(output), [bytes](int chunk) { return bytes * static_cast<std::size_t>(chunk); },
                            [bytes](int) { return bytes; }, segment_size(bytes, dtype_size(dtype)), /*first_owned=*/0,
                            static_cast<const std::byte*>(input));
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
      std::size_t largest = 0;
      for (int r = 0; r < size_; ++r) largest = std::max(largest, offsets[static_cast<std::size_t>(r) + 1] - offsets[static_cast<std::size_t>(r)]);
      return ring_allgather(
          static_cast<std::byte*>(output), [&](int chunk) { return offsets[static_cast<std::size_t>(chunk)]; },
          [&](int chunk) { return offsets[static_cast<std::size_t>(chunk) + 1] - offsets[static_cast<std::size_t>(chunk)]; },
          segment_size(largest, element), /*first_owned=*/0, static_cast<const std::byte*>(input));
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
      return ring_reduce_scatter(static_cast<const std::byte*>(input), static_cast<std::byte*>(output), count, dtype, op);
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
  static constexpr std::size_t kRingThresholdBytes = 32 << 10;
  static constexpr std::size_t kMinSegmentBytes = 16 << 10;
  static constexpr std::size_t kMaxSegmentBytes = 1 << 20;

  // Segments of about a quarter of a chunk, so the pipeline fills, within bounds that keep the
  // per-message overhead small and the messages in flight few; whole elements.
  static std::size_t segment_size(std::size_t chunk_bytes, std::size_t element) {
    return std::max(std::clamp(chunk_bytes / 2, kMinSegmentBytes, kMaxSegmentBytes) / element * element, element);
  }

  // Ring allreduce. Chunk c of the buffer is elements [c*count/n, (c+1)*count/n). In step s of
  // the reduce-scatter, rank r sends chunk (r-s) to its right neighbour and receives chunk
  // (r-s-1) from its left, reducing it into its own copy; after n-1 steps rank r holds the
  // final chunk (r+1). The allgather then passes the final chunks around the ring. Chunks are
  // cut into segments so the reduction of one overlaps the transfer of the next.
  // Small allreduces on a power-of-two world: recursive doubling, log2(n) exchanges of the
  // whole buffer with the partner rank ^ distance, what MPI_Allreduce itself does for small
  // messages (Open MPI's nonblocking MPI_Iallreduce pays several microseconds more). The
  // reductions are commutative, so both partners compute the same bits.
  void doubling_allreduce(std::byte* data, std::int64_t count, DType dtype, ReduceOp op) {
    const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
    const ReduceFunction reduce = reduce_function(dtype, op);
    reserve_scratch(bytes);
    const int length = int_count(static_cast<std::int64_t>(bytes), "allreduce");
    for (int distance = 1; distance < size_; distance *= 2) {
      const int partner = rank_ ^ distance;
      MPI_Request requests[2];
      GRADSYNC_MPI_CHECK(MPI_Irecv(scratch_.data(), length, MPI_BYTE, partner, kDoublingTag, ring_comm_, &requests[0]));
      GRADSYNC_MPI_CHECK(MPI_Isend(data, length, MPI_BYTE, partner, kDoublingTag, ring_comm_, &requests[1]));
      complete(requests[0], "allreduce (recursive doubling receive)");
      complete(requests[1], "allreduce (recursive doubling send)");
      reduce(data, data, scratch_.data(), static_cast<std::size_t>(count));
    }
  }
  static constexpr int kDoublingTag = 1;  // the ring's messages use tag 0 on ring_comm_

  // The receive buffer only grows: resizing a vector up zero-fills the new bytes, which for a
  // ring's 8 MiB chunk after a small allreduce costs more than the message itself.
  void reserve_scratch(std::size_t bytes) {
    if (scratch_.size() < bytes) scratch_.resize(std::max<std::size_t>(bytes, 1));
  }

  void ring_allreduce(std::byte* data, std::int64_t count, DType dtype, ReduceOp op) {
    const int n = size_;
    const int right = (rank_ + 1) % n;
    const int left = (rank_ + n - 1) % n;
    const std::size_t element = dtype_size(dtype);
    const auto chunk_begin = [=](int chunk) { return static_cast<std::size_t>(count * chunk / n) * element; };
    const auto chunk_bytes = [=](int chunk) { return chunk_begin(chunk + 1) - chunk_begin(chunk); };
    const ReduceFunction reduce = reduce_function(dtype, op);
    const std::size_t segment = segment_size(chunk_bytes(n - 1), element);
    reserve_scratch(chunk_bytes(n - 1) + element);  // the largest chunk

    for (int step = 0; step < n - 1; ++step) {
      const int send_chunk = wrap(rank_ - step);
      const int recv_chunk = wrap(rank_ - step - 1);
      std::vector<MPI_Request> receives = post_segments(scratch_.data(), chunk_bytes(recv_chunk), segment, left, true);
      std::vector<MPI_Request> sends = post_segments(data + chunk_begin(send_chunk), chunk_bytes(send_chunk), segment, right, false);
      std::byte* target = data + chunk_begin(recv_chunk);
      for (std::size_t i = 0; i < receives.size(); ++i) {
        complete(receives[i], "ring allreduce (reduce-scatter receive)");
        const std::size_t offset = i * segment;
        const std::size_t bytes = std::min(segment, chunk_bytes(recv_chunk) - offset);
        reduce(target + offset, target + offset, scratch_.data() + offset, bytes / element);
      }
      for (MPI_Request& request : sends) complete(request, "ring allreduce (reduce-scatter send)");
    }
    // Rank r holds the final chunk r+1: pass the final chunks around.
    ring_allgather(data, chunk_begin, chunk_bytes, segment, /*first_owned=*/1);
  }

  // Ring reduce-scatter, out of place: the first half of the ring allreduce, shifted by one
  // chunk so that rank r ends with chunk r. In step s rank r sends its partial sum of chunk
  // (r-1-s) right and receives the left neighbour's of chunk (r-2-s), adding its own input to
  // it. Partial sums alternate between two accumulators (one is on the wire while the other
  // fills); the last step writes into the output.
  void ring_reduce_scatter(const std::byte* input, std::byte* output, std::int64_t count, DType dtype, ReduceOp op) {
    const int right = (rank_ + 1) % size_;
    const int left = (rank_ + size_ - 1) % size_;
    const std::size_t element = dtype_size(dtype);
    const std::size_t bytes = static_cast<std::size_t>(count) * element;
    const ReduceFunction reduce = reduce_function(dtype, op);
    const std::size_t segment = segment_size(bytes, element);
    reserve_scratch(3 * bytes + element);
    std::byte* received = scratch_.data();
    std::byte* partial[2] = {scratch_.data() + bytes, scratch_.data() + 2 * bytes};
    const std::byte* send_from = input + static_cast<std::size_t>(wrap(rank_ - 1)) * bytes;
    for (int step = 0; step < size_ - 1; ++step) {
      const std::byte* own = input + static_cast<std::size_t>(wrap(rank_ - 2 - step)) * bytes;
      std::byte* target = step == size_ - 2 ? output : partial[step % 2];
      std::vector<MPI_Request> receives = post_segments(received, bytes, segment, left, true);
      std::vector<MPI_Request> sends = post_segments(const_cast<std::byte*>(send_from), bytes, segment, right, false);
      for (std::size_t i = 0; i < receives.size(); ++i) {
        complete(receives[i], "ring reduce_scatter (receive)");
        const std::size_t offset = i * segment;
        const std::size_t length = std::min(segment, bytes - offset);
        reduce(target + offset, own + offset, received + offset, length / element);
      }
      for (MPI_Request& request : sends) complete(request, "ring reduce_scatter (send)");
      send_from = target;
    }
  }

  // Ring allgather: rank r owns chunk (r + first_owned) and, in step s, sends chunk
  // (r + first_owned - s) right and receives chunk (r + first_owned - s - 1) from the left,
  // straight into place. With `own_source`, rank r's own chunk is not in place yet: step 0 sends
  // it from there, and it is copied into place while the first messages travel. (Sending the
  // freshly copied bytes instead costs up to 1.6x at 64 KiB-1 MiB with Open MPI's single-copy
  // transport: bench_collectives.)
  template <typename Begin, typename Bytes>
  void ring_allgather(std::byte* data, Begin chunk_begin, Bytes chunk_bytes, std::size_t segment, int first_owned = 0,
                      const std::byte* own_source = nullptr) {
    const int right = (rank_ + 1) % size_;
    const int left = (rank_ + size_ - 1) % size_;
    for (int step = 0; step < size_ - 1; ++step) {
      const int send_chunk = wrap(rank_ + first_owned - step);
      const int recv_chunk = wrap(rank_ + first_owned - step - 1);
      const bool from_source = step == 0 && own_source != nullptr;
      std::byte* send_from = from_source ? const_cast<std::byte*>(own_source) : data + chunk_begin(send_chunk);
      std::vector<MPI_Request> receives = post_segments(data + chunk_begin(recv_chunk), chunk_bytes(recv_chunk), segment, left, true);
      std::vector<MPI_Request> sends = post_segments(send_from, chunk_bytes(send_chunk), segment, right, false);
      if (from_source) std::memcpy(data + chunk_begin(send_chunk), own_source, chunk_bytes(send_chunk));
      for (MPI_Request& request : receives) complete(request, "ring allgather (receive)");
      for (MPI_Request& request : sends) complete(request, "ring allgather (send)");
    }
  }

  // Pipelined chain broadcast: root -> root+1 -> ... -> root-1, segment by segment, each rank
  // forwarding a segment as soon as it has it. Every link carries the buffer once.
  void chain_broadcast(std::byte* data, std::size_t bytes, int root, std::size_t segment) {
    const int position = wrap(rank_ - root);  // 0 for the root
    const int right = (rank_ + 1) % size_;
    const int left = (rank_ + size_ - 1) % size_;
    const bool forwards = position < size_ - 1;
    std::vector<MPI_Request> receives;
    if (position > 0) receives = post_segments(data, bytes, segment, left, true);
    std::vector<MPI_Request> sends;
    for (std::size_t i = 0, offset = 0; offset < bytes; ++i, offset += segment) {
      if (position > 0) complete(receives[i], "chain broadcast (receive)");
      if (forwards) {
        MPI_Request request;
        GRADSYNC_MPI_CHECK(MPI_Isend(data + offset, static_cast<int>(std::min(segment, bytes - offset)), MPI_BYTE, right, 0,
                                     ring_comm_, &request));
        sends.push_back(request);
      }
    }
    for (MPI_Request& request : sends) complete(request, "chain broadcast (send)");
  }

  int wrap(int chunk) const { return ((chunk % size_) + size_) % size_; }

  // Posts one nonblocking message per segment of [data, data + bytes).
  std::vector<MPI_Request> post_segments(std::byte* data, std::size_t bytes, std::size_t segment, int peer, bool receive) {
    std::vector<MPI_Request> requests;
    for (std::size_t offset = 0; offset < bytes; offset += segment) {
      const int length = static_cast<int>(std::min(segment, bytes - offset));
      MPI_Request request;
      if (receive) {
        GRADSYNC_MPI_CHECK(MPI_Irecv(data + offset, length, MPI_BYTE, peer, 0, ring_comm_, &request));
      } else {
        GRADSYNC_MPI_CHECK(MPI_Isend(data + offset, length, MPI_BYTE, peer, 0, ring_comm_, &request));
      }
      requests.push_back(request);
    }
    return requests;
  }

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
  std::vector<std::byte> scratch_;  // the ring's receive buffer, kept between calls
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
