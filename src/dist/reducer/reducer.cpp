// The Reducer (gradsync/dist/reducer/reducer.h): buckets over the gradient arena, ordered async launch.
// How buckets are formed is buckets.cpp's.
#include "gradsync/dist/reducer/reducer.h"

#include "claims.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <sstream>

#include "gradsync/comm/records/flight_recorder.h"
#include "gradsync/core/timeline.h"
#include "gradsync/kernels/ops.h"

namespace gradsync::dist {

namespace {

// Scale factors on integer gradients truncate, as Horovod's (its tests expect an integer
// prescale to truncate before the sum); floating gradients scale in their own dtype.
void scale_gradient(Tensor& values, double factor) {
  if (is_floating(values.dtype()) || factor == std::trunc(factor)) return ops::scale(values, factor);
  Tensor wide = values.to(DType::f64);
  ops::scale(wide, factor);
  ops::cast(wide, values);
}

// "bucket 2: fc1.weight, fc1.bias": what a bucket's collectives are called in the flight record.
std::shared_ptr<const std::string> bucket_label(const BucketInfo& info) {
  std::string label = "bucket " + std::to_string(info.index) + ":";
  for (std::size_t m = 0; m < info.members.size(); ++m) {
    if (m == 4) {
      label += " (+" + std::to_string(info.members.size() - 4) + " more)";
      break;
    }
    label += (m ? ", " : " ") + info.members[m]->name();
  }
  return std::make_shared<const std::string>(std::move(label));
}
}  // namespace

struct Reducer::Impl {
  ParameterRegistry& registry;
  // The Reducer's own communicator (a duplicate of the caller's): buckets launch when this
  // rank's gradients are ready, an order no other rank shares, so they must not be in the same
  // sequence as anybody else's collectives (another Reducer's, DataParallel's status, the
  // user's). A world of one has no order to protect and uses the caller's.
  std::unique_ptr<comm::Communicator> own_comm;
  comm::Communicator& comm;
  ReducerOptions options;
  std::string broken;  // the first failure; every later call refuses with it

  struct Bucket {
    BucketInfo info;
    Tensor flat;        // arena view, or own buffer
    Tensor compressed;  // the wire buffer when compressing (created on first use)
    Tensor piece;       // reduce_scatter: this rank's reduced piece
    Tensor set_aside;   // reduce_scatter: the reduced piece of earlier rounds, while a round adds to it
    comm::WorkHandle tail_work;  // reduce_scatter: the remainder's allreduce
    std::vector<bool> ready;
    std::size_t pending = 0;
    bool launched = false;
    comm::WorkHandle work;
    std::shared_ptr<const std::string> label;  // its operations' name in the flight record
  };
  std::vector<Bucket> buckets;
  std::vector<std::pair<std::size_t, std::size_t>> slot_of;  // registry index -> (bucket, member); bucket npos if none
  std::optional<ReductionClaim> claim;  // the gradients this Reducer alone reduces
  std::size_t next_to_launch = 0;
  std::size_t next_to_complete = 0;  // buckets complete in launch order
  bool started = false;
  Stats stats;

  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  Impl(ParameterRegistry& registry_, comm::Communicator& comm_, ReducerOptions options_)
      : registry(registry_), own_comm(comm_.size() > 1 ? comm_.duplicate() : nullptr),
        comm(own_comm ? *own_comm : comm_), options(std::move(options_)) {}

  void require_usable(const std::string& what) const {
    GRADSYNC_CHECK(broken.empty(), what, ": this Reducer is broken by an earlier failure and can no longer ",
                   "reduce (the ranks' rounds are out of step); the failure was: ", broken);
  }

  // After a failure: wait for every Work still in flight (each is bounded by the timeout, and
  // fails at once on a broken communicator), so nothing writes the arena behind the caller's
  // back, then refuse everything from now on.
  void fail(const std::exception_ptr& error) {
    if (broken.empty()) {
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        broken = e.what();
      } catch (...) {
        broken = "an unknown exception";
      }
    }
    drain();
  }

  void drain() noexcept {
    comm::FirstError ignored;  // the failure that made us drain is the one reported
    for (Bucket& bucket : buckets) {
      ignored.wait(bucket.tail_work);
      ignored.wait(bucket.work);
    }
  }

  const std::pair<std::size_t, std::size_t>& slot(const Parameter& parameter, const char* what) const {
    GRADSYNC_CHECK(parameter.index() < slot_of.size() && &registry[parameter.index()] == &parameter &&
                       slot_of[parameter.index()].first != npos,
                   what, ": parameter '", parameter.name(), "' is not reduced by this reducer");
    return slot_of[parameter.index()];
  }

