// Linear, ReLU, Sequential (gradsync/nn/layers.h). CPU arithmetic through Eigen maps over the
// tensors' buffers (no copies); CUDA through src/nn/cuda/.
#include "gradsync/nn/layers.h"

#include <Eigen/Dense>
#include <cmath>
#include <random>

#include "gradsync/kernels/ops.h"
#include "kernels/cpu/eigen_rows.h"
#include "nn_kernels.h"

namespace gradsync::nn {

namespace {

template <typename T>
using Matrix = kernels::cpu::RowMatrix<T>;
template <typename T>
using Map = kernels::cpu::RowMap<T>;
template <typename T>
using ConstMap = kernels::cpu::ConstRowMap<T>;

void require_input(const char* layer, const Tensor& input, std::int64_t features, DType dtype, Device device) {
  GRADSYNC_CHECK(input.shape().size() == 2 && input.shape()[1] == features, layer, ": expected [batch, ", features,
                 "], got ", input.describe());
  GRADSYNC_CHECK(input.dtype() == dtype && input.device() == device, layer, ": expected ", dtype_name(dtype), " on ",
                 device.str(), ", got ", input.describe());
}

template <typename T>
void linear_forward_cpu(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) {
  const std::int64_t batch = x.shape()[0], in = w.shape()[1], out = w.shape()[0];
  ConstMap<T> X(x.data_as<T>(), batch, in);
  ConstMap<T> W(w.data_as<T>(), out, in);
  Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>> B(b.data_as<T>(), out);
  Map<T> Y(y.data_as<T>(), batch, out);
  Y.noalias() = X * W.transpose();
  Y.rowwise() += B;
}

template <typename T>
void linear_backward_cpu(const Tensor& x, const Tensor& w, const Tensor& gy, Tensor& gw, Tensor& gb, Tensor& gx) {
  const std::int64_t batch = x.shape()[0], in = w.shape()[1], out = w.shape()[0];
  ConstMap<T> X(x.data_as<T>(), batch, in);
  ConstMap<T> W(w.data_as<T>(), out, in);
  ConstMap<T> GY(gy.data_as<T>(), batch, out);
  Map<T> GW(gw.data_as<T>(), out, in);
  Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>> GB(gb.data_as<T>(), out);
  Map<T> GX(gx.data_as<T>(), batch, in);
  GW.noalias() += GY.transpose() * X;
  GB += GY.colwise().sum();
  GX.noalias() = GY * W;
}

// Layers compute in their parameters' dtype, or in f32 for f16/bf16 parameters (activations
// then stay f32: the 16-bit copy is what the model stores and communicates, f32 is what it
// computes in, as autocast does for matrix products with f32 accumulation).
DType compute_dtype(DType parameter_dtype) {
  return parameter_dtype == DType::f16 || parameter_dtype == DType::bf16 ? DType::f32 : parameter_dtype;
}

// The parameter's value in the compute dtype: the value itself, or a widened copy (exact).
Tensor compute_value(const Parameter& parameter) {
  const Tensor& value = parameter.value();
  return value.dtype() == compute_dtype(value.dtype()) ? value : value.to(compute_dtype(value.dtype()));
}

// Where a layer accumulates a parameter's gradient: the gradient buffer itself when it has the
// compute dtype (f32 "main grads" of a 16-bit model included), else a zeroed f32 scratch that
// commit_gradient() adds in, rounding once per element.
Tensor gradient_target(Parameter& parameter, DType compute) {
  if (parameter.grad_dtype() == compute) return parameter.grad_for_accumulate();
  return Tensor::zeros(parameter.shape(), compute, parameter.device());
}

void commit_gradient(Parameter& parameter, const Tensor& target) {
  if (parameter.grad_dtype() == target.dtype()) return;  // accumulated in place
  if (parameter.grad_defined()) {
    Tensor sum = parameter.grad().to(target.dtype());
    ops::axpy(1.0, target, sum);
    ops::cast(sum, parameter.grad_for_overwrite());
  } else {
    ops::cast(target, parameter.grad_for_overwrite());
  }
}

}  // namespace

Linear::Linear(ParameterRegistry& registry, const std::string& name, std::int64_t in_features, std::int64_t out_features,
               DType dtype, Device device, std::optional<DType> grad_dtype)
    : registry_(registry), in_(in_features), out_(out_features) {
  GRADSYNC_CHECK(is_floating(dtype), "Linear '", name, "': parameters f32, f64, f16 or bf16, got ", dtype_name(dtype));
  weight_ = &registry.add(name + ".weight", {out_features, in_features}, dtype, device, true, grad_dtype);
  bias_ = &registry.add(name + ".bias", {out_features}, dtype, device, true, grad_dtype);
}

void Linear::initialize(std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_));
  std::uniform_real_distribution<double> uniform(-bound, bound);
  for (Parameter* parameter : {weight_, bias_}) {
    std::vector<double> values(static_cast<std::size_t>(parameter->numel()));
    for (double& value : values) value = uniform(generator);
    parameter->value().copy_from(Tensor::from_vector(values, parameter->shape()).to(parameter->dtype()).to(parameter->device()));
  }
}

