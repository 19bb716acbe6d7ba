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
#pragma once

#include <cstdint>
#include <span>

#include "gradsync/core/device.h"
#include "gradsync/core/dtype.h"

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
};

// Buffers are whole arenas; segments index into them. momentum / max_exp_avg_sq may be null
// when the configuration does not use them. Parameters and state share the dtype (f32 or f64).
namespace cpu {
void sgd_update(DType dtype, void* params, const void* grads, void* momentum, std::span<const SgdSegment> segments);
void adam_update(DType dtype, void* params, const void* grads, void* exp_avg, void* exp_avg_sq, void* max_exp_avg_sq,
                 std::span<const AdamSegment> segments);
}  // namespace cpu

namespace cuda {
void sgd_update(Device device, DType dtype, void* params, const void* grads, void* momentum,
                std::span<const SgdSegment> segments);
void adam_update(Device device, DType dtype, void* params, const void* grads, void* exp_avg, void* exp_avg_sq,
                 void* max_exp_avg_sq, std::span<const AdamSegment> segments);
}  // namespace cuda

}  // namespace gradsync::kernels
