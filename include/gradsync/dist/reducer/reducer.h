// gradsync/dist/reducer/reducer.h - the one gradient-reduction engine under both front-ends
// (DistributedOptimizer with Horovod's semantics, DataParallel with DDP's).
//
// What it does, per round (one synchronized step):
//   1. Buckets were formed once, at construction: runs of parameters of one (device, dtype),
//      up to a byte limit. A bucket whose members sit next to each other in the registry's
//      gradient arena *is* a view of the arena: nothing is copied. Otherwise (members scattered
//      by explicit groups or by frozen parameters in between) it has its own flat buffer.
//   2. The front-end calls ready(p) as gradients complete, in any order. A bucket is complete
//      when all its members are ready; buckets are then launched strictly in bucket order
//      (bucket b waits for 0..b-1), so every rank issues the same collectives in the same
//      order with no negotiation. Launch = prescale, compress (cast to f16/bf16; integer
//      gradients never), an async reduction (the communicator's allreduce with `op`, or a
//      hook), all off the caller's thread.
//   3. finish() launches whatever never completed, in bucket order, zero-filling gradients
//      that were never defined ("force allreduce"): a rank whose graph skipped a parameter
//      still takes part in every collective. wait() waits for every bucket, decompresses,
//      postscales, copies back when the bucket has its own buffer, and marks every member's
//      gradient defined. Then the next round starts.
// The caller's thread keeps computing gradients while earlier buckets reduce: that is the
// overlap, and it needs nothing but the communicator's async operations.
//
// The Reducer issues its collectives on its own duplicate of the communicator it is given
// (Communicator::duplicate): the order of its launches follows this rank's ready signals, so
// sharing a sequence with another Reducer or with anybody's collectives would let ranks pair
// different buckets (silently wrong sums when the sizes agree). Constructing one is collective.
//
// Failure: the first exception in a launch (a hook, a broken communicator) or a wait breaks
// the Reducer. It first waits for every bucket still in flight (none writes the arena after
// the exception reaches the caller), then refuses every later ready/finish/wait with an error
// that quotes the original failure. Build a new communicator and Reducer to go on.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/comm/communicator.h"
#include "gradsync/registry/parameter_registry.h"

