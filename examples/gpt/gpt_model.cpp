// nanoGPT's GPT, forward and backward by hand (gpt_model.h). The step is written once, as the
// sequence of operations of gpt_kernels.h on the model's device; the shapes and the order of
// the operations are nanoGPT's model.py, line by line.
#include "gpt_model.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "gradsync/core/error.h"
#include "gradsync/kernels/ops.h"

#ifdef GPT_WITH_OPENBLAS
extern "C" void openblas_set_num_threads(int threads);
#endif

namespace gradsync::examples {

namespace {

// Memory of T on the model's device that a step keeps for the next (a gradsync Tensor: host or
// CUDA memory alike). Fresh buffers of a step's size come from mmap or cudaMalloc, whose cost
// (12% of a step on the host, in page faults) a reused buffer does not pay.
template <typename T>
class Buffer {
 public:
  // At least n elements, their values unspecified.
  T* reserve(Device device, std::int64_t n) {
    if (!memory_.defined() || memory_.numel() < n) memory_ = Tensor::empty({std::max<std::int64_t>(n, 1)}, dtype_of<T>(), device);
    return data();
  }
  T* data() const { return memory_.data_as<T>(); }
  // n elements from `offset`, on the host.
  std::vector<double> read(std::int64_t offset, std::int64_t n) const {
    return memory_.view(static_cast<std::size_t>(offset), {n}).to_double_vector();
  }
  void write(const std::vector<std::int32_t>& values) {  // from the host (copy_from only reads it)
    const std::int64_t n = static_cast<std::int64_t>(values.size());
    memory_.view(0, {n}).copy_from(Tensor::wrap(const_cast<std::int32_t*>(values.data()), {n}, DType::i32));
  }

