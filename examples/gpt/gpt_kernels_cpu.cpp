// The GPT's arithmetic on the host (gpt_kernels.h): the products through Eigen (which hands
// them to OpenBLAS where it is installed), the rest plain loops a reader can check against
// nanoGPT's model.py line by line.
#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <numbers>

#include "gpt_kernels.h"

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
template <typename T>
using Values = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
template <typename T>
using ConstValues = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

template <typename T>
class CpuGptKernels final : public GptKernels<T> {
 public:
  using i64 = std::int64_t;

  void zero(T* x, i64 n) const override { std::fill(x, x + n, T(0)); }
  void copy(T* out, const T* in, i64 n) const override { std::copy(in, in + n, out); }
  void add(T* out, const T* a, const T* b, i64 n) const override {
    for (i64 i = 0; i < n; ++i) out[i] = a[i] + b[i];
  }

  void embed(T* x, const std::int32_t* tokens, const T* wte, const T* wpe, i64 N, i64 L, i64 C) const override {
    for (i64 n = 0; n < N; ++n) {
      for (i64 j = 0; j < C; ++j) x[n * C + j] = wte[tokens[n] * C + j] + wpe[(n % L) * C + j];
    }
  }
  void embed_backward(T* dwte, T* dwpe, const T* dx, const std::int32_t* tokens, i64 N, i64 L, i64 C) const override {
    for (i64 n = 0; n < N; ++n) {
      for (i64 j = 0; j < C; ++j) {
        dwte[tokens[n] * C + j] += dx[n * C + j];
        dwpe[(n % L) * C + j] += dx[n * C + j];
      }
    }
  }

  void linear(T* out, const T* in, const T* w, const T* b, i64 N, i64 I, i64 O) const override {
    View<T> y(out, N, O);
    y.noalias() = ConstView<T>(in, N, I) * ConstView<T>(w, O, I).transpose();
    if (b != nullptr) y.rowwise() += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(b, O);
  }
  void linear_backward(T* din, T* dw, T* db, const T* dout, const T* in, const T* w, i64 N, i64 I, i64 O) const override {
    ConstView<T> g(dout, N, O);
    if (din != nullptr) View<T>(din, N, I).noalias() += g * ConstView<T>(w, O, I);
    View<T>(dw, O, I).noalias() += g.transpose() * ConstView<T>(in, N, I);
    if (db != nullptr) Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(db, O) += g.colwise().sum();
  }

  void layernorm(T* out, T* mean, T* rstd, const T* x, const T* w, const T* b, i64 N, i64 C) const override {
    for (i64 r = 0; r < N; ++r) {
      const T* row = x + r * C;
      T m = 0;
      for (i64 j = 0; j < C; ++j) m += row[j];
      m /= static_cast<T>(C);
      T v = 0;
      for (i64 j = 0; j < C; ++j) v += (row[j] - m) * (row[j] - m);
      v /= static_cast<T>(C);
      const T s = 1 / std::sqrt(v + static_cast<T>(1e-5));
      for (i64 j = 0; j < C; ++j) out[r * C + j] = (row[j] - m) * s * w[j] + b[j];
      mean[r] = m;
      rstd[r] = s;
    }
  }
  void layernorm_backward(T* dx, T* dw, T* db, const T* dout, const T* x, const T* w, const T* mean, const T* rstd, i64 N,
                          i64 C) const override {
    for (i64 r = 0; r < N; ++r) {
      const T* g = dout + r * C;
      const T* row = x + r * C;
      T dnorm_mean = 0, dnorm_norm_mean = 0;
      for (i64 j = 0; j < C; ++j) {
        const T norm = (row[j] - mean[r]) * rstd[r];
        dnorm_mean += g[j] * w[j];
        dnorm_norm_mean += g[j] * w[j] * norm;
      }
      dnorm_mean /= static_cast<T>(C);
      dnorm_norm_mean /= static_cast<T>(C);
      for (i64 j = 0; j < C; ++j) {
        const T norm = (row[j] - mean[r]) * rstd[r];
        dx[r * C + j] += (g[j] * w[j] - dnorm_mean - norm * dnorm_norm_mean) * rstd[r];
        dw[j] += g[j] * norm;
        db[j] += g[j];
      }
    }
  }

  // The tanh form through Eigen's arrays, whose tanh is vectorized (a rational approximation
  // within a few ulp, as PyTorch's own vectorized tanh); erf stays libm's.
  void gelu(T* out, const T* in, i64 n, bool tanh_form) const override {
    const ConstValues<T> x(in, n);
    if (tanh_form) {
      const T k = std::sqrt(static_cast<T>(2) / std::numbers::pi_v<T>);
      Values<T>(out, n) = static_cast<T>(0.5) * x * (1 + (k * (x + static_cast<T>(0.044715) * x * x * x)).tanh());
      return;
    }
    for (i64 i = 0; i < n; ++i) out[i] = static_cast<T>(0.5) * in[i] * (1 + std::erf(in[i] / std::sqrt(static_cast<T>(2))));
  }
  void gelu_backward(T* g, const T* in, i64 n, bool tanh_form) const override {
    const ConstValues<T> x(in, n);
    if (tanh_form) {
      const T k = std::sqrt(static_cast<T>(2) / std::numbers::pi_v<T>);
      const Eigen::Array<T, Eigen::Dynamic, 1> t = (k * (x + static_cast<T>(0.044715) * x * x * x)).tanh();
      Values<T>(g, n) *= static_cast<T>(0.5) * (1 + t) +
                         static_cast<T>(0.5) * x * (1 - t * t) * k * (1 + 3 * static_cast<T>(0.044715) * x * x);
      return;
    }
    for (i64 i = 0; i < n; ++i) {
      const T cdf = static_cast<T>(0.5) * (1 + std::erf(in[i] / std::sqrt(static_cast<T>(2))));
      const T pdf = std::exp(-in[i] * in[i] / 2) / std::sqrt(2 * std::numbers::pi_v<T>);
      g[i] *= cdf + in[i] * pdf;
    }
  }