Tensor Linear::forward(const Tensor& input) {
  require_input("Linear forward", input, in_, compute_dtype(weight_->dtype()), weight_->device());
  input_ = input;
  const Tensor weight = compute_value(*weight_);
  const Tensor bias = compute_value(*bias_);
  Tensor output = Tensor::empty({input.shape()[0], out_}, input.dtype(), input.device());
  if (input.device().is_cuda()) {
    cuda::linear_forward(input, weight, bias, output);
  } else {
    with_float(input.dtype(), [&]<typename T>(T) { linear_forward_cpu<T>(input, weight, bias, output); });
  }
  return output;
}

Tensor Linear::backward(const Tensor& grad_output) {
  GRADSYNC_CHECK(input_.defined(), "Linear '", weight_->name(), "': backward before forward");
  const DType compute = compute_dtype(weight_->dtype());
  require_input("Linear backward", grad_output, out_, compute, weight_->device());
  GRADSYNC_CHECK(grad_output.shape()[0] == input_.shape()[0], "Linear backward: gradient of ", grad_output.shape()[0],
                 " rows for a forward of ", input_.shape()[0]);
  Tensor grad_input = Tensor::empty({input_.shape()[0], in_}, input_.dtype(), input_.device());
  const Tensor weight = compute_value(*weight_);
  Tensor gw = gradient_target(*weight_, compute);
  Tensor gb = gradient_target(*bias_, compute);
  if (input_.device().is_cuda()) {
    cuda::linear_backward(input_, weight, grad_output, gw, gb, grad_input);
  } else {
    with_float(input_.dtype(), [&]<typename T>(T) { linear_backward_cpu<T>(input_, weight, grad_output, gw, gb, grad_input); });
  }
  commit_gradient(*weight_, gw);
  commit_gradient(*bias_, gb);
  // Both gradients are complete: say so at once (bias first: the order DDP's hooks see).
  registry_.mark_ready(*bias_);
  registry_.mark_ready(*weight_);
  input_ = Tensor();
  return grad_input;
}

Tensor ReLU::forward(const Tensor& input) {
  Tensor output = Tensor::empty(input.shape(), input.dtype(), input.device());
  if (input.device().is_cuda()) {
    cuda::relu_forward(input, output);
  } else {
    with_float(input.dtype(), [&]<typename T>(T) {
      const T* x = input.data_as<T>();
      T* y = output.data_as<T>();
      for (std::int64_t i = 0; i < input.numel(); ++i) y[i] = x[i] > T(0) ? x[i] : T(0);
    });
  }
  output_ = output;
  return output;
}

Tensor ReLU::backward(const Tensor& grad_output) {
  GRADSYNC_CHECK(output_.defined() && output_.numel() == grad_output.numel(), "ReLU backward: gradient ",
                 grad_output.describe(), " does not match the forward's output");
  Tensor grad_input = Tensor::empty(grad_output.shape(), grad_output.dtype(), grad_output.device());
  if (grad_output.device().is_cuda()) {
    cuda::relu_backward(output_, grad_output, grad_input);
  } else {
    with_float(grad_output.dtype(), [&]<typename T>(T) {
      const T* y = output_.data_as<T>();
      const T* gy = grad_output.data_as<T>();
      T* gx = grad_input.data_as<T>();
      for (std::int64_t i = 0; i < grad_output.numel(); ++i) gx[i] = y[i] > T(0) ? gy[i] : T(0);
    });
  }
  output_ = Tensor();
  return grad_input;
}

void Sequential::initialize(std::uint64_t seed) {
  registry_.finalize();
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    if (auto* linear = dynamic_cast<Linear*>(layers_[i].get())) linear->initialize(seed + i);
  }
}

Tensor Sequential::forward(const Tensor& input) {
  Tensor x = input;
  for (auto& layer : layers_) x = layer->forward(x);
  return x;
}

Tensor Sequential::backward(const Tensor& grad_output) {
  Tensor g = grad_output;
  for (auto it = layers_.rbegin(); it != layers_.rend(); ++it) g = (*it)->backward(g);
  return g;
}

}  // namespace gradsync::nn