 private:
  Tensor memory_;
};

// What one block keeps for its backward.
template <typename T>
struct BlockActivations {
  Buffer<T> input, ln_1, ln_1_mean, ln_1_rstd, qkv, att, y, x_1, ln_2, ln_2_mean, ln_2_rstd, fc, fc_gelu;
};

template <typename T>
struct Activations {
  Buffer<std::int32_t> tokens, targets;
  std::vector<BlockActivations<T>> blocks;
  Buffer<T> x_final, ln_f, ln_f_mean, ln_f_rstd, probs;  // probs: softmax of the logits
  Buffer<T> target_probs;  // each token's probability of its target (the loss is the mean of -log)
  // Working buffers of the forward and the backward.
  Buffer<T> x, projected, dlogits, dx, dln, dfc, dy, dqkv, dscores;
};

}  // namespace

template <>
const GptKernels<float>& Gpt::kernels<float>() const {
  return *f32_kernels_;
}
template <>
const GptKernels<double>& Gpt::kernels<double>() const {
  return *f64_kernels_;
}

// A parameter's values and gradient as the compute type T sees them: the parameter's own memory,
// or with bf16 parameters the f32 copies of this step (compute_).
template <typename T>
T* Gpt::values(Parameter* p) {
  if (dtype_ != DType::bf16) return p->value().data_as<T>();
  return compute_.at(p).values.data_as<T>();
}
template <typename T>
T* Gpt::grads(Parameter* p) {
  if (dtype_ != DType::bf16) return p->grad_for_accumulate().data_as<T>();
  return compute_.at(p).grads.data_as<T>();
}

// The gradient of `p` is complete: with bf16 parameters, this backward's f32 gradient is first
// added into the bf16 gradient (widened exactly, the sum rounded once per backward, as PyTorch's
// bf16 .grad is), through gradsync's own conversions on the parameter's device.
void Gpt::ready(Parameter* p) {
  if (dtype_ == DType::bf16) {
    Tensor grad = p->grad_for_accumulate();
    if (!sum_.defined() || sum_.numel() < p->numel()) sum_ = Tensor::empty({p->numel()}, DType::f32, device_);
    Tensor sum = sum_.view(0, p->shape());
    ops::cast(grad, sum);
    ops::axpy(1.0, compute_.at(p).grads, sum);
    ops::cast(sum, grad);
  }
  registry_.mark_ready(*p);
}

Gpt::Gpt(ParameterRegistry& registry, GptConfig config, DType dtype, Device device)
    : registry_(registry), config_(config), dtype_(dtype), device_(device) {
#ifdef GPT_WITH_OPENBLAS
  // One thread per rank, as the rest of the model (and the benchmark's PyTorch) runs: OpenBLAS
  // would otherwise start a thread per core in every rank.
  openblas_set_num_threads(1);
#endif
  GRADSYNC_CHECK(dtype == DType::f32 || dtype == DType::f64 || dtype == DType::bf16, "Gpt: f32, f64 or bf16 parameters, got ",
                 dtype_name(dtype));
  GRADSYNC_CHECK(config.embd % config.heads == 0, "Gpt: embd ", config.embd, " must divide into ", config.heads, " heads");
  if (dtype == DType::f64) {
    f64_kernels_ = make_gpt_kernels<double>(device);
  } else {
    f32_kernels_ = make_gpt_kernels<float>(device);
  }
  const std::int64_t c = config.embd;
  const auto add = [&](const std::string& name, const Shape& shape) { return &registry.add(name, shape, dtype, device); };
  wte_ = add("transformer.wte.weight", {config.vocab, c});
  wpe_ = add("transformer.wpe.weight", {config.block, c});
  for (std::int64_t l = 0; l < config.layers; ++l) {
    const std::string h = "transformer.h." + std::to_string(l) + ".";
    layers_.push_back(Layer{add(h + "ln_1.weight", {c}), add(h + "ln_1.bias", {c}), add(h + "attn.c_attn.weight", {3 * c, c}),
                            add(h + "attn.c_attn.bias", {3 * c}), add(h + "attn.c_proj.weight", {c, c}),
                            add(h + "attn.c_proj.bias", {c}), add(h + "ln_2.weight", {c}), add(h + "ln_2.bias", {c}),
                            add(h + "mlp.c_fc.weight", {4 * c, c}), add(h + "mlp.c_fc.bias", {4 * c}),
                            add(h + "mlp.c_proj.weight", {c, 4 * c}), add(h + "mlp.c_proj.bias", {c})});
  }
  ln_f_w_ = add("transformer.ln_f.weight", {c});
  ln_f_b_ = add("transformer.ln_f.bias", {c});
}

std::vector<std::vector<Parameter*>> Gpt::units() const {
  std::vector<std::vector<Parameter*>> units{{wte_, wpe_}};
  for (const Layer& l : layers_) {
    units.push_back({l.ln_1_w, l.ln_1_b, l.attn_w, l.attn_b, l.proj_w, l.proj_b, l.ln_2_w, l.ln_2_b, l.fc_w, l.fc_b,
                     l.fc_proj_w, l.fc_proj_b});
  }
  units.push_back({ln_f_w_, ln_f_b_});
  return units;
}

void Gpt::shard(dist::ZeroOptimizer* zero) {
  GRADSYNC_CHECK(zero == nullptr || dtype_ != DType::bf16, "Gpt::shard: ZeRO stage 3 with bf16 parameters is not ",
                 "supported by this model (its forward widens every weight to f32 at once); use f32");
  GRADSYNC_CHECK(zero == nullptr || zero->unit_count() == units().size(), "Gpt::shard: the ZeroOptimizer has ",
                 zero == nullptr ? 0 : zero->unit_count(), " units, the model ", units().size(),
                 " (DataParallelOptions::units = model.units())");
  zero_ = zero;
}

void Gpt::gather(std::size_t unit) {
  if (zero_ != nullptr) zero_->gather(unit);
}

void Gpt::release(std::size_t unit) {
  if (zero_ != nullptr) zero_->release(unit);
}

std::int64_t Gpt::parameter_count() const {
  std::int64_t total = 0;
  for (const Parameter& p : registry_) total += p.numel();
  return total;
}

void Gpt::initialize(std::uint64_t seed) {
  std::mt19937_64 engine(seed);
  const double projection_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.layers));
  for (Parameter& p : registry_) {
    const std::string& name = p.name();
    std::vector<double> v(static_cast<std::size_t>(p.numel()), 0.0);
    if (name.ends_with("ln_1.weight") || name.ends_with("ln_2.weight") || name.ends_with("ln_f.weight")) {
      std::fill(v.begin(), v.end(), 1.0);
    } else if (name.ends_with(".weight")) {
      std::normal_distribution<double> normal(0.0, name.ends_with("c_proj.weight") ? projection_std : 0.02);
      for (double& x : v) x = normal(engine);
    }
    p.value().copy_from(Tensor::from_vector(v, p.shape()).to(dtype_));
  }
}