  // Head by head, as products: q, k and v are column blocks of qkv (rows 3C apart), y a column
  // block of y (rows C apart).
  void attention(T* att_all, T* y, const T* qkv, i64 B, i64 L, i64 NH, i64 hs) const override {
    const i64 C = NH * hs;
    const T scale = 1 / std::sqrt(static_cast<T>(hs));
    for (i64 b = 0; b < B; ++b) {
      for (i64 h = 0; h < NH; ++h) {
        const T* head = qkv + b * L * 3 * C + h * hs;
        const Columns<T> q(head, L, hs, Eigen::OuterStride<>(3 * C));
        const Columns<T> k(head + C, L, hs, Eigen::OuterStride<>(3 * C));
        const Columns<T> v(head + 2 * C, L, hs, Eigen::OuterStride<>(3 * C));
        View<T> att(att_all + (b * NH + h) * L * L, L, L);
        att.noalias() = scale * (q * k.transpose());
        for (i64 t = 0; t < L; ++t) {
          T* row = &att(t, 0);
          const T largest = *std::max_element(row, row + t + 1);
          T sum = 0;
          for (i64 u = 0; u <= t; ++u) sum += (row[u] = std::exp(row[u] - largest));
          for (i64 u = 0; u <= t; ++u) row[u] /= sum;
          std::fill(row + t + 1, row + L, T(0));
        }
        MutableColumns<T>(y + b * L * C + h * hs, L, hs, Eigen::OuterStride<>(C)).noalias() = att * v;
      }
    }
  }
  void attention_backward(T* dqkv, T* dscores_all, const T* dy, const T* qkv, const T* att_all, i64 B, i64 L, i64 NH,
                          i64 hs) const override {
    const i64 C = NH * hs;
    const T scale = 1 / std::sqrt(static_cast<T>(hs));
    const Eigen::OuterStride<> qkv_rows(3 * C);
    for (i64 b = 0; b < B; ++b) {
      for (i64 h = 0; h < NH; ++h) {
        const i64 head = b * L * 3 * C + h * hs;
        const Columns<T> q(qkv + head, L, hs, qkv_rows), k(qkv + head + C, L, hs, qkv_rows),
            v(qkv + head + 2 * C, L, hs, qkv_rows);
        MutableColumns<T> dq(dqkv + head, L, hs, qkv_rows), dk(dqkv + head + C, L, hs, qkv_rows),
            dv(dqkv + head + 2 * C, L, hs, qkv_rows);
        const Columns<T> g(dy + b * L * C + h * hs, L, hs, Eigen::OuterStride<>(C));
        const ConstView<T> att(att_all + (b * NH + h) * L * L, L, L);
        View<T> dscores(dscores_all + (b * NH + h) * L * L, L, L);
        dv.noalias() += att.transpose() * g;
        dscores.noalias() = g * v.transpose();
        for (i64 t = 0; t < L; ++t) {
          T weighted = 0;
          for (i64 u = 0; u <= t; ++u) weighted += att(t, u) * dscores(t, u);
          for (i64 u = 0; u < L; ++u) dscores(t, u) = u <= t ? att(t, u) * (dscores(t, u) - weighted) * scale : T(0);
        }
        dq.noalias() += dscores * k;
        dk.noalias() += dscores.transpose() * q;
      }
    }
  }

  void softmax(T* logits, T* target_probs, const std::int32_t* targets, i64 N, i64 V) const override {
    for (i64 n = 0; n < N; ++n) {
      T* row = logits + n * V;
      const T largest = *std::max_element(row, row + V);
      T sum = 0;
      for (i64 v = 0; v < V; ++v) sum += (row[v] = std::exp(row[v] - largest));
      for (i64 v = 0; v < V; ++v) row[v] /= sum;
      target_probs[n] = row[targets[n]];
    }
  }
  void cross_entropy_backward(T* dlogits, const T* probs, const std::int32_t* targets, T scale, i64 N,
                              i64 V) const override {
    for (i64 n = 0; n < N; ++n) {
      for (i64 v = 0; v < V; ++v) dlogits[n * V + v] = (probs[n * V + v] - (v == targets[n] ? T(1) : T(0))) * scale;
    }
  }
};

}  // namespace

namespace detail {
template <typename T>
std::unique_ptr<GptKernels<T>> make_cpu_gpt_kernels() {
  return std::make_unique<CpuGptKernels<T>>();
}
template std::unique_ptr<GptKernels<float>> make_cpu_gpt_kernels<float>();
template std::unique_ptr<GptKernels<double>> make_cpu_gpt_kernels<double>();
}  // namespace detail

template <typename T>
std::unique_ptr<GptKernels<T>> make_gpt_kernels(Device device) {
  return device.is_cuda() ? detail::make_cuda_gpt_kernels<T>(device) : detail::make_cpu_gpt_kernels<T>();
}
template std::unique_ptr<GptKernels<float>> make_gpt_kernels<float>(Device);
template std::unique_ptr<GptKernels<double>> make_gpt_kernels<double>(Device);

}  // namespace gradsync::examples
