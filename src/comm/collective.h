// Internal: what every communicator (CPU or NCCL) shares about a collective before it runs:
// the argument checks, with the errors users see, and the descriptor that names it in
// errors and that debug mode compares across ranks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gradsync/comm/communicator.h"

namespace gradsync::comm {

enum class OpKind : std::int64_t {
  allreduce = 1, broadcast, allgather, allgatherv, reduce_scatter, coalesced, barrier, duplicate, split
};
const char* op_kind_name(std::int64_t kind);

// What a rank believes the current collective is. Six int64s, so it travels as one small
// allgather in debug mode.
struct Descriptor {
  std::int64_t seq = 0;
  std::int64_t kind = 0;
  std::int64_t dtype = 0;
  std::int64_t count = 0;
  std::int64_t root = -1;
  std::int64_t op = -1;

  static Descriptor of(OpKind kind, DType dtype, std::int64_t count, std::int64_t root = -1, std::int64_t op = -1) {
    return {0, static_cast<std::int64_t>(kind), static_cast<std::int64_t>(dtype), count, root, op};
  }
  std::string str() const;  // "allreduce #12 (sum), f32 x 1000"
  // A 62-bit hash of every field: what the cheap always-on check compares across ranks.
  std::int64_t fingerprint() const;
  bool operator==(const Descriptor&) const = default;
};
static_assert(sizeof(Descriptor) == 6 * sizeof(std::int64_t));
constexpr std::int64_t kDescriptorWords = 6;

// A split's outcome for one rank, from every rank's (color, key) in rank order: its rank and the
// size of its group (ordered by key, ties by old rank), or rank -1 for kNoColor.
struct SplitPlace {
  int rank = -1;
  int size = 0;
  std::vector<int> members;  // the group's ranks in the communicator split, in the group's order
};
SplitPlace split_place(const std::vector<std::int64_t>& colors_and_keys, int my_rank);

// Throws naming the first rank whose descriptor differs from `mine`, with both views.
void require_agreement(const Descriptor& mine, const std::vector<Descriptor>& all, int my_rank);

// Argument checks; `comm` supplies rank, size, backend name and device type.
void require_device(const Communicator& comm, const char* op, const Tensor& tensor);
void require_same_device(const char* op, const Tensor& a, const Tensor& b);
void require_rank(const Communicator& comm, const char* op, int value, const char* what);
void require_peer(const Communicator& comm, const char* op, int peer);
void require_reducible(const char* op, ReduceOp reduce, const Tensor& tensor);
void require_allgather(const Communicator& comm, const Tensor& input, const Tensor& output);
// Returns the total element count.
std::int64_t require_allgatherv(const Communicator& comm, const Tensor& input, const Tensor& output,
                                const std::vector<std::int64_t>& counts);
void require_reduce_scatter(const Communicator& comm, const Tensor& input, const Tensor& output, ReduceOp op);
// Returns the total element count.
std::int64_t require_coalesced(const Communicator& comm, const std::vector<Tensor>& tensors, ReduceOp op);
std::string describe_p2p(const char* op, std::int64_t sequence, const Tensor& tensor, int peer, int tag);

}  // namespace gradsync::comm