double Gpt::forward(const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& targets,
                    std::int64_t batch, std::int64_t length) {
  GRADSYNC_CHECK(length >= 1 && length <= config_.block, "Gpt::forward: sequence length ", length, " outside [1, ",
                 config_.block, "]");
  GRADSYNC_CHECK(static_cast<std::int64_t>(tokens.size()) == batch * length &&
                     static_cast<std::int64_t>(targets.size()) == batch * length,
                 "Gpt::forward: ", tokens.size(), " tokens and ", targets.size(), " targets for ", batch, " x ", length);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    GRADSYNC_CHECK(tokens[i] >= 0 && tokens[i] < config_.vocab && targets[i] >= 0 && targets[i] < config_.vocab,
                   "Gpt::forward: token ", tokens[i], " or target ", targets[i], " at ", i, " outside the vocabulary of ",
                   config_.vocab);
  }
  batch_ = batch;
  length_ = length;
  if (dtype_ == DType::bf16) {
    // bf16 parameters, f32 arithmetic: every weight widened once per forward (the engine's
    // autocast), kept for the backward.
    for (Parameter& p : registry_) {
      Compute& compute = compute_[&p];
      if (!compute.values.defined()) {
        compute.values = Tensor::empty(p.shape(), DType::f32, device_);
        compute.grads = Tensor::empty(p.shape(), DType::f32, device_);
      }
      ops::cast(p.value(), compute.values);  // gradsync's conversion (exact: every bf16 is an f32)
    }
  }
  return dtype_ == DType::f64 ? forward_as<double>(tokens, targets) : forward_as<float>(tokens, targets);
}

std::vector<double> Gpt::probabilities(std::int64_t row) const {
  GRADSYNC_CHECK(saved_ != nullptr && row >= 0 && row < batch_ * length_, "Gpt::probabilities: no forward holds token ", row);
  const auto read = [&](const auto& act) { return act.probs.read(row * config_.vocab, config_.vocab); };
  return dtype_ == DType::f64 ? read(*static_cast<const Activations<double>*>(saved_.get()))
                              : read(*static_cast<const Activations<float>*>(saved_.get()));
}

void Gpt::backward(double loss_scale) {
  GRADSYNC_CHECK(saved_ != nullptr, "Gpt::backward: no forward to go back through");
  if (dtype_ == DType::bf16) {
    for (Parameter& p : registry_) ops::fill(compute_.at(&p).grads, 0.0);
  }
  dtype_ == DType::f64 ? backward_as<double>(loss_scale) : backward_as<float>(loss_scale);
}

