// Internal: what a CPU backend (MPI, Gloo) provides. Blocking primitives on raw host buffers,
// always called from the communicator's one communication thread, one at a time, in the same
// order on every rank. Each must give up with an exception once `timeout` has passed.
// ReduceOp::avg never reaches a backend: the communicator sums and then scales.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/algorithms/transport.h"
#include "comm/collective.h"
#include "gradsync/comm/communicator.h"

namespace gradsync::comm {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void set_timeout(std::chrono::milliseconds timeout) = 0;

  virtual void allreduce(void* data, std::int64_t count, DType dtype, ReduceOp op) = 0;
  virtual void broadcast(void* data, std::int64_t count, DType dtype, int root) = 0;
  virtual void allgather(const void* input, void* output, std::int64_t count, DType dtype) = 0;
  virtual void allgatherv(const void* input, void* output, const std::vector<std::int64_t>& counts, DType dtype) = 0;
  virtual void reduce_scatter(const void* input, void* output, std::int64_t count, DType dtype, ReduceOp op) = 0;
  virtual void barrier() = 0;
  virtual void send(const void* data, std::size_t nbytes, int peer, int tag) = 0;
  virtual void recv(void* data, std::size_t nbytes, int peer, int tag) = 0;

  // The point-to-point messages the algorithms of src/comm/algorithms/ run over, ready for one
  // more operation (Gloo gives each its own range of slots).
  virtual algorithms::Transport& begin_algorithm() = 0;

  // A backend over the same ranks that shares nothing in flight with this one (its own MPI
  // communicator, its own Gloo context). Called on the communication thread, in sequence.
  std::unique_ptr<Backend> duplicate();
  // The backend of this rank's group in a split, at `place` (collective.h: every rank computed
  // the same table); nullptr for kNoColor. Every rank calls it, member or not, in sequence.
  std::unique_ptr<Backend> split(int color, int key, const SplitPlace& place);

  // How messages name rank `r` of this backend: "rank r", or, in a group split from a larger
  // world, "rank r (world rank w)": users know their ranks by their world number, and a group's
  // rank 0 is seldom the world's.
  std::string rank_name(int r) const;
  // Rank `r`'s number in that world; errors raised on this rank's threads begin with it.
  int world_rank(int r) const;
  // Called from any thread once the communicator is broken: make the call in flight (if any)
  // give up soon, with an error. The backend is not used again afterwards.
  virtual void abort() = 0;
  // Adds what the backend knows about a failure (Gloo: which rank a peer address belongs to).
  virtual std::string explain(const std::string& message) const { return message; }

 protected:
  virtual std::unique_ptr<Backend> make_duplicate() = 0;
  virtual std::unique_ptr<Backend> make_split(int color, int key, const SplitPlace& place) = 0;

 private:
  std::vector<int> world_ranks_;  // rank r of this group is world rank world_ranks_[r]; empty: a world
};

// The communicator over a CPU backend: validation, sequence numbers, the communication
// thread, timeouts, the agreement check (communicator.cpp, engine.cpp).
std::unique_ptr<Communicator> make_cpu_communicator(std::unique_ptr<Backend> backend, const CommOptions& options);

}  // namespace gradsync::comm