  void build(const std::vector<Parameter*>& order, const std::vector<std::vector<Parameter*>>& groups) {
    GRADSYNC_CHECK(registry.finalized(), "Reducer: finalize the registry first");
    slot_of.assign(registry.size(), {npos, 0});
    std::vector<int> position(registry.size(), -1);
    std::vector<std::size_t> sizes;
    std::vector<int> keys;
    std::map<std::pair<int, int>, int> key_of;  // (device code, dtype) -> key
    for (std::size_t i = 0; i < order.size(); ++i) {
      Parameter* parameter = order[i];
      GRADSYNC_CHECK(parameter != nullptr, "Reducer: parameter ", i, " of the order is null");
      GRADSYNC_CHECK(parameter->index() < registry.size() && &registry[parameter->index()] == parameter, "Reducer: '",
                     parameter->name(), "' belongs to another registry");
      GRADSYNC_CHECK(parameter->requires_grad(), "Reducer: '", parameter->name(), "' is frozen (requires_grad false)");
      GRADSYNC_CHECK(position[parameter->index()] < 0, "Reducer: '", parameter->name(), "' appears twice");
      position[parameter->index()] = static_cast<int>(i);
      sizes.push_back(static_cast<std::size_t>(parameter->numel()) * dtype_size(parameter->grad_dtype()));
      const int device_code = parameter->device().is_cpu() ? -1 : parameter->device().index;
      const auto key = std::make_pair(device_code, static_cast<int>(parameter->grad_dtype()));
      keys.push_back(key_of.emplace(key, static_cast<int>(key_of.size())).first->second);
    }
    std::vector<int> together;
    if (!groups.empty()) {
      together.resize(order.size());
      for (std::size_t i = 0; i < order.size(); ++i) together[i] = static_cast<int>(i);
      std::vector<bool> grouped(order.size(), false);
      for (std::size_t g = 0; g < groups.size(); ++g) {
        for (Parameter* member : groups[g]) {
          GRADSYNC_CHECK(member != nullptr && member->index() < registry.size() && position[member->index()] >= 0,
                         "Reducer: group ", g, " holds a parameter that is not reduced",
                         member != nullptr ? " ('" + member->name() + "')" : std::string());
          const auto at = static_cast<std::size_t>(position[member->index()]);
          GRADSYNC_CHECK(!grouped[at], "Reducer: '", member->name(), "' appears in two groups");
          grouped[at] = true;
          together[at] = static_cast<int>(order.size() + g);
        }
      }
    }
    for (const std::vector<std::size_t>& indices : assign_buckets(sizes, keys, options.bucket_limits, options.rule, together)) {
      Bucket bucket;
      bucket.info.index = buckets.size();
      for (const std::size_t i : indices) bucket.info.members.push_back(order[i]);
      bucket.info.dtype = bucket.info.members[0]->grad_dtype();
      bucket.info.device = bucket.info.members[0]->device();
      lay_out(bucket);
      bucket.ready.assign(bucket.info.members.size(), false);
      bucket.pending = bucket.info.members.size();
      bucket.label = bucket_label(bucket.info);
      for (std::size_t m = 0; m < bucket.info.members.size(); ++m) {
        slot_of[bucket.info.members[m]->index()] = {buckets.size(), m};
      }
      GRADSYNC_CHECK(!options.reduce_scatter || bucket.info.arena_view, "Reducer: reduce_scatter (ZeRO stage 2) needs ",
                     "every bucket to be a view of the gradient arena, and bucket ", buckets.size(), " (",
                     bucket.info.members[0]->name(), ", ...) is not: its members are not neighbours in their arena ",
                     "(frozen parameters between them?)");
      buckets.push_back(std::move(bucket));
    }
    for (Bucket& bucket : buckets) bucket.info.bucket_count = buckets.size();
    GRADSYNC_CHECK(!(options.reduce_scatter && options.hook), "Reducer: reduce_scatter (ZeRO stage 2) and a reduce ",
                   "hook do not combine: a hook reduces the whole bucket");
    // One synchronizer per gradient (claims.h): last, once everything else about `order` is valid.
    claim.emplace(order, options.user);
  }

