// nanoGPT's GPT, forward and backward by hand (gpt_model.h). Row-major throughout: a [N, C]
// activation is N rows of C; a Linear's weight is [out, in], as PyTorch stores it, so
// y = x W^T + b. The products go through Eigen; the rest are plain loops a reader can check
// against model.py line by line.
#include "gpt_model.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <random>

#include "gradsync/core/error.h"
#include "gradsync/core/half.h"
#include "gradsync/kernels/ops.h"

#ifdef GPT_WITH_OPENBLAS
extern "C" void openblas_set_num_threads(int threads);
#endif

namespace gradsync::examples {

namespace {

template <typename T>
using Rows = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using View = Eigen::Map<Rows<T>>;
template <typename T>
using ConstView = Eigen::Map<const Rows<T>>;
// A block of columns of a wider row-major matrix (one head's q, k or v inside qkv).
template <typename T>
using Columns = Eigen::Map<const Rows<T>, 0, Eigen::OuterStride<>>;
template <typename T>
using MutableColumns = Eigen::Map<Rows<T>, 0, Eigen::OuterStride<>>;

// out[N, O] = in[N, I] W[O, I]^T + b[O]
template <typename T>
void linear(T* out, const T* in, const T* w, const T* b, std::int64_t n, std::int64_t i, std::int64_t o) {
  View<T> y(out, n, o);
  y.noalias() = ConstView<T>(in, n, i) * ConstView<T>(w, o, i).transpose();
  if (b != nullptr) y.rowwise() += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(b, o);
}

// The gradients of linear: din += dout W, dW += dout^T in, db += the column sums of dout.
template <typename T>
void linear_backward(T* din, T* dw, T* db, const T* dout, const T* in, const T* w, std::int64_t n, std::int64_t i,
                     std::int64_t o) {
  ConstView<T> g(dout, n, o);
  if (din != nullptr) View<T>(din, n, i).noalias() += g * ConstView<T>(w, o, i);
  View<T>(dw, o, i).noalias() += g.transpose() * ConstView<T>(in, n, i);
  if (db != nullptr) Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(db, o) += g.colwise().sum();
}

// LayerNorm over the last dimension (eps 1e-5, the biased variance, as nn.LayerNorm); keeps
// each row's mean and 1/std for the backward.
template <typename T>
void layernorm(T* out, T* mean, T* rstd, const T* x, const T* w, const T* b, std::int64_t n, std::int64_t c) {
  for (std::int64_t r = 0; r < n; ++r) {
    const T* row = x + r * c;
    T m = 0;
    for (std::int64_t j = 0; j < c; ++j) m += row[j];
    m /= static_cast<T>(c);
    T v = 0;
    for (std::int64_t j = 0; j < c; ++j) v += (row[j] - m) * (row[j] - m);
    v /= static_cast<T>(c);
    const T s = 1 / std::sqrt(v + static_cast<T>(1e-5));
    for (std::int64_t j = 0; j < c; ++j) out[r * c + j] = (row[j] - m) * s * w[j] + b[j];
    mean[r] = m;
    rstd[r] = s;
  }
}

// dx += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd, with dnorm = dout * w;
// dw += dout * norm; db += dout.
template <typename T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dout, const T* x, const T* w, const T* mean, const T* rstd,
                        std::int64_t n, std::int64_t c) {
  for (std::int64_t r = 0; r < n; ++r) {
    const T* g = dout + r * c;
    const T* row = x + r * c;
    T dnorm_mean = 0, dnorm_norm_mean = 0;
    for (std::int64_t j = 0; j < c; ++j) {
      const T norm = (row[j] - mean[r]) * rstd[r];
      dnorm_mean += g[j] * w[j];
      dnorm_norm_mean += g[j] * w[j] * norm;
    }
    dnorm_mean /= static_cast<T>(c);
    dnorm_norm_mean /= static_cast<T>(c);
    for (std::int64_t j = 0; j < c; ++j) {
      const T norm = (row[j] - mean[r]) * rstd[r];
      dx[r * c + j] += (g[j] * w[j] - dnorm_mean - norm * dnorm_norm_mean) * rstd[r];
      dw[j] += g[j] * norm;
      db[j] += g[j];
    }
  }
}

// GELU over n values, out = gelu(x), and its derivative multiplied into g (g *= gelu'(x)). The
// tanh form goes through Eigen's arrays, whose tanh is vectorized (a rational approximation
// within a few ulp, as PyTorch's own vectorized tanh); erf stays libm's.
template <typename T>
using Values = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
template <typename T>
using ConstValues = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

template <typename T>
void gelu(T* out, const T* in, std::int64_t n, bool tanh_form) {
  const ConstValues<T> x(in, n);
  if (tanh_form) {
    const T k = std::sqrt(static_cast<T>(2) / std::numbers::pi_v<T>);
    Values<T>(out, n) = static_cast<T>(0.5) * x * (1 + (k * (x + static_cast<T>(0.044715) * x * x * x)).tanh());
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(0.5) * in[i] * (1 + std::erf(in[i] / std::sqrt(static_cast<T>(2))));
}

template <typename T>
void gelu_backward(T* g, const T* in, std::int64_t n, bool tanh_form) {
  const ConstValues<T> x(in, n);
  if (tanh_form) {
    const T k = std::sqrt(static_cast<T>(2) / std::numbers::pi_v<T>);
    const Eigen::Array<T, Eigen::Dynamic, 1> t = (k * (x + static_cast<T>(0.044715) * x * x * x)).tanh();
    Values<T>(g, n) *= static_cast<T>(0.5) * (1 + t) +
                       static_cast<T>(0.5) * x * (1 - t * t) * k * (1 + 3 * static_cast<T>(0.044715) * x * x);
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const T cdf = static_cast<T>(0.5) * (1 + std::erf(in[i] / std::sqrt(static_cast<T>(2))));
    const T pdf = std::exp(-in[i] * in[i] / 2) / std::sqrt(2 * std::numbers::pi_v<T>);
    g[i] *= cdf + in[i] * pdf;
  }
}

// What one block keeps for its backward.
template <typename T>
struct BlockActivations {
  std::vector<T> input, ln_1, ln_1_mean, ln_1_rstd, qkv, att, y, x_1, ln_2, ln_2_mean, ln_2_rstd, fc, fc_gelu;
};

template <typename T>
struct Activations {
  std::vector<BlockActivations<T>> blocks;
  std::vector<T> x_final, ln_f, ln_f_mean, ln_f_rstd, probs;  // probs: softmax of the logits
  // Working buffers of the forward and the backward. The whole structure is kept from one step
  // to the next (Gpt::spare_), so that a step reuses its memory instead of allocating afresh:
  // fresh buffers of this size come from mmap, and their page faults cost 12% of a step.
  std::vector<T> x, projected, dlogits, dx, dln, dfc, dy, dqkv;
};

// `v` holding n zeros, its capacity kept.
template <typename T>
std::vector<T>& zeroed(std::vector<T>& v, std::int64_t n) {
  v.assign(static_cast<std::size_t>(n), T(0));
  return v;
}

}  // namespace

// A parameter's values and gradient as the compute type T sees them: the parameter's own memory,
// or with bf16 parameters the f32 copies of this step (compute_).
template <typename T>
T* Gpt::values(Parameter* p) {
  if (dtype_ != DType::bf16) return p->value().data_as<T>();
  return reinterpret_cast<T*>(compute_.at(p).values.data());
}
template <typename T>
T* Gpt::grads(Parameter* p) {
  if (dtype_ != DType::bf16) return p->grad_for_accumulate().data_as<T>();
  return reinterpret_cast<T*>(compute_.at(p).grads.data());
}

// The gradient of `p` is complete: with bf16 parameters, this backward's f32 gradient is first
// added into the bf16 gradient (rounded once per backward, as PyTorch's bf16 .grad is).
void Gpt::ready(Parameter* p) {
  if (dtype_ == DType::bf16) {
    const std::vector<float>& computed = compute_.at(p).grads;
    auto* bits = static_cast<std::uint16_t*>(p->grad_for_accumulate().data());
    for (std::size_t i = 0; i < computed.size(); ++i) bits[i] = float_to_bf16_bits(bf16_bits_to_float(bits[i]) + computed[i]);
  }
  registry_.mark_ready(*p);
}

Gpt::Gpt(ParameterRegistry& registry, GptConfig config, DType dtype) : registry_(registry), config_(config), dtype_(dtype) {
#ifdef GPT_WITH_OPENBLAS
  // One thread per rank, as the rest of the model (and the benchmark's PyTorch) runs: OpenBLAS
  // would otherwise start a thread per core in every rank.
  openblas_set_num_threads(1);
#endif
  GRADSYNC_CHECK(dtype == DType::f32 || dtype == DType::f64 || dtype == DType::bf16, "Gpt: f32, f64 or bf16 parameters, got ",
                 dtype_name(dtype));
  GRADSYNC_CHECK(config.embd % config.heads == 0, "Gpt: embd ", config.embd, " must divide into ", config.heads, " heads");
  const std::int64_t c = config.embd;
  const auto add = [&](const std::string& name, const Shape& shape) { return &registry.add(name, shape, dtype); };
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
  tokens_ = tokens;
  targets_ = targets;
  if (dtype_ == DType::bf16) {
    // bf16 parameters, f32 arithmetic: every weight widened once per forward (the engine's
    // autocast), kept for the backward.
    for (Parameter& p : registry_) {
      std::vector<float>& values = compute_[&p].values;
      values.resize(static_cast<std::size_t>(p.numel()));
      Tensor widened = Tensor::wrap(values.data(), p.shape(), DType::f32);
      ops::cast(p.value(), widened);  // gradsync's conversion (exact: every bf16 is an f32)
    }
  }
  return dtype_ == DType::f64 ? forward_as<double>(tokens, targets) : forward_as<float>(tokens, targets);
}

std::vector<double> Gpt::probabilities(std::int64_t row) const {
  GRADSYNC_CHECK(saved_ != nullptr && row >= 0 && row < batch_ * length_, "Gpt::probabilities: no forward holds token ", row);
  const auto read = [&](const auto& probs) {
    return std::vector<double>(probs.begin() + row * config_.vocab, probs.begin() + (row + 1) * config_.vocab);
  };
  return dtype_ == DType::f64 ? read(static_cast<const Activations<double>*>(saved_.get())->probs)
                              : read(static_cast<const Activations<float>*>(saved_.get())->probs);
}

void Gpt::backward(double loss_scale) {
  GRADSYNC_CHECK(saved_ != nullptr, "Gpt::backward: no forward to go back through");
  if (dtype_ == DType::bf16) {
    for (Parameter& p : registry_) compute_.at(&p).grads.assign(static_cast<std::size_t>(p.numel()), 0.0f);
  }
  dtype_ == DType::f64 ? backward_as<double>(loss_scale) : backward_as<float>(loss_scale);
}

template <typename T>
double Gpt::forward_as(const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& targets) {
  const std::int64_t B = batch_, L = length_, C = config_.embd, V = config_.vocab, NH = config_.heads, hs = C / NH;
  const std::int64_t N = B * L;
  // The last forward's activations (a forward without a backward, as when sampling) or the last
  // backward's, reused; the first forward makes them.
  std::shared_ptr<void> kept = saved_ ? std::move(saved_) : std::move(spare_);
  auto act = kept ? std::static_pointer_cast<Activations<T>>(kept) : std::make_shared<Activations<T>>();
  act->blocks.resize(static_cast<std::size_t>(config_.layers));
  // Embeddings: token plus position.
  std::vector<T>& x = act->x;
  x.resize(static_cast<std::size_t>(N * C));
  const std::size_t embeddings = 0, final_norm = layers_.size() + 1;  // units (units()); block l is l + 1
  gather(embeddings);  // kept to the end of the backward: the head uses wte too
  const T* wte = values<T>(wte_);
  const T* wpe = values<T>(wpe_);
  for (std::int64_t n = 0; n < N; ++n) {
    for (std::int64_t j = 0; j < C; ++j) x[static_cast<std::size_t>(n * C + j)] = wte[tokens[static_cast<std::size_t>(n)] * C + j] + wpe[(n % L) * C + j];
  }
  const T scale = 1 / std::sqrt(static_cast<T>(hs));
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    BlockActivations<T>& a = act->blocks[l];
    gather(l + 1);
    a.input = x;
    a.ln_1.resize(x.size());
    a.ln_1_mean.resize(static_cast<std::size_t>(N));
    a.ln_1_rstd.resize(static_cast<std::size_t>(N));
    layernorm(a.ln_1.data(), a.ln_1_mean.data(), a.ln_1_rstd.data(), x.data(), values<T>(layer.ln_1_w), values<T>(layer.ln_1_b), N, C);
    a.qkv.resize(static_cast<std::size_t>(N * 3 * C));
    linear(a.qkv.data(), a.ln_1.data(), values<T>(layer.attn_w), values<T>(layer.attn_b), N, C, 3 * C);
    // Causal self-attention, head by head, as products: the scores q k^T / sqrt(hs) (L x L), each
    // row t's softmax over the positions u <= t (the others 0), then y = att v. q, k and v are
    // column blocks of qkv (rows 3C apart), y a column block of a.y (rows C apart).
    a.att.assign(static_cast<std::size_t>(B * NH * L * L), 0);
    a.y.assign(static_cast<std::size_t>(N * C), 0);
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t h = 0; h < NH; ++h) {
        const T* head = &a.qkv[static_cast<std::size_t>(b * L * 3 * C + h * hs)];
        const Columns<T> q(head, L, hs, Eigen::OuterStride<>(3 * C));
        const Columns<T> k(head + C, L, hs, Eigen::OuterStride<>(3 * C));
        const Columns<T> v(head + 2 * C, L, hs, Eigen::OuterStride<>(3 * C));
        View<T> att(&a.att[static_cast<std::size_t>((b * NH + h) * L * L)], L, L);
        att.noalias() = scale * (q * k.transpose());
        for (std::int64_t t = 0; t < L; ++t) {
          T* row = &att(t, 0);
          const T largest = *std::max_element(row, row + t + 1);
          T sum = 0;
          for (std::int64_t u = 0; u <= t; ++u) sum += (row[u] = std::exp(row[u] - largest));
          for (std::int64_t u = 0; u <= t; ++u) row[u] /= sum;
          std::fill(row + t + 1, row + L, T(0));
        }
        MutableColumns<T>(&a.y[static_cast<std::size_t>(b * L * C + h * hs)], L, hs, Eigen::OuterStride<>(C)).noalias() =
            att * v;
      }
    }
    std::vector<T>& projected = act->projected;
    projected.resize(static_cast<std::size_t>(N * C));
    linear(projected.data(), a.y.data(), values<T>(layer.proj_w), values<T>(layer.proj_b), N, C, C);
    a.x_1.resize(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) a.x_1[i] = x[i] + projected[i];
    a.ln_2.resize(x.size());
    a.ln_2_mean.resize(static_cast<std::size_t>(N));
    a.ln_2_rstd.resize(static_cast<std::size_t>(N));
    layernorm(a.ln_2.data(), a.ln_2_mean.data(), a.ln_2_rstd.data(), a.x_1.data(), values<T>(layer.ln_2_w), values<T>(layer.ln_2_b), N, C);
    a.fc.resize(static_cast<std::size_t>(N * 4 * C));
    linear(a.fc.data(), a.ln_2.data(), values<T>(layer.fc_w), values<T>(layer.fc_b), N, C, 4 * C);
    a.fc_gelu.resize(a.fc.size());
    gelu(a.fc_gelu.data(), a.fc.data(), static_cast<std::int64_t>(a.fc.size()), config_.gelu_tanh);
    linear(projected.data(), a.fc_gelu.data(), values<T>(layer.fc_proj_w), values<T>(layer.fc_proj_b), N, 4 * C, C);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = a.x_1[i] + projected[i];
    release(l + 1);
  }
  act->x_final = x;
  gather(final_norm);  // kept: the backward begins with it
  act->ln_f.resize(x.size());
  act->ln_f_mean.resize(static_cast<std::size_t>(N));
  act->ln_f_rstd.resize(static_cast<std::size_t>(N));
  layernorm(act->ln_f.data(), act->ln_f_mean.data(), act->ln_f_rstd.data(), x.data(), values<T>(ln_f_w_), values<T>(ln_f_b_), N, C);
  // Logits through the tied embedding, then the mean cross-entropy (softmax in the dtype, the
  // loss summed in double).
  act->probs.resize(static_cast<std::size_t>(N * V));
  linear<T>(act->probs.data(), act->ln_f.data(), wte, nullptr, N, C, V);
  double loss = 0;
  for (std::int64_t n = 0; n < N; ++n) {
    T* row = &act->probs[static_cast<std::size_t>(n * V)];
    T largest = *std::max_element(row, row + V);
    T sum = 0;
    for (std::int64_t v = 0; v < V; ++v) sum += (row[v] = std::exp(row[v] - largest));
    for (std::int64_t v = 0; v < V; ++v) row[v] /= sum;
    loss -= std::log(static_cast<double>(row[targets[static_cast<std::size_t>(n)]]));
  }
  saved_ = act;
  return loss / static_cast<double>(N);
}

