// gradsync/dist/hooks/powersgd.h - PowerSGD gradient compression (Vogels et al., 2019) as a
// communication hook, with PyTorch's `powerSGD_hook` options and semantics.
//
// Each gradient of a bucket is viewed as a matrix M (its first dimension by the rest). Instead
// of allreducing M (n x m), PowerSGD allreduces two thin factors: P = M Q (n x r), orthogonalized
// after its allreduce, then Q = M^T P (m x r), averaged; every rank then sets M to P Q^T, the same
// rank-r approximation of the average gradient. (n + m) r numbers cross the wire instead of n m:
// 768 x 3072 at rank 4 sends 150 times fewer bytes. Tensors not worth it ((n + m) r x
// min_compression_rate >= n m, e.g. biases) are allreduced uncompressed, all of a bucket's in one
// message. What the approximation misses on this rank is kept (error feedback) and added to the
// next step's gradient, so that nothing is lost, only delayed; Q is reused from the last step
// (warm start), which makes one power iteration per step enough. Until `start_powerSGD_iter`
// steps have passed, buckets are plainly allreduced and averaged. docs/distributed.md has the
// algorithm and its costs.
//
//   auto state = std::make_shared<dist::PowerSGDState>(dist::PowerSGDOptions{.matrix_approximation_rank = 2});
//   ddp.register_comm_hook(dist::powersgd_hook(state));
//
// One state per model (it keys its memory by bucket index, as PyTorch's does). Gradients of f32
// or f64, on the host or a CUDA device (the products through cuBLAS, the orthogonalization in
// gradsync's kernels: src/kernels/low_rank.h); other dtypes are refused, naming the bucket.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "gradsync/dist/reducer/reducer.h"

namespace gradsync::dist {

// PyTorch's PowerSGDState arguments, under its names and defaults.
struct PowerSGDOptions {
  int matrix_approximation_rank = 1;  // the rank r of each gradient matrix's approximation P Q^T
  std::int64_t start_powerSGD_iter = 1000;  // must be > 1 with error feedback or warm start (PyTorch's rule)
  double min_compression_rate = 2;  // a matrix compressed less than this is allreduced whole
  bool use_error_feedback = true;   // what compression lost is added to the next step's gradient
  bool warm_start = true;           // Q starts each step from the last step's
  double orthogonalization_epsilon = 0;  // added to each column's norm: guards all-zero gradients
  std::uint32_t random_seed = 0;         // the same on every rank: the random projections must agree
  // PyTorch's batched variant of the per-shape work: matrices of one shape share one random
  // draw (the only observable difference; the products are the same per matrix).
  bool batch_tensors_with_same_shape = false;
  // gradsync's: each bucket's compression runs on a thread of its own, over a duplicate of the
  // communicator, while the engine's backward goes on (host buckets; a device bucket runs on the
  // caller's thread). false: on the caller's thread, as PyTorch's hook. The same results.
  bool overlap_backward = true;
};

// PowerSGD's state across steps (PyTorch's PowerSGDState): the error feedback, the P and Q
// memories, the iteration, the random generator. Shared by the hook and the caller.
class PowerSGDState {
 public:
  explicit PowerSGDState(PowerSGDOptions options);  // validated (an invalid value is an error naming it)
  ~PowerSGDState();
  PowerSGDState(const PowerSGDState&) = delete;
  PowerSGDState& operator=(const PowerSGDState&) = delete;

  const PowerSGDOptions& options() const;  // as given
  std::int64_t iteration() const;  // steps completed (a step ends with the last bucket of a round)
  // Elements a rank's buckets held, and what it sent for them, since the start (PyTorch's
  // compression_stats): before / after is the compression rate.
  std::int64_t numel_before_compression() const;  // (above)
  std::int64_t numel_after_compression() const;  // (above)

  // Everything a resumed run needs to continue identically: per bucket the error, P and Q
  // memory; the iteration; the random generator. Names: "error.<bucket>", "p.<bucket>",
  // "q.<bucket>", "iteration", "rng". load_state_dict checks what it is given, naming it.
  std::map<std::string, Tensor> state_dict() const;  // (above)
  void load_state_dict(const std::map<std::string, Tensor>& state);  // (above)

  // Internal (the hook's working state). \private
  struct Impl;
  // Internal: the hook's working state. \private
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// The Reducer hook (DataParallel::register_comm_hook, ReducerOptions::hook): three collectives per
// bucket with matrix products between them, off the caller's thread (overlap_backward).
ReduceHook powersgd_hook(std::shared_ptr<PowerSGDState> state);

}  // namespace gradsync::dist