namespace gradsync::dist {

// Gradient compression on the wire: none, or a cast to a 16-bit float for the reduction and
// back afterwards. Only floating gradients wider than the target are compressed.
enum class Compression { none, fp16, bf16 };
const char* compression_name(Compression compression);  // "none", "fp16", "bf16"
Compression parse_compression(const std::string& text);  // "none" | "fp16" | "bf16"
// The 16-bit dtype a floating tensor travels in under `compression`, or its own dtype.
DType wire_dtype(DType dtype, Compression compression);

// How buckets close when they fill up.
enum class BucketRule {
  fusion,   // Horovod's tensor fusion: a bucket never exceeds the limit (unless one tensor does)
  pytorch,  // DDP: add the tensor, then close once the bucket holds >= the limit
};

// Groups `sizes[i]` bytes with key `keys[i]` (one key per (device, dtype)) into buckets, in
// index order, one open bucket per key; `limits` applies to a key's 1st, 2nd, ... bucket, the
// last limit repeating. `together` (optional) gives a unit id per index: indices with the same
// unit id always share a bucket (Horovod's explicit groups; they must have the same key).
// Buckets come out sorted by their smallest index. This is DDP's compute_bucket_assignment_by_size
// for BucketRule::pytorch (docs/semantics/ddp.md, checklist 7).
std::vector<std::vector<std::size_t>> assign_buckets(const std::vector<std::size_t>& sizes,
                                                     const std::vector<int>& keys,
                                                     const std::vector<std::size_t>& limits, BucketRule rule,
                                                     const std::vector<int>& together = {});

struct BucketInfo;

// A custom reduction of one bucket's flat buffer (the compressed one when compressing), in
// place: e.g. Adasum, or a user's hook. `tensor_sizes` are the members' element counts in
// buffer order (padding excluded; see BucketInfo). Returns the Work to wait for.
using ReduceHook = std::function<comm::WorkHandle(comm::Communicator&, Tensor& flat, const BucketInfo&)>;

// A bucket's flat buffer split among the ranks (ZeRO): piece = floor(numel / world) elements
// each, rank r owning [r x piece, (r + 1) x piece), and the last rank also the remainder (fewer
// than `world` elements) up to numel. `counts` are all ranks' counts (an allgatherv's). The
// first world x piece elements are reduce-scattered as they are (no padding, no copy); the
// remainder is allreduced in place, a message of under `world` elements.
struct BucketShard {
  std::int64_t piece = 0;            // floor(numel / world): every rank's share but the remainder
  std::int64_t begin = 0;            // this rank's first element in the bucket
  std::int64_t count = 0;            // this rank's elements
  std::vector<std::int64_t> counts;  // every rank's count, in rank order
};
BucketShard shard_bucket(std::int64_t numel, int world, int rank);  // rank `rank`'s piece (above)
// Keeps this rank's piece of `flat` (a bucket's numel elements: its gradients, or under ZeRO
// stage 3 its values) and zeroes the rest, giving its whole pages back (Tensor::zero_releasing_pages).
void release_other_pieces(const Tensor& flat, const BucketShard& shard);

// How a Reducer forms its buckets and reduces them.
struct ReducerOptions {
  std::vector<std::size_t> bucket_limits{25u << 20};  // bytes; see assign_buckets
  BucketRule rule = BucketRule::fusion;         // how a bucket closes (Horovod's or DDP's rule)
  Compression compression = Compression::none;  // the dtype on the wire
  comm::ReduceOp op = comm::ReduceOp::sum;      // the collective's op
  double prescale = 1.0;   // applied before compression (so dividing first avoids f16 overflow)
  double postscale = 1.0;  // applied after decompression
  ReduceHook hook{};       // empty: comm.allreduce_async(flat, op)
  // ZeRO stage 2: each bucket is reduce-scattered instead of allreduced, so only this rank's
  // piece of it (shard_bucket) holds the reduced gradient; the rest of the bucket is set to zero
  // and its whole pages given back to the system (Tensor::zero_releasing_pages), as are the
  // bucket's transient buffers: between steps a rank's gradient memory is its pieces. Every
  // bucket must be a view of the gradient arena; no hook.
  bool reduce_scatter = false;
  // At most this many buckets launched and not yet completed (0: no bound). Launching one more
  // first completes the oldest, on the engine's thread: the working set of full-size gradient
  // memory under reduce_scatter is then this many buckets plus the one being written.
  std::size_t max_buckets_in_flight = 0;
  // HSDP (dist/shard_groups.h), with reduce_scatter: the ranks of the other shard groups that own
  // the same pieces. Once a bucket's reduce-scatter inside the group has landed, this rank's
  // reduced piece is allreduced over them (on the engine's thread, when the bucket completes),
  // so only one piece per rank crosses between groups. Null, or of size 1: no other group.
  comm::Communicator* replicas = nullptr;
  // Who reduces with it, for the error when a parameter it reduces is already reduced by another
  // live Reducer ("DataParallel"): a gradient is reduced by one synchronizer, never two.
  std::string user = "a Reducer";
};

// One bucket as formed: its members and the layout of its flat buffer (what hooks receive).
struct BucketInfo {
  std::size_t index = 0;                    // its place in the launch order
  std::vector<Parameter*> members;          // in bucket order
  std::vector<std::int64_t> member_offset;  // element offset of each member in the flat buffer
  DType dtype = DType::f32;                 // of its gradients
  Device device;                            // where its gradients live
  std::int64_t numel = 0;  // flat buffer elements (padding between arena members included)
  bool arena_view = false;  // true: the flat buffer is a view of the gradient arena
  std::size_t bucket_count = 1;  // buckets of the Reducer: index bucket_count - 1 is launched last in a round
};

// The one reduction engine (docs/data_parallel.md): gradients collected into buckets, each
// launched asynchronously as soon as it and every bucket before it are complete, the same order
// on every rank, with compression, scaling and hooks. DataParallel and the DistributedOptimizer
// are front ends over it.
class Reducer {
 public:
  // `order`: the parameters to reduce, in bucket order (each once, trainable, of `registry`).
  // `groups`: parameter sets that must share a bucket (each member must be in `order`).
  Reducer(ParameterRegistry& registry, comm::Communicator& comm, std::vector<Parameter*> order,
          std::vector<std::vector<Parameter*>> groups, ReducerOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // One member's gradient is complete for this round. Errors: not a member, or ready twice in
  // one round (naming the parameter).
  void ready(const Parameter& parameter);
  // Launches every bucket not yet launched, in order; members never ready have their
  // gradient zero-filled when it is undefined. Returns the members that were never ready.
  std::vector<Parameter*> finish();
  // Waits for every launched bucket and writes the results back; then a new round begins.
  // finish() must have run (or every bucket launched by readiness).
  void wait();
  // Both, the usual end of a round.
  void synchronize() {
    finish();
    wait();
  }

  // Under reduce_scatter, before a backward that may add to gradients still holding this rank's
  // reduced pieces (Parameter::grad_holds_reduced_piece): each such piece is set aside and
  // zeroed, and the next completed round adds it to its own reduced piece (an accumulation over
  // synchronized microbatches, summed as FSDP sums). Between rounds; nothing to do otherwise.
  void set_aside_reduced_pieces();
  bool holds_reduced_pieces() const;  // pieces are set aside for the next round

  bool contains(const Parameter& parameter) const;  // a member of some bucket
  // True once anything happened this round: a member ready, or a bucket launched.
  bool round_started() const;
  bool all_launched() const;  // every bucket of this round is launched
  bool broken() const;        // a failure broke it: every later call is refused
  const std::string& broken_reason() const;  // empty while usable
  // Throws, naming `what` and the failure that broke this Reducer, when it is broken: what every
  // refusal of a broken Reducer (and of the front ends over it) says.
  void require_usable(const std::string& what) const;
  // The communicator the buckets travel on (this Reducer's duplicate; hooks receive it too).
  comm::Communicator& communicator() const;

  std::size_t bucket_count() const;                    // the number of buckets
  const BucketInfo& bucket(std::size_t index) const;    // one bucket, by launch order
  std::size_t bucket_of(const Parameter& parameter) const;  // a member's bucket (an error otherwise)
  const ReducerOptions& options() const;               // as given
  void set_scales(double prescale, double postscale);  // between rounds (ReducerOptions' meaning)
  void set_hook(ReduceHook hook);  // between rounds

  // Statistics since construction: bytes handed to the communicator, launches, and the time
  // wait() spent blocked (communication not hidden behind the caller's work).
  struct Stats {
    std::int64_t bytes_communicated = 0;        // bytes handed to the communicator
    std::int64_t buckets_launched = 0;          // launches
    std::chrono::nanoseconds wait_blocked{0};   // time wait() spent blocked
  };
  const Stats& stats() const;  // since construction

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradsync::dist