template <typename T>
void Gpt::backward_as(double loss_scale) {
  auto& act = *static_cast<Activations<T>*>(saved_.get());
  const std::int64_t B = batch_, L = length_, C = config_.embd, V = config_.vocab, NH = config_.heads, hs = C / NH;
  const std::int64_t N = B * L;
  // d loss / d logits = (softmax - onehot) / N, times the loss scale.
  std::vector<T>& dlogits = act.dlogits;
  dlogits = act.probs;
  const T per_token = static_cast<T>(loss_scale / static_cast<double>(N));
  for (std::int64_t n = 0; n < N; ++n) {
    T* row = &dlogits[static_cast<std::size_t>(n * V)];
    row[targets_[static_cast<std::size_t>(n)]] -= 1;
    for (std::int64_t v = 0; v < V; ++v) row[v] *= per_token;
  }
  // The head: dwte gets dlogits^T ln_f now (and the embedding's part at the very end).
  std::vector<T>& dx = zeroed(act.dx, N * C);
  std::vector<T>& dln = zeroed(act.dln, N * C);
  T* dwte = grads<T>(wte_);
  linear_backward<T>(dln.data(), dwte, nullptr, dlogits.data(), act.ln_f.data(), values<T>(wte_), N, C, V);
  layernorm_backward(dx.data(), grads<T>(ln_f_w_), grads<T>(ln_f_b_), dln.data(), act.x_final.data(), values<T>(ln_f_w_),
                     act.ln_f_mean.data(), act.ln_f_rstd.data(), N, C);
  ready(ln_f_w_);
  ready(ln_f_b_);
  release(layers_.size() + 1);  // the final LayerNorm's unit

  const T scale = 1 / std::sqrt(static_cast<T>(hs));
  for (std::int64_t l = config_.layers - 1; l >= 0; --l) {
    const Layer& layer = layers_[static_cast<std::size_t>(l)];
    BlockActivations<T>& a = act.blocks[static_cast<std::size_t>(l)];
    gather(static_cast<std::size_t>(l) + 1);
    // x = x_1 + mlp(ln_2(x_1)): dx flows to x_1 both directly and through the MLP.
    std::vector<T>& dfc = zeroed(act.dfc, N * 4 * C);
    linear_backward(dfc.data(), grads<T>(layer.fc_proj_w), grads<T>(layer.fc_proj_b), dx.data(), a.fc_gelu.data(),
                    values<T>(layer.fc_proj_w), N, 4 * C, C);
    ready(layer.fc_proj_w);
    ready(layer.fc_proj_b);
    gelu_backward(dfc.data(), a.fc.data(), static_cast<std::int64_t>(dfc.size()), config_.gelu_tanh);
    std::fill(dln.begin(), dln.end(), 0);
    linear_backward(dln.data(), grads<T>(layer.fc_w), grads<T>(layer.fc_b), dfc.data(), a.ln_2.data(), values<T>(layer.fc_w),
                    N, C, 4 * C);
    ready(layer.fc_w);
    ready(layer.fc_b);
    layernorm_backward(dx.data(), grads<T>(layer.ln_2_w), grads<T>(layer.ln_2_b), dln.data(), a.x_1.data(),
                       values<T>(layer.ln_2_w), a.ln_2_mean.data(), a.ln_2_rstd.data(), N, C);
    ready(layer.ln_2_w);
    ready(layer.ln_2_b);
    // x_1 = input + proj(attention(ln_1(input))).
    std::vector<T>& dy = zeroed(act.dy, N * C);
    linear_backward(dy.data(), grads<T>(layer.proj_w), grads<T>(layer.proj_b), dx.data(), a.y.data(), values<T>(layer.proj_w),
                    N, C, C);
    ready(layer.proj_w);
    ready(layer.proj_b);
    std::vector<T>& dqkv = zeroed(act.dqkv, N * 3 * C);
    // Back through y = att v and the softmax, head by head: dv += att^T dy; datt = dy v^T;
    // the scores' gradient att * (datt - the row's sum of att * datt) / sqrt(hs) (0 where masked,
    // since att is); dq += dscores k, dk += dscores^T q.
    Rows<T> dscores(L, L);
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t h = 0; h < NH; ++h) {
        const std::size_t head = static_cast<std::size_t>(b * L * 3 * C + h * hs);
        const Eigen::OuterStride<> qkv_rows(3 * C);
        const Columns<T> q(&a.qkv[head], L, hs, qkv_rows), k(&a.qkv[head + C], L, hs, qkv_rows),
            v(&a.qkv[head + 2 * C], L, hs, qkv_rows);
        MutableColumns<T> dq(&dqkv[head], L, hs, qkv_rows), dk(&dqkv[head + C], L, hs, qkv_rows),
            dv(&dqkv[head + 2 * C], L, hs, qkv_rows);
        const Columns<T> g(&dy[static_cast<std::size_t>(b * L * C + h * hs)], L, hs, Eigen::OuterStride<>(C));
        const ConstView<T> att(&a.att[static_cast<std::size_t>((b * NH + h) * L * L)], L, L);
        dv.noalias() += att.transpose() * g;
        dscores.noalias() = g * v.transpose();
        for (std::int64_t t = 0; t < L; ++t) {
          T weighted = 0;
          for (std::int64_t u = 0; u <= t; ++u) weighted += att(t, u) * dscores(t, u);
          for (std::int64_t u = 0; u < L; ++u) dscores(t, u) = u <= t ? att(t, u) * (dscores(t, u) - weighted) * scale : T(0);
        }
        dq.noalias() += dscores * k;
        dk.noalias() += dscores.transpose() * q;
      }
    }
    std::fill(dln.begin(), dln.end(), 0);
    linear_backward(dln.data(), grads<T>(layer.attn_w), grads<T>(layer.attn_b), dqkv.data(), a.ln_1.data(),
                    values<T>(layer.attn_w), N, C, 3 * C);
    ready(layer.attn_w);
    ready(layer.attn_b);
    layernorm_backward(dx.data(), grads<T>(layer.ln_1_w), grads<T>(layer.ln_1_b), dln.data(), a.input.data(),
                       values<T>(layer.ln_1_w), a.ln_1_mean.data(), a.ln_1_rstd.data(), N, C);
    ready(layer.ln_1_w);
    ready(layer.ln_1_b);
    release(static_cast<std::size_t>(l) + 1);
  }
  // The embeddings: each token's row and each position's row gather their positions' gradients.
  T* dwpe = grads<T>(wpe_);
  for (std::int64_t n = 0; n < N; ++n) {
    for (std::int64_t j = 0; j < C; ++j) {
      const T g = dx[static_cast<std::size_t>(n * C + j)];
      dwte[tokens_[static_cast<std::size_t>(n)] * C + j] += g;
      dwpe[(n % L) * C + j] += g;
    }
  }
  ready(wpe_);
  ready(wte_);
  release(0);  // the embeddings' unit
  spare_ = std::move(saved_);  // the next forward reuses its memory
}

}  // namespace gradsync::examples
