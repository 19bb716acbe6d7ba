// Internal: the arithmetic of the nn layers, per device. Row-major [rows, cols] buffers of
// one floating dtype (f32 or f64). The CPU versions use Eigen (src/nn/layers.cpp); the CUDA
// versions cuBLAS and small kernels (src/nn/cuda/nn_cuda.cu).
#pragma once

#include <cstdint>

#include "gradsync/core/tensor.h"

namespace gradsync::nn {

// Calls fn(float{}) or fn(double{}) for the dtype the nn layers compute in; anything else is
// an error naming it. Shared by the CPU and CUDA halves.
template <typename Fn>
void with_float(DType dtype, Fn&& fn) {
  if (dtype == DType::f32) return fn(float{});
  if (dtype == DType::f64) return fn(double{});
  detail::throw_error("nn layers compute in f32 or f64, got ", dtype_name(dtype));
}

}  // namespace gradsync::nn

namespace gradsync::nn::cuda {

// y[B, out] = x[B, in] W[out, in]^T + b
void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y);
// gw += gy^T x; gb += column sums of gy; gx = gy W
void linear_backward(const Tensor& x, const Tensor& w, const Tensor& gy, Tensor& gw, Tensor& gb, Tensor& gx);
// y = max(x, 0); gx = gy where y > 0
void relu_forward(const Tensor& x, Tensor& y);
void relu_backward(const Tensor& y, const Tensor& gy, Tensor& gx);

}  // namespace gradsync::nn::cuda