  // A bucket whose members are neighbours in one arena is a view of it (zero copies);
  // otherwise it gets its own flat buffer, members packed in bucket order.
  void lay_out(Bucket& bucket) {
    BucketInfo& info = bucket.info;
    std::vector<Parameter*> by_offset = info.members;
    std::sort(by_offset.begin(), by_offset.end(),
              [](const Parameter* a, const Parameter* b) { return a->arena_offset() < b->arena_offset(); });
    const Arena& arena = registry.arenas()[by_offset[0]->arena_index()];
    bool neighbours = true;
    const auto first = std::find(arena.parameters.begin(), arena.parameters.end(), by_offset[0]->index());
    for (std::size_t k = 0; k < by_offset.size(); ++k) {
      const auto at = first + static_cast<std::ptrdiff_t>(k);
      neighbours = neighbours && by_offset[k]->arena_index() == by_offset[0]->arena_index() && at < arena.parameters.end() &&
                   *at == by_offset[k]->index();
    }
    info.member_offset.clear();
    if (neighbours) {
      const std::size_t begin = by_offset.front()->arena_offset();
      const std::size_t end = by_offset.back()->arena_offset() + static_cast<std::size_t>(by_offset.back()->numel());
      bucket.flat = arena.grads.view(begin, {static_cast<std::int64_t>(end - begin)});
      for (const Parameter* member : info.members) {
        info.member_offset.push_back(static_cast<std::int64_t>(member->arena_offset() - begin));
      }
      info.arena_view = true;
    } else {
      std::int64_t offset = 0;
      for (const Parameter* member : info.members) {
        info.member_offset.push_back(offset);
        offset += member->numel();
      }
      bucket.flat = Tensor::zeros({offset}, info.dtype, info.device);
      info.arena_view = false;
    }
    info.numel = bucket.flat.numel();
  }

  Tensor member_view(Bucket& bucket, std::size_t m) const {
    return bucket.flat.view(static_cast<std::size_t>(bucket.info.member_offset[m]), {bucket.info.members[m]->numel()});
  }

  // A bucket counts as launched only once its Work exists: a launch that throws (a hook, a
  // broken communicator, a failed cast) breaks the Reducer instead of leaving a hole.
  void launch_in_order() {
    try {
      while (next_to_launch < buckets.size() && buckets[next_to_launch].pending == 0) {
        // The working set's bound: the oldest bucket in flight completes before one more goes.
        if (options.max_buckets_in_flight > 0 && next_to_launch - next_to_complete >= options.max_buckets_in_flight) {
          complete_next();
        }
        launch(buckets[next_to_launch]);
        ++next_to_launch;
      }
    } catch (...) {
      fail(std::current_exception());
      throw;
    }
  }

  void launch(Bucket& bucket) {
    started = true;
    if (!bucket.info.arena_view) {
      for (std::size_t m = 0; m < bucket.info.members.size(); ++m) {
        Tensor target = member_view(bucket, m);
        ops::copy(bucket.info.members[m]->grad().flatten(), target);
      }
    }
    if (options.prescale != 1.0) scale_gradient(bucket.flat, options.prescale);
    Tensor* wire = &bucket.flat;
    const DType on_wire = wire_dtype(bucket.info.dtype, options.compression);
    if (on_wire != bucket.info.dtype) {
      if (!bucket.compressed.defined() || bucket.compressed.dtype() != on_wire) {
        bucket.compressed = transient_or_kept({bucket.info.numel}, on_wire, bucket.info.device);
      }
      ops::cast(bucket.flat, bucket.compressed);
      wire = &bucket.compressed;
    }
    if (timeline::enabled()) {
      std::string name = "launch bucket " + std::to_string(bucket.info.index) + ":";
      for (const Parameter* member : bucket.info.members) name += " " + member->name();
      timeline::instant("bucket", name);
    }
    const comm::OperationLabel label(bucket.label);
    if (options.reduce_scatter) {
      bucket.work = launch_reduce_scatter(bucket, *wire);
    } else {
      bucket.work = options.hook ? options.hook(comm, *wire, bucket.info) : comm.allreduce_async(*wire, options.op);
    }
    GRADSYNC_CHECK(bucket.work != nullptr, "Reducer: the reduce hook returned no Work for bucket ", bucket.info.index);
    bucket.launched = true;
    stats.bytes_communicated += static_cast<std::int64_t>(wire->nbytes());
    ++stats.buckets_launched;
  }

