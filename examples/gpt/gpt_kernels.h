// The arithmetic of the GPT example, per device. gpt_model.cpp writes the forward and the
// backward once, as a sequence of these operations on raw pointers into one device's memory;
// gpt_kernels_cpu.cpp does them on the host (Eigen, loops a reader can check against
// model.py), gpt_kernels.cu on a CUDA device (cuBLAS for the products, a small kernel for each
// of the rest, all queued on the thread's current stream: gradsync/core/stream.h).
//
// Row-major throughout: an activation [N, C] is N rows of C; a Linear's weight is [out, in],
// as PyTorch stores it, so y = x W^T + b. T is float or double. Every `+=` below accumulates
// into what the caller zeroed or what earlier microbatches left (gradients).
#pragma once

#include <cstdint>
#include <memory>

#include "gradsync/core/device.h"

namespace gradsync::examples {

template <typename T>
class GptKernels {
 public:
  using i64 = std::int64_t;
  virtual ~GptKernels() = default;

  virtual void zero(T* x, i64 n) const = 0;
  virtual void copy(T* out, const T* in, i64 n) const = 0;
  virtual void add(T* out, const T* a, const T* b, i64 n) const = 0;  // out = a + b (out may be a)

  // x[n, :] = wte[tokens[n], :] + wpe[n mod L, :], N = B L rows of C.
  virtual void embed(T* x, const std::int32_t* tokens, const T* wte, const T* wpe, i64 N, i64 L, i64 C) const = 0;
  // dwte[tokens[n], :] += dx[n, :]; dwpe[n mod L, :] += dx[n, :].
  virtual void embed_backward(T* dwte, T* dwpe, const T* dx, const std::int32_t* tokens, i64 N, i64 L, i64 C) const = 0;

  // out[N, O] = in[N, I] W[O, I]^T + b[O] (no bias when b is null).
  virtual void linear(T* out, const T* in, const T* w, const T* b, i64 N, i64 I, i64 O) const = 0;
  // din += dout W (skipped when din is null); dW += dout^T in; db += the column sums of dout.
  virtual void linear_backward(T* din, T* dw, T* db, const T* dout, const T* in, const T* w, i64 N, i64 I,
                               i64 O) const = 0;

  // LayerNorm over each row of C (eps 1e-5, the biased variance, as nn.LayerNorm); keeps each
  // row's mean and 1 / std for the backward.
  virtual void layernorm(T* out, T* mean, T* rstd, const T* x, const T* w, const T* b, i64 N, i64 C) const = 0;
  // dx += (dnorm - mean(dnorm) - norm mean(dnorm norm)) rstd, dnorm = dout w; dw += dout norm;
  // db += dout (the sums over the rows).
  virtual void layernorm_backward(T* dx, T* dw, T* db, const T* dout, const T* x, const T* w, const T* mean,
                                  const T* rstd, i64 N, i64 C) const = 0;

  // GELU (the tanh approximation, or the exact erf form): out = gelu(in); g *= gelu'(in).
  virtual void gelu(T* out, const T* in, i64 n, bool tanh_form) const = 0;
  virtual void gelu_backward(T* g, const T* in, i64 n, bool tanh_form) const = 0;

  // Causal self-attention of B sequences of L tokens, NH heads of hs: q, k and v are the column
  // blocks [0, C), [C, 2C), [2C, 3C) of qkv [B L, 3C] (head h their columns h hs ..); per
  // sequence and head, att = softmax over u <= t of q k^T / sqrt(hs) (0 above the diagonal),
  // [B, NH, L, L], and y = att v, head h into the columns h hs .. of y [B L, C].
  virtual void attention(T* att, T* y, const T* qkv, i64 B, i64 L, i64 NH, i64 hs) const = 0;
  // Back through it: dv += att^T dy; the scores' gradient att (dy v^T - its row's sum of
  // att dy v^T) / sqrt(hs), in `dscores` (scratch, [B, NH, L, L]); dq += dscores k; dk += dscores^T q.
  virtual void attention_backward(T* dqkv, T* dscores, const T* dy, const T* qkv, const T* att, i64 B, i64 L, i64 NH,
                                  i64 hs) const = 0;

  // Each row of logits [N, V] replaced by its softmax, and target_probs[n] = probs[n, targets[n]]
  // (the loss is the mean of -log of those: the caller sums them in double).
  virtual void softmax(T* logits, T* target_probs, const std::int32_t* targets, i64 N, i64 V) const = 0;
  // dlogits = (probs - onehot(targets)) scale.
  virtual void cross_entropy_backward(T* dlogits, const T* probs, const std::int32_t* targets, T scale, i64 N,
                                      i64 V) const = 0;
};

// The kernels of `device`: the host's, or a CUDA device's (an error naming the device when
// gradsync was built without CUDA).
template <typename T>
std::unique_ptr<GptKernels<T>> make_gpt_kernels(Device device);

namespace detail {
// The host's (gpt_kernels_cpu.cpp) and a CUDA device's (gpt_kernels.cu, or its stand-in when
// CUDA is not built: gpt_kernels_unavailable.cpp).
template <typename T>
std::unique_ptr<GptKernels<T>> make_cpu_gpt_kernels();
template <typename T>
std::unique_ptr<GptKernels<T>> make_cuda_gpt_kernels(Device device);
}  // namespace detail

}  // namespace gradsync::examples
