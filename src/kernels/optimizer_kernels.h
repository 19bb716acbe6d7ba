// Internal: the fused optimizer updates, once per device.
//
// An update runs over *segments*: contiguous element ranges of one arena that share their
// hyperparameters and step count (the optimizer merges neighbouring parameters into one
// segment, padding included, so a registry with one parameter group is typically a single
// segment per arena). Each element is read once and written once: parameter, gradient and
// every state buffer in one pass.
//
// The arithmetic mirrors torch.optim's single-tensor code operation by operation, in the
// parameter's own precision (f32 or f64), so that rounding follows PyTorch's closely; the
// scalars (bias corrections, step size) are computed in double on the host, as Python does,
// and converted once.
//
// Mixed precision is the same pass with a different load and store: the kernel steps the
// optimizer's f32 master copy, widening each 16-bit (or f32) gradient exactly on the way in,
// and writes the model's f16/bf16 copy (rounded to nearest even) on the way out. Before the
// update each gradient is multiplied by two factors, each product rounded in the compute type:
// the loss scaler's 1/scale, then the clipping coefficient (PyTorch's in-place
// grad.mul_(inv_scale) and grad.mul_(clip_coef), folded into the one pass; both are 1 when
// unused, and x * 1 is x exactly).
#pragma once

#include <cstdint>
#include <span>

#include "core/element.h"
#include "gradsync/core/device.h"
#include "gradsync/core/dtype.h"
#include "gradsync/core/error.h"
#include "gradsync/kernels/update_buffers.h"

namespace gradsync::kernels {

struct SgdSegment {
  std::int64_t begin;  // element offset in the arena
  std::int64_t count;
  double lr;
  double momentum;
  double dampening;
  double weight_decay;
  bool nesterov;
  bool maximize;
  bool first_step;  // the momentum buffer is initialized to the gradient, as PyTorch does
  double grad_unscale = 1.0;
  double grad_clip = 1.0;
};

struct AdamSegment {
  std::int64_t begin;
  std::int64_t count;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;           // L2 (Adam) or decoupled (AdamW)
  double decay_factor;           // AdamW: 1 - lr * weight_decay, applied to the parameter first
  double step_size;              // lr / (1 - beta1^step)
  double bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  bool amsgrad;
  bool maximize;
  bool decoupled;
  double grad_unscale = 1.0;
  double grad_clip = 1.0;
};

// Segments index from the buffers' pointers (kernels/update_buffers.h). momentum and
// max_exp_avg_sq may be null when the configuration does not use them. An unsupported
// combination of dtypes is an error.
namespace cpu {
void sgd_update(const UpdateBuffers& buffers, void* momentum, std::span<const SgdSegment> segments);
void adam_update(const UpdateBuffers& buffers, void* exp_avg, void* exp_avg_sq, void* max_exp_avg_sq,
                 std::span<const AdamSegment> segments);
}  // namespace cpu

namespace cuda {
void sgd_update(Device device, const UpdateBuffers& buffers, void* momentum, std::span<const SgdSegment> segments);
void adam_update(Device device, const UpdateBuffers& buffers, void* exp_avg, void* exp_avg_sq, void* max_exp_avg_sq,
                 std::span<const AdamSegment> segments);
}  // namespace cuda

// Calls fn(T{}, G{}, M*) for the supported combinations: T the param/state type (float or
// double), G the gradient storage type, M the model storage type (void when there is no
// separate model copy). Shared by both devices so they accept exactly the same set.
template <typename Fn>
void visit_update_types(const UpdateBuffers& b, const char* optimizer, Fn&& fn) {
  if (b.model == nullptr) {
    if (b.param_dtype == DType::f32 && b.grad_dtype == DType::f32) return fn(float{}, float{}, static_cast<void*>(nullptr));
    if (b.param_dtype == DType::f64 && b.grad_dtype == DType::f64) return fn(double{}, double{}, static_cast<void*>(nullptr));
  } else if (b.param_dtype == DType::f32 && (b.model_dtype == DType::f16 || b.model_dtype == DType::bf16)) {
    const auto with_grad = [&](auto* model) {
      switch (b.grad_dtype) {
        case DType::f32: return fn(float{}, float{}, model);
        case DType::f16: return fn(float{}, Half{}, model);
        case DType::bf16: return fn(float{}, BFloat16{}, model);
        default: break;
      }
      detail::throw_error(optimizer, ": ", dtype_name(b.grad_dtype), " gradients are not supported");
    };
    if (b.model_dtype == DType::f16) return with_grad(static_cast<Half*>(b.model));
    return with_grad(static_cast<BFloat16*>(b.model));
  }
  detail::throw_error(optimizer, ": parameters of dtype ", dtype_name(b.model ? b.model_dtype : b.param_dtype),
                      " with ", dtype_name(b.grad_dtype), " gradients are not supported (f32 and f64 step in place; "
                      "f16 and bf16 need f32 master weights)");
}

}  // namespace gradsync::kernels