  // A bucket's own buffer. Kept from round to round, except under reduce_scatter, where it
  // lives only while its bucket is in flight (release_unowned drops it): then it is paged
  // memory of its own, mapped here and unmapped when dropped, so that the memory of buffers
  // made and dropped every step goes back to the system at once instead of staying in the
  // allocator's heap (which made the peak depend on the order the buffers came and went in).
  Tensor transient_or_kept(const Shape& shape, DType dtype, Device device) const {
    return options.reduce_scatter ? Tensor::zeros_paged(shape, dtype, device) : Tensor::empty(shape, dtype, device);
  }

  // ZeRO stage 2: the first world x piece elements of the wire buffer reduce-scattered into
  // this rank's piece, the remainder (under `world` elements, the last rank's) allreduced in
  // place. Returns the reduce-scatter's Work; the remainder's goes to bucket.tail_work.
  comm::WorkHandle launch_reduce_scatter(Bucket& bucket, Tensor& wire) {
    const BucketShard shard = shard_bucket(bucket.info.numel, comm.size(), comm.rank());
    const std::int64_t even = shard.piece * comm.size();
    if (even == 0) return comm.allreduce_async(wire, options.op);  // fewer elements than ranks: all the last rank's
    if (!bucket.piece.defined() || bucket.piece.dtype() != wire.dtype()) {
      bucket.piece = transient_or_kept({shard.piece}, wire.dtype(), bucket.info.device);
    }
    comm::WorkHandle work = comm.reduce_scatter_async(wire.view(0, {even}), bucket.piece, options.op);
    if (even < bucket.info.numel) {
      Tensor tail = wire.view(static_cast<std::size_t>(even), {bucket.info.numel - even});
      bucket.tail_work = comm.allreduce_async(tail, options.op);
    }
    return work;
  }

  // Completes the oldest launched bucket (buckets complete in launch order).
  void complete_next() {
    Bucket& bucket = buckets[next_to_complete];
    complete(bucket);
    ++next_to_complete;
  }

  void complete(Bucket& bucket) {
    const auto start = std::chrono::steady_clock::now();
    bucket.work->wait();
    stats.wait_blocked += std::chrono::steady_clock::now() - start;
    bucket.work.reset();
    if (bucket.tail_work) {
      bucket.tail_work->wait();
      bucket.tail_work.reset();
    }
    if (options.reduce_scatter) {
      if (options.replicas != nullptr && options.replicas->size() > 1) reduce_across_replicas(bucket);
      // Only this rank's piece is reduced: back into the bucket (decompressed), then scaled.
      // The last rank's remainder was reduced in place (in the wire buffer).
      const BucketShard shard = shard_bucket(bucket.info.numel, comm.size(), comm.rank());
      const std::int64_t even = shard.piece * comm.size();
      if (shard.piece > 0) {
        Tensor mine = bucket.flat.view(static_cast<std::size_t>(shard.begin), {shard.piece});
        ops::cast(bucket.piece, mine);  // a copy when not compressed
      }
      const Tensor* wire = bucket.compressed.defined() && bucket.compressed.dtype() != bucket.info.dtype
                               ? &bucket.compressed : &bucket.flat;
      if (comm.rank() + 1 == comm.size() && even < bucket.info.numel && wire != &bucket.flat) {
        Tensor tail = bucket.flat.view(static_cast<std::size_t>(even), {bucket.info.numel - even});
        ops::cast(wire->view(static_cast<std::size_t>(even), {bucket.info.numel - even}), tail);
      }
      if (shard.count > 0 && options.postscale != 1.0) {
        Tensor mine = bucket.flat.view(static_cast<std::size_t>(shard.begin), {shard.count});
        scale_gradient(mine, options.postscale);
      }
      if (bucket.set_aside.defined()) {  // the earlier rounds' sum, added to this one's
        Tensor mine = bucket.flat.view(static_cast<std::size_t>(shard.begin), {shard.count});
        ops::axpy(1.0, bucket.set_aside, mine);
        bucket.set_aside = Tensor();
      }
      release_unowned(bucket, shard);
      for (Parameter* member : bucket.info.members) {
        member->mark_grad_defined();
        member->mark_grad_reduced_piece(true);
      }
      return;
    }
    if (bucket.compressed.defined() && wire_dtype(bucket.info.dtype, options.compression) != bucket.info.dtype) {
      ops::cast(bucket.compressed, bucket.flat);
    }
    if (options.postscale != 1.0) scale_gradient(bucket.flat, options.postscale);
    for (std::size_t m = 0; m < bucket.info.members.size(); ++m) {
      Parameter& member = *bucket.info.members[m];
      if (!bucket.info.arena_view) {
        Tensor result = member_view(bucket, m);
        member.grad_for_overwrite().flatten().copy_from(result);
      }
      member.mark_grad_defined();
    }
  }