template <typename T>
double Gpt::forward_as(const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& targets) {
  const GptKernels<T>& k = kernels<T>();
  const std::int64_t B = batch_, L = length_, C = config_.embd, V = config_.vocab, NH = config_.heads, hs = C / NH;
  const std::int64_t N = B * L;
  // The last forward's activations (a forward without a backward, as when sampling) or the last
  // backward's, reused; the first forward makes them.
  std::shared_ptr<void> kept = saved_ ? std::move(saved_) : std::move(spare_);
  auto act = kept ? std::static_pointer_cast<Activations<T>>(kept) : std::make_shared<Activations<T>>();
  act->blocks.resize(static_cast<std::size_t>(config_.layers));
  const auto buffer = [&](auto& b, std::int64_t n) { return b.reserve(device_, n); };
  buffer(act->tokens, N);
  buffer(act->targets, N);
  act->tokens.write(tokens);
  act->targets.write(targets);
  // Embeddings: token plus position.
  T* x = buffer(act->x, N * C);
  const std::size_t embeddings = 0, final_norm = layers_.size() + 1;  // units (units()); block l is l + 1
  gather(embeddings);  // kept to the end of the backward: the head uses wte too
  k.embed(x, act->tokens.data(), values<T>(wte_), values<T>(wpe_), N, L, C);
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    BlockActivations<T>& a = act->blocks[l];
    gather(l + 1);
    // x_1 = x + proj(attention(ln_1(x)))
    T* input = buffer(a.input, N * C);
    k.copy(input, x, N * C);
    T* ln_1 = buffer(a.ln_1, N * C);
    k.layernorm(ln_1, buffer(a.ln_1_mean, N), buffer(a.ln_1_rstd, N), input, values<T>(layer.ln_1_w),
                values<T>(layer.ln_1_b), N, C);
    T* qkv = buffer(a.qkv, N * 3 * C);
    k.linear(qkv, ln_1, values<T>(layer.attn_w), values<T>(layer.attn_b), N, C, 3 * C);
    T* y = buffer(a.y, N * C);
    k.attention(buffer(a.att, B * NH * L * L), y, qkv, B, L, NH, hs);
    T* projected = buffer(act->projected, N * C);
    k.linear(projected, y, values<T>(layer.proj_w), values<T>(layer.proj_b), N, C, C);
    T* x_1 = buffer(a.x_1, N * C);
    k.add(x_1, input, projected, N * C);
    // x = x_1 + mlp(ln_2(x_1)), the MLP c_proj(gelu(c_fc(.)))
    T* ln_2 = buffer(a.ln_2, N * C);
    k.layernorm(ln_2, buffer(a.ln_2_mean, N), buffer(a.ln_2_rstd, N), x_1, values<T>(layer.ln_2_w), values<T>(layer.ln_2_b),
                N, C);
    T* fc = buffer(a.fc, N * 4 * C);
    k.linear(fc, ln_2, values<T>(layer.fc_w), values<T>(layer.fc_b), N, C, 4 * C);
    T* fc_gelu = buffer(a.fc_gelu, N * 4 * C);
    k.gelu(fc_gelu, fc, N * 4 * C, config_.gelu_tanh);
    k.linear(projected, fc_gelu, values<T>(layer.fc_proj_w), values<T>(layer.fc_proj_b), N, 4 * C, C);
    k.add(x, x_1, projected, N * C);
    release(l + 1);
  }
  T* x_final = buffer(act->x_final, N * C);
  k.copy(x_final, x, N * C);
  gather(final_norm);  // kept: the backward begins with it
  T* ln_f = buffer(act->ln_f, N * C);
  k.layernorm(ln_f, buffer(act->ln_f_mean, N), buffer(act->ln_f_rstd, N), x_final, values<T>(ln_f_w_), values<T>(ln_f_b_), N,
              C);
  // Logits through the tied embedding, their softmax in place, then the mean cross-entropy (the
  // softmax in the dtype, the loss summed in double on the host).
  T* probs = buffer(act->probs, N * V);
  k.linear(probs, ln_f, values<T>(wte_), nullptr, N, C, V);
  k.softmax(probs, buffer(act->target_probs, N), act->targets.data(), N, V);
  double loss = 0;
  for (const double p : act->target_probs.read(0, N)) loss -= std::log(p);
  saved_ = act;
  return loss / static_cast<double>(N);
}

