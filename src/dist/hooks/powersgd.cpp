// PowerSGD (powersgd.h), step by step as torch's powerSGD_hook, so that the same seed, model
// and data give the same P, Q, error and gradients (tests/reference/gen_powersgd.py).
#include "gradsync/dist/hooks/powersgd.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "dist/reducer/completed_work.h"
#include "off_thread.h"
#include "gradsync/kernels/ops.h"
#include "kernels/low_rank.h"
#include "torch_random.h"

namespace gradsync::dist {

struct PowerSGDState::Impl {
  PowerSGDOptions options;
  random::Mt19937 rng;  // numpy.random.RandomState(random_seed): one draw per bucket randomised
  std::int64_t iteration = 0;
  std::int64_t numel_before = 0;
  std::int64_t numel_after = 0;
  std::map<std::size_t, Tensor> error;     // by bucket: what the approximation missed on this rank
  std::map<std::size_t, Tensor> p_memory;  // by bucket: every compressed matrix's P, one buffer
  std::map<std::size_t, Tensor> q_memory;  // by bucket: ... and Q (kept for the warm start)
  // A working buffer kept from step to step (not state): a fresh copy every step would cost
  // more in page faults than the products (measured).
  std::map<std::size_t, Tensor> uncompressed;
};

namespace {

// `buffers[b]`, (re)made with `numel` elements of `dtype` on `device` when it differs.
Tensor& reuse(std::map<std::size_t, Tensor>& buffers, std::size_t b, std::int64_t numel, DType dtype, Device device) {
  Tensor& buffer = buffers[b];
  if (!buffer.defined() || buffer.numel() != numel || buffer.dtype() != dtype || buffer.device() != device) {
    buffer = Tensor::empty({numel}, dtype, device);
  }
  return buffer;
}

// `buffers[b]` moved to `device` when it is elsewhere (a state loaded from a checkpoint is on
// the host), or nullptr when there is none.
Tensor* on_device(std::map<std::size_t, Tensor>& buffers, std::size_t b, Device device) {
  auto found = buffers.find(b);
  if (found == buffers.end()) return nullptr;
  if (found->second.device() != device) found->second = found->second.to(device);
  return &found->second;
}

// "bucket 3 (h.0.weight, h.0.bias, ...)" for messages.
std::string bucket_name(const BucketInfo& info) {
  std::string name = "bucket " + std::to_string(info.index) + " (";
  for (std::size_t m = 0; m < info.members.size() && m < 3; ++m) name += (m ? ", " : "") + info.members[m]->name();
  return name + (info.members.size() > 3 ? ", ...)" : ")");
}

// Matrices of one shape, compressed together: `offsets` in the flat buffer (one matrix unless
// batched), and where the first one's P and Q start in the bucket's memories.
struct Block {
  std::vector<std::int64_t> offsets;
  std::vector<std::string> names;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t rank = 0;
  std::int64_t p_offset = 0;
  std::int64_t q_offset = 0;
};

struct Plain {
  std::int64_t offset;
  std::int64_t numel;
};

// One compressed gradient: M (rows x cols) in the bucket, its P (rows x r) and Q (cols x r)
// in the bucket's memories; all three are views.
struct Factors {
  Tensor m;
  Tensor p;
  Tensor q;
  std::string name;
};

// Orthonormalizes the P or Q (`which`) of every factor: torch's _orthogonalize (Gram-Schmidt
// to rank 2, Householder QR above), on the factors' device (src/kernels/low_rank.h).
void orthonormalize(std::vector<Factors>& factors, Tensor Factors::*which, const char* what, double epsilon) {
  std::vector<Tensor> matrices;
  matrices.reserve(factors.size());
  for (const Factors& f : factors) matrices.push_back(f.*which);
  const std::int64_t failed = kernels::orthonormalize_columns(matrices, epsilon);
  GRADSYNC_CHECK(failed < 0, "PowerSGD: the ", what, " of ", factors[static_cast<std::size_t>(failed)].name,
                 " has an all-zero column to orthogonalize (a vanishing gradient); set ",
                 "PowerSGDOptions::orthogonalization_epsilon (e.g. 1e-8), as PyTorch advises");
}

void compress_bucket(PowerSGDState::Impl& state, comm::Communicator& comm, Tensor& flat, const BucketInfo& info) {
  const PowerSGDOptions& options = state.options;
  const std::size_t b = info.index;
  const double world = comm.size();
  const DType dtype = flat.dtype();
  const Device device = flat.device();

  // Error feedback: last step's residue joins this step's gradient. The error buffer then holds
  // this input (torch keeps a copy of it apart: one more bucket-sized buffer), and at the end
  // the approximation is subtracted from it.
  if (options.use_error_feedback) {
    if (const Tensor* error = on_device(state.error, b, device)) {
      GRADSYNC_CHECK(error->numel() == flat.numel() && error->dtype() == flat.dtype(), "PowerSGD: ", bucket_name(info),
                     " holds ", flat.numel(), " ", dtype_name(flat.dtype()), " elements, its error feedback ",
                     error->numel(), " ", dtype_name(error->dtype()), ": the buckets changed under the state");
      ops::axpy(1.0, *error, flat);
    } else {
      state.error[b] = Tensor::empty({flat.numel()}, dtype, device);
    }
    ops::copy(flat, state.error[b]);
  }

  // Which tensors are worth compressing: (rows + cols) r x min_compression_rate < rows x cols.
  std::vector<Block> groups;  // one per shape, in order of first appearance
  std::vector<Plain> plain;
  std::int64_t p_total = 0;
  std::int64_t q_total = 0;
  std::int64_t plain_total = 0;
  for (std::size_t m = 0; m < info.members.size(); ++m) {
    const Parameter& member = *info.members[m];
    const std::int64_t rows = member.shape().empty() ? 1 : member.shape()[0];
    const std::int64_t cols = rows > 0 ? member.numel() / rows : 0;
    const std::int64_t rank = std::min({rows, cols, static_cast<std::int64_t>(options.matrix_approximation_rank)});
    const std::int64_t compressed = (rows + cols) * rank;
    state.numel_before += member.numel();
    if (member.numel() > 0 && static_cast<double>(compressed) * options.min_compression_rate < static_cast<double>(member.numel())) {
      state.numel_after += compressed;
      p_total += rows * rank;
      q_total += cols * rank;
      auto group = std::find_if(groups.begin(), groups.end(),
                                [&](const Block& g) { return g.rows == rows && g.cols == cols; });
      if (group == groups.end()) group = groups.insert(groups.end(), Block{{}, {}, rows, cols, rank, 0, 0});
      group->offsets.push_back(info.member_offset[m]);
      group->names.push_back(member.name());
    } else {
      state.numel_after += member.numel();
      plain.push_back({info.member_offset[m], member.numel()});
      plain_total += member.numel();
    }
  }
  // The blocks in memory order: by shape, a block per matrix unless batched.
  std::vector<Block> blocks;
  std::int64_t p_at = 0;
  std::int64_t q_at = 0;
  for (const Block& group : groups) {
    const std::size_t per_block = options.batch_tensors_with_same_shape ? group.offsets.size() : 1;
    for (std::size_t first = 0; first < group.offsets.size(); first += per_block) {
      Block block = group;
      block.offsets.assign(group.offsets.begin() + static_cast<std::ptrdiff_t>(first),
                           group.offsets.begin() + static_cast<std::ptrdiff_t>(first + per_block));
      block.names.assign(group.names.begin() + static_cast<std::ptrdiff_t>(first),
                         group.names.begin() + static_cast<std::ptrdiff_t>(first + per_block));
      block.p_offset = p_at;
      block.q_offset = q_at;
      p_at += static_cast<std::int64_t>(per_block) * block.rows * block.rank;
      q_at += static_cast<std::int64_t>(per_block) * block.cols * block.rank;
      blocks.push_back(std::move(block));
    }
  }

  const bool randomize = !options.warm_start || state.p_memory.count(b) == 0;
  if (randomize) {
    state.p_memory[b] = Tensor::empty({p_total}, dtype, device);
    state.q_memory[b] = Tensor::empty({q_total}, dtype, device);
  }
  Tensor& p_memory = *on_device(state.p_memory, b, device);
  Tensor& q_memory = *on_device(state.q_memory, b, device);
  GRADSYNC_CHECK(p_memory.numel() == p_total && q_memory.numel() == q_total && p_memory.dtype() == dtype &&
                     q_memory.dtype() == dtype,
                 "PowerSGD: ", bucket_name(info), " needs ", p_total, " + ", q_total, " ", dtype_name(dtype),
                 " elements of P and Q, its memory holds ", p_memory.numel(), " + ", q_memory.numel(), " ",
                 dtype_name(p_memory.dtype()), ": the buckets changed under the state");
  std::vector<Factors> factors;
  for (const Block& block : blocks) {
    for (std::size_t k = 0; k < block.offsets.size(); ++k) {
      const auto i = static_cast<std::int64_t>(k);
      factors.push_back({flat.view(static_cast<std::size_t>(block.offsets[k]), {block.rows, block.cols}),
                         p_memory.view(static_cast<std::size_t>(block.p_offset + i * block.rows * block.rank), {block.rows, block.rank}),
                         q_memory.view(static_cast<std::size_t>(block.q_offset + i * block.cols * block.rank), {block.cols, block.rank}),
                         block.names[k]});
    }
  }

  // Q: last step's (warm start), or random, the same on every rank (a shared seed). torch draws
  // on the CPU and copies to the device; so does this.
  if (randomize) {
    random::TorchNormal normal(static_cast<std::uint32_t>(random::numpy_randint(state.rng, 1'000'000'000)));
    Tensor drawn = device.is_cpu() ? q_memory : Tensor::empty({q_total}, dtype);
    for (const Block& block : blocks) {
      const auto n = static_cast<std::size_t>(block.offsets.size() * block.cols * block.rank);
      if (dtype == DType::f32) {
        normal.fill(drawn.data_as<float>() + block.q_offset, n);
      } else {
        normal.fill(drawn.data_as<double>() + block.q_offset, n);
      }
    }
    if (!device.is_cpu()) q_memory.copy_from(drawn);
  }
  const double epsilon = options.orthogonalization_epsilon;
  if (!factors.empty()) orthonormalize(factors, &Factors::q, "Q", epsilon);
  // P = M Q, summed over ranks, orthogonalized.
  for (Factors& f : factors) kernels::matmul(f.m, false, f.q, false, f.p);

  // The tensors not worth compressing: one message for all of them, averaged.
  Tensor& uncompressed = reuse(state.uncompressed, b, plain_total, dtype, device);
  std::int64_t at = 0;
  for (const Plain& piece : plain) {
    Tensor target = uncompressed.view(static_cast<std::size_t>(at), {piece.numel});
    ops::copy(flat.view(static_cast<std::size_t>(piece.offset), {piece.numel}), target);
    at += piece.numel;
  }
  comm.allreduce(uncompressed, comm::ReduceOp::sum);
  ops::scale(uncompressed, 1.0 / world);
  at = 0;
  for (const Plain& piece : plain) {
    Tensor target = flat.view(static_cast<std::size_t>(piece.offset), {piece.numel});
    ops::copy(uncompressed.view(static_cast<std::size_t>(at), {piece.numel}), target);
    at += piece.numel;
  }

  comm.allreduce(p_memory, comm::ReduceOp::sum);  // orthogonalized next: no division needed
  if (!factors.empty()) orthonormalize(factors, &Factors::p, "P", epsilon);
  // Q = M^T P, averaged; then M = P Q^T, the same on every rank.
  for (Factors& f : factors) kernels::matmul(f.m, true, f.p, false, f.q);
  comm.allreduce(q_memory, comm::ReduceOp::sum);
  ops::scale(q_memory, 1.0 / world);
  for (Factors& f : factors) kernels::matmul(f.p, false, f.q, true, f.m);

  if (options.use_error_feedback) ops::axpy(-1.0, flat, state.error[b]);  // the input less its approximation
  if (!options.warm_start) {
    state.p_memory.clear();
    state.q_memory.clear();
  }
}

}  // namespace

PowerSGDState::PowerSGDState(PowerSGDOptions options) : impl_(std::make_unique<Impl>()) {
  GRADSYNC_CHECK(options.matrix_approximation_rank >= 1, "PowerSGDOptions: matrix_approximation_rank must be >= 1, got ",
                 options.matrix_approximation_rank);
  GRADSYNC_CHECK(options.min_compression_rate > 0, "PowerSGDOptions: min_compression_rate must be > 0, got ",
                 options.min_compression_rate);
  GRADSYNC_CHECK(options.orthogonalization_epsilon >= 0, "PowerSGDOptions: orthogonalization_epsilon must be >= 0, got ",
                 options.orthogonalization_epsilon);
  // PyTorch's rule: DDP may rebuild its buckets after the first step, which would misplace the
  // error and the warm-started Q.
  GRADSYNC_CHECK(!(options.use_error_feedback || options.warm_start) || options.start_powerSGD_iter > 1,
                 "PowerSGDOptions: start_powerSGD_iter must be > 1 with use_error_feedback or warm_start, got ",
                 options.start_powerSGD_iter);
  impl_->options = options;
  impl_->rng = random::Mt19937(options.random_seed);
}

PowerSGDState::~PowerSGDState() = default;

const PowerSGDOptions& PowerSGDState::options() const { return impl_->options; }
std::int64_t PowerSGDState::iteration() const { return impl_->iteration; }
std::int64_t PowerSGDState::numel_before_compression() const { return impl_->numel_before; }
std::int64_t PowerSGDState::numel_after_compression() const { return impl_->numel_after; }

std::map<std::string, Tensor> PowerSGDState::state_dict() const {
  std::map<std::string, Tensor> state;
  const auto add = [&](const char* kind, const std::map<std::size_t, Tensor>& tensors) {
    for (const auto& [bucket, tensor] : tensors) {
      // Host copies, whatever the device: a checkpoint is written from the host.
      state[std::string(kind) + "." + std::to_string(bucket)] = tensor.device().is_cpu() ? tensor.clone() : tensor.to(Device::cpu());
    }
  };
  add("error", impl_->error);
  add("p", impl_->p_memory);
  add("q", impl_->q_memory);
  const std::vector<std::int64_t> counters{impl_->iteration, impl_->numel_before, impl_->numel_after};
  Tensor iteration = Tensor::empty({3}, DType::i64);
  std::copy(counters.begin(), counters.end(), iteration.data_as<std::int64_t>());
  state["iteration"] = iteration;
  const std::vector<std::int64_t> rng = impl_->rng.save();
  Tensor saved = Tensor::empty({static_cast<std::int64_t>(rng.size())}, DType::i64);
  std::copy(rng.begin(), rng.end(), saved.data_as<std::int64_t>());
  state["rng"] = saved;
  return state;
}

// Every entry is checked before the state changes (a state that loads is one the hook can run):
// the names, that each bucket's P comes with its Q, one floating dtype, sizes a whole number of
// rank-r columns, finite values, counters that a run could have reached. What it cannot know
// before a step, the buckets' shapes, the hook checks at its first step, naming the bucket.
void PowerSGDState::load_state_dict(const std::map<std::string, Tensor>& state) {
  Impl loaded;
  loaded.options = impl_->options;
  bool has_iteration = false;
  bool has_rng = false;
  const auto fail = [](const auto&... parts) { detail::throw_error("PowerSGDState::load_state_dict: ", parts...); };
  for (const auto& [name, tensor] : state) {
    GRADSYNC_CHECK(tensor.defined() && tensor.device().is_cpu(), "PowerSGDState::load_state_dict: '", name,
                   "' is not a host tensor");
    if (name == "iteration" || name == "rng") {
      GRADSYNC_CHECK(tensor.dtype() == DType::i64, "PowerSGDState::load_state_dict: '", name, "' must be i64, got ",
                     dtype_name(tensor.dtype()));
      const std::int64_t* values = tensor.data_as<std::int64_t>();
      if (name == "iteration") {
        GRADSYNC_CHECK(tensor.numel() == 3, "PowerSGDState::load_state_dict: 'iteration' holds 3 counters, got ",
                       tensor.numel());
        // Steps and elements a run could have counted: not negative, not past 2^53 (a double's
        // exact integers, where the compression rate is computed), no more sent than held.
        constexpr std::int64_t kMost = std::int64_t{1} << 53;
        for (int k = 0; k < 3; ++k) {
          if (values[k] < 0 || values[k] > kMost) {
            fail("'iteration' counter ", k, " (", k == 0 ? "the step" : k == 1 ? "elements held" : "elements sent",
                 ") is ", values[k], ", outside 0 to 2^53");
          }
        }
        if (values[2] > values[1]) fail("'iteration' says ", values[2], " elements were sent for ", values[1], " held");
        loaded.iteration = values[0];
        loaded.numel_before = values[1];
        loaded.numel_after = values[2];
        has_iteration = true;
      } else {
        loaded.rng.load(std::vector<std::int64_t>(values, values + tensor.numel()));
        has_rng = true;
      }
      continue;
    }
    const std::size_t dot = name.find('.');
    const std::string kind = name.substr(0, dot);
    std::size_t bucket = 0;
    try {
      GRADSYNC_CHECK(dot != std::string::npos, "");
      std::size_t used = 0;
      bucket = std::stoul(name.substr(dot + 1), &used);
      GRADSYNC_CHECK(used == name.size() - dot - 1, "");
    } catch (const std::exception&) {
      detail::throw_error("PowerSGDState::load_state_dict: '", name, "' is not error.<bucket>, p.<bucket>, q.<bucket>, ",
                          "iteration or rng");
    }
    GRADSYNC_CHECK(tensor.dtype() == DType::f32 || tensor.dtype() == DType::f64, "PowerSGDState::load_state_dict: '",
                   name, "' must be f32 or f64, got ", dtype_name(tensor.dtype()));
    std::map<std::size_t, Tensor>* target = kind == "error" ? &loaded.error
                                            : kind == "p"   ? &loaded.p_memory
                                            : kind == "q"   ? &loaded.q_memory
                                                            : nullptr;
    GRADSYNC_CHECK(target != nullptr, "PowerSGDState::load_state_dict: '", name,
                   "' is not error.<bucket>, p.<bucket>, q.<bucket>, iteration or rng");
    if (tensor.numel() == 0) fail("'", name, "' is empty");
    const Tensor flat = tensor.flatten().clone();
    const std::vector<double> values = flat.to_double_vector();
    const auto bad = std::find_if(values.begin(), values.end(), [](double v) { return !std::isfinite(v); });
    if (bad != values.end()) fail("'", name, "' holds ", *bad, " at element ", bad - values.begin());
    if (kind != "error" && flat.numel() % loaded.options.matrix_approximation_rank != 0) {
      fail("'", name, "' holds ", flat.numel(), " elements, not a whole number of rank-",
           loaded.options.matrix_approximation_rank, " factors (matrix_approximation_rank)");
    }
    (*target)[bucket] = flat;
  }
  GRADSYNC_CHECK(has_iteration && has_rng, "PowerSGDState::load_state_dict: the state lacks '",
                 has_iteration ? "rng" : "iteration", "'");
  // P and Q come in pairs; error feedback only where this state keeps it; one dtype throughout
  // (the gradients').
  for (const auto& [bucket, p] : loaded.p_memory) {
    if (!loaded.q_memory.count(bucket)) fail("'p.", bucket, "' has no 'q.", bucket, "' (P and Q are saved together)");
  }
  for (const auto& [bucket, q] : loaded.q_memory) {
    if (!loaded.p_memory.count(bucket)) fail("'q.", bucket, "' has no 'p.", bucket, "' (P and Q are saved together)");
  }
  if (!loaded.options.use_error_feedback && !loaded.error.empty()) {
    fail("'error.", loaded.error.begin()->first, "' is error feedback, which this state's options turn off");
  }
  std::optional<std::pair<std::string, DType>> first;
  for (const auto* kind : {&loaded.error, &loaded.p_memory, &loaded.q_memory}) {
    for (const auto& [bucket, tensor] : *kind) {
      const std::string name = std::string(kind == &loaded.error ? "error." : kind == &loaded.p_memory ? "p." : "q.") +
                               std::to_string(bucket);
      if (!first) first.emplace(name, tensor.dtype());
      if (tensor.dtype() != first->second) {
        fail("'", name, "' is ", dtype_name(tensor.dtype()), " and '", first->first, "' ", dtype_name(first->second),
             ": one state holds the gradients' one dtype");
      }
    }
  }
  *impl_ = std::move(loaded);
}

ReduceHook powersgd_hook(std::shared_ptr<PowerSGDState> state) {
  GRADSYNC_CHECK(state != nullptr, "powersgd_hook: no state");
  const bool overlap = state->options().overlap_backward;
  ReduceHook hook = [state](comm::Communicator& comm, Tensor& flat, const BucketInfo& info) -> comm::WorkHandle {
    PowerSGDState::Impl& impl = state->impl();
    if (impl.iteration < impl.options.start_powerSGD_iter) {
      comm.allreduce(flat, comm::ReduceOp::avg);  // plain averaging until PowerSGD starts
    } else {
      compress_bucket(impl, comm, flat, info);
    }
    if (info.index + 1 == info.bucket_count) ++impl.iteration;  // the round's last bucket ends a step
    return std::make_shared<CompletedWork>("powerSGD " + bucket_name(info));
  };
  if (overlap) hook = off_thread(std::move(hook));
  // The bucket's dtype checked on the caller's thread, where the launch can still refuse it.
  return [hook = std::move(hook)](comm::Communicator& comm, Tensor& flat, const BucketInfo& info) -> comm::WorkHandle {
    GRADSYNC_CHECK(flat.dtype() == DType::f32 || flat.dtype() == DType::f64, "PowerSGD: ", bucket_name(info), " holds ",
                   dtype_name(flat.dtype()), " gradients; PowerSGD runs on f32 and f64 (keep f32 gradients, or use ",
                   "Compression::bf16 instead)");
    return hook(comm, flat, info);
  };
}

}  // namespace gradsync::dist