  // HSDP: this rank's reduced piece (and the last rank's remainder, reduced in place in the wire
  // buffer) summed with the same piece of every other shard group. A bucket smaller than the
  // group was allreduced whole inside it, so it crosses whole.
  void reduce_across_replicas(Bucket& bucket) {
    comm::Communicator& replicas = *options.replicas;
    Tensor& wire = bucket.compressed.defined() && bucket.compressed.dtype() != bucket.info.dtype ? bucket.compressed
                                                                                                 : bucket.flat;
    const BucketShard shard = shard_bucket(bucket.info.numel, comm.size(), comm.rank());
    const std::int64_t even = shard.piece * comm.size();
    const comm::OperationLabel label("across shard groups, " + *bucket.label);
    if (even == 0) {
      replicas.allreduce(wire, options.op);
      return;
    }
    replicas.allreduce(bucket.piece, options.op);
    if (comm.rank() + 1 == comm.size() && even < bucket.info.numel) {
      Tensor tail = wire.view(static_cast<std::size_t>(even), {bucket.info.numel - even});
      replicas.allreduce(tail, options.op);
    }
    stats.bytes_communicated += static_cast<std::int64_t>(shard.count * static_cast<std::int64_t>(dtype_size(wire.dtype())));
  }

  // Under reduce_scatter, a backward that adds to gradients still holding this rank's reduced
  // pieces (an accumulation over synchronized microbatches: MULTI_AUTO_SYNC, or FSDP's default
  // of a reduce-scatter per microbatch) would reduce those pieces again, on top of the others'
  // new gradients. So before it, each such piece moves to a buffer of its own (this rank's
  // elements only) and is zeroed in the arena; the round's completion adds it to the newly
  // reduced piece: sharded gradient += reduce_scatter(this round's gradients), as FSDP sums.
  void set_aside_reduced_pieces() {
    if (!options.reduce_scatter) return;
    for (Bucket& bucket : buckets) {
      const BucketShard shard = shard_bucket(bucket.info.numel, comm.size(), comm.rank());
      for (std::size_t m = 0; m < bucket.info.members.size(); ++m) {
        Parameter& member = *bucket.info.members[m];
        if (!member.grad_holds_reduced_piece()) continue;
        member.mark_grad_reduced_piece(false);
        const std::int64_t lo = std::max(bucket.info.member_offset[m], shard.begin);
        const std::int64_t hi = std::min(bucket.info.member_offset[m] + member.numel(), shard.begin + shard.count);
        if (lo >= hi) continue;
        if (!bucket.set_aside.defined()) bucket.set_aside = Tensor::zeros_paged({shard.count}, bucket.info.dtype, bucket.info.device);
        Tensor held = bucket.flat.view(static_cast<std::size_t>(lo), {hi - lo});
        bucket.set_aside.view(static_cast<std::size_t>(lo - shard.begin), {hi - lo}).copy_from(held);
        held.zero_releasing_pages();
      }
    }
  }

  bool holds_reduced_pieces() const {
    for (const Bucket& bucket : buckets) {
      for (const Parameter* member : bucket.info.members) {
        if (member->grad_holds_reduced_piece()) return true;
      }
    }
    return false;
  }

  // Under reduce_scatter, once this rank's piece is in place: the rest of the bucket (other
  // ranks' pieces, here only this rank's unreduced gradients) is zeroed and its pages given
  // back, and the transient buffers are dropped. A rank's gradient memory between steps is then
  // its pieces (the gradient arena is paged: ParameterRegistry::finalize).
  void release_unowned(Bucket& bucket, const BucketShard& shard) {
    release_other_pieces(bucket.flat, shard);
    bucket.piece = Tensor();
    bucket.compressed = Tensor();
  }

  void reset_round() {
    for (Bucket& bucket : buckets) {
      std::fill(bucket.ready.begin(), bucket.ready.end(), false);
      bucket.pending = bucket.info.members.size();
      bucket.launched = false;
      bucket.work.reset();
      bucket.tail_work.reset();
    }
    next_to_launch = 0;
    next_to_complete = 0;
    started = false;
  }
};