template <typename T>
void Gpt::backward_as(double loss_scale) {
  const GptKernels<T>& k = kernels<T>();
  auto& act = *static_cast<Activations<T>*>(saved_.get());
  const std::int64_t B = batch_, L = length_, C = config_.embd, V = config_.vocab, NH = config_.heads, hs = C / NH;
  const std::int64_t N = B * L;
  const auto buffer = [&](auto& b, std::int64_t n) { return b.reserve(device_, n); };
  const auto zeroed = [&](Buffer<T>& b, std::int64_t n) {
    T* data = b.reserve(device_, n);
    k.zero(data, n);
    return data;
  };
  // d loss / d logits = (softmax - onehot) / N, times the loss scale.
  T* dlogits = buffer(act.dlogits, N * V);
  k.cross_entropy_backward(dlogits, act.probs.data(), act.targets.data(), static_cast<T>(loss_scale / static_cast<double>(N)),
                           N, V);
  // The head: dwte gets dlogits^T ln_f now (and the embedding's part at the very end).
  T* dx = zeroed(act.dx, N * C);
  T* dln = zeroed(act.dln, N * C);
  T* dwte = grads<T>(wte_);
  k.linear_backward(dln, dwte, nullptr, dlogits, act.ln_f.data(), values<T>(wte_), N, C, V);
  k.layernorm_backward(dx, grads<T>(ln_f_w_), grads<T>(ln_f_b_), dln, act.x_final.data(), values<T>(ln_f_w_),
                       act.ln_f_mean.data(), act.ln_f_rstd.data(), N, C);
  ready(ln_f_w_);
  ready(ln_f_b_);
  release(layers_.size() + 1);  // the final LayerNorm's unit

  for (std::int64_t l = config_.layers - 1; l >= 0; --l) {
    const Layer& layer = layers_[static_cast<std::size_t>(l)];
    BlockActivations<T>& a = act.blocks[static_cast<std::size_t>(l)];
    gather(static_cast<std::size_t>(l) + 1);
    // x = x_1 + mlp(ln_2(x_1)): dx flows to x_1 both directly and through the MLP.
    T* dfc = zeroed(act.dfc, N * 4 * C);
    k.linear_backward(dfc, grads<T>(layer.fc_proj_w), grads<T>(layer.fc_proj_b), dx, a.fc_gelu.data(),
                      values<T>(layer.fc_proj_w), N, 4 * C, C);
    ready(layer.fc_proj_w);
    ready(layer.fc_proj_b);
    k.gelu_backward(dfc, a.fc.data(), N * 4 * C, config_.gelu_tanh);
    k.zero(dln, N * C);
    k.linear_backward(dln, grads<T>(layer.fc_w), grads<T>(layer.fc_b), dfc, a.ln_2.data(), values<T>(layer.fc_w), N, C, 4 * C);
    ready(layer.fc_w);
    ready(layer.fc_b);
    k.layernorm_backward(dx, grads<T>(layer.ln_2_w), grads<T>(layer.ln_2_b), dln, a.x_1.data(), values<T>(layer.ln_2_w),
                         a.ln_2_mean.data(), a.ln_2_rstd.data(), N, C);
    ready(layer.ln_2_w);
    ready(layer.ln_2_b);
    // x_1 = input + proj(attention(ln_1(input))).
    T* dy = zeroed(act.dy, N * C);
    k.linear_backward(dy, grads<T>(layer.proj_w), grads<T>(layer.proj_b), dx, a.y.data(), values<T>(layer.proj_w), N, C, C);
    ready(layer.proj_w);
    ready(layer.proj_b);
    T* dqkv = zeroed(act.dqkv, N * 3 * C);
    k.attention_backward(dqkv, buffer(act.dscores, B * NH * L * L), dy, a.qkv.data(), a.att.data(), B, L, NH, hs);
    k.zero(dln, N * C);
    k.linear_backward(dln, grads<T>(layer.attn_w), grads<T>(layer.attn_b), dqkv, a.ln_1.data(), values<T>(layer.attn_w), N, C,
                      3 * C);
    ready(layer.attn_w);
    ready(layer.attn_b);
    k.layernorm_backward(dx, grads<T>(layer.ln_1_w), grads<T>(layer.ln_1_b), dln, a.input.data(), values<T>(layer.ln_1_w),
                         a.ln_1_mean.data(), a.ln_1_rstd.data(), N, C);
    ready(layer.ln_1_w);
    ready(layer.ln_1_b);
    release(static_cast<std::size_t>(l) + 1);
  }
  // The embeddings: each token's row and each position's row gather their positions' gradients.
  k.embed_backward(dwte, grads<T>(wpe_), dx, act.tokens.data(), N, L, C);
  ready(wpe_);
  ready(wte_);
  release(0);  // the embeddings' unit
  spare_ = std::move(saved_);  // the next forward reuses its memory
}

}  // namespace gradsync::examples
