// gradsync/kernels/ops.h - the arithmetic the layers above need, once per device.
//
// Every function checks its arguments (element counts, dtypes, devices), then dispatches on
// the device to the CPU implementation (Eigen maps / vectorizing loops) or the CUDA one
// (kernels in src/kernels/cuda). Errors name the operation and describe the tensors.
//
// Arithmetic on f16/bf16 is done in f32 and rounded once per result element, as PyTorch
// does on CPU. Integer tensors support everything, but scale/axpy only with an integral
// factor (an integer tensor cannot hold the product with 0.5; asking for it is an error).
// CUDA operations are issued on the legacy default stream and are complete when the
// function returns, except fill/scale/axpy/add/cast/copy between device buffers, which are
// ordered on that stream (any later gradsync call or cudaMemcpy observes their result).
#pragma once

#include "gradsync/core/tensor.h"

namespace gradsync::ops {

void fill(Tensor& x, double value);                              // x[i] = value
void copy(const Tensor& source, Tensor& destination);           // same dtype, any devices
void scale(Tensor& x, double alpha);                             // x[i] *= alpha
void axpy(double alpha, const Tensor& x, Tensor& y);             // y[i] += alpha * x[i]
void add(const Tensor& a, const Tensor& b, Tensor& out);         // out[i] = a[i] + b[i]
void cast(const Tensor& source, Tensor& destination);           // convert dtype, same device
double dot(const Tensor& a, const Tensor& b);                    // sum a[i] * b[i]
double squared_norm(const Tensor& x);                            // sum x[i]^2

// One pass over v[i] = factor * x[i] (each product rounded in x's compute type, as an in-place
// x.mul_(factor) would round it): the sum of squares and the largest |v[i]| accumulated in
// double, and how many v[i] are inf or NaN. What clipping by norm and loss scaling need.
struct NormStatistics {
  double sum_of_squares = 0.0;  // sum of v[i]^2
  double max_abs = 0.0;         // max |v[i]|
  std::int64_t nonfinite = 0;   // how many v[i] are inf or NaN
};
NormStatistics norm_statistics(const Tensor& x, double factor = 1.0);  // (above)

}  // namespace gradsync::ops