Reducer::Reducer(ParameterRegistry& registry, comm::Communicator& comm, std::vector<Parameter*> order,
                 std::vector<std::vector<Parameter*>> groups, ReducerOptions options)
    : impl_(std::make_unique<Impl>(registry, comm, std::move(options))) {
  impl_->build(order, groups);
}

Reducer::~Reducer() {
  // Outstanding reductions still write into the arena: let them finish (bounded by the
  // communicator's timeout) before the buffers can go away. Errors were already reported.
  impl_->drain();
}

void Reducer::ready(const Parameter& parameter) {
  impl_->require_usable("Reducer::ready");
  const auto [b, m] = impl_->slot(parameter, "Reducer::ready");
  Impl::Bucket& bucket = impl_->buckets[b];
  GRADSYNC_CHECK(!bucket.ready[m], "the gradient of parameter '", parameter.name(),
                 "' was marked ready twice in one backward pass");
  bucket.ready[m] = true;
  impl_->started = true;
  --bucket.pending;
  impl_->launch_in_order();
}

std::vector<Parameter*> Reducer::finish() {
  impl_->require_usable("Reducer::finish");
  std::vector<Parameter*> never_ready;
  for (std::size_t b = impl_->next_to_launch; b < impl_->buckets.size(); ++b) {
    Impl::Bucket& bucket = impl_->buckets[b];
    for (std::size_t m = 0; m < bucket.info.members.size(); ++m) {
      if (bucket.ready[m]) continue;
      Parameter& member = *bucket.info.members[m];
      never_ready.push_back(&member);
      if (!member.grad_defined()) member.grad_for_accumulate();  // zero-filled: contributes nothing
      bucket.ready[m] = true;
    }
    bucket.pending = 0;
  }
  impl_->launch_in_order();
  return never_ready;
}

void Reducer::wait() {
  impl_->require_usable("Reducer::wait");
  GRADSYNC_CHECK(all_launched(), "Reducer::wait: bucket ", impl_->next_to_launch,
                 " was never launched (call finish() first)");
  try {
    timeline::Span blocked("wait", "wait");
    while (impl_->next_to_complete < impl_->buckets.size()) impl_->complete_next();
  } catch (...) {
    impl_->fail(std::current_exception());  // waits for the later buckets before anyone reuses the arena
    impl_->reset_round();
    throw;
  }
  impl_->reset_round();
}

bool Reducer::broken() const { return !impl_->broken.empty(); }
const std::string& Reducer::broken_reason() const { return impl_->broken; }
void Reducer::require_usable(const std::string& what) const { impl_->require_usable(what); }
comm::Communicator& Reducer::communicator() const { return impl_->comm; }

bool Reducer::contains(const Parameter& parameter) const {
  return parameter.index() < impl_->slot_of.size() && impl_->slot_of[parameter.index()].first != Impl::npos &&
         &impl_->registry[parameter.index()] == &parameter;
}

bool Reducer::round_started() const { return impl_->started; }
void Reducer::set_aside_reduced_pieces() { impl_->set_aside_reduced_pieces(); }
bool Reducer::holds_reduced_pieces() const { return impl_->holds_reduced_pieces(); }
bool Reducer::all_launched() const { return impl_->next_to_launch == impl_->buckets.size(); }
std::size_t Reducer::bucket_count() const { return impl_->buckets.size(); }
const BucketInfo& Reducer::bucket(std::size_t index) const {
  GRADSYNC_CHECK(index < impl_->buckets.size(), "Reducer::bucket: ", index, " of ", impl_->buckets.size());
  return impl_->buckets[index].info;
}
std::size_t Reducer::bucket_of(const Parameter& parameter) const { return impl_->slot(parameter, "Reducer::bucket_of").first; }
const ReducerOptions& Reducer::options() const { return impl_->options; }
void Reducer::set_scales(double prescale, double postscale) {
  impl_->require_usable("Reducer::set_scales");
  impl_->options.prescale = prescale;
  impl_->options.postscale = postscale;
}
void Reducer::set_hook(ReduceHook hook) {
  impl_->require_usable("Reducer::set_hook");
  GRADSYNC_CHECK(!impl_->started, "Reducer::set_hook during a round");
  GRADSYNC_CHECK(!impl_->options.reduce_scatter, "Reducer::set_hook: this Reducer reduce-scatters its buckets (ZeRO ",
                 "stage 2); a hook reduces the whole bucket and does not combine with it");
  impl_->options.hook = std::move(hook);
}
const Reducer::Stats& Reducer::stats() const { return impl_->stats; }

}  // namespace gradsync::dist
