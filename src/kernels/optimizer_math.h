// Internal: the per-element optimizer arithmetic, shared by the CPU loops and the CUDA
// kernels so both devices compute exactly the same sequence of roundings. T is float or
// double; the scalars arrive already converted to T (as PyTorch converts Python floats to
// the tensor's dtype). Each line names the torch.optim statement it mirrors.
#pragma once

#include <cmath>

#include "gradsync/core/half.h"  // GRADSYNC_HOST_DEVICE

namespace gradsync::kernels {

// Exactly-rounded primitives. torch.optim's in-place ops round as follows on the CPU (checked
// against torch 1.13 on AVX2): add_(x, alpha) and addcmul_ are fused multiply-adds (one
// rounding); mul_, div and sqrt round once each; addcdiv_(t1, t2, value) computes
// self + (value * t1) / t2 with three roundings. mul_rn/add_rn stop
// nvcc from contracting what PyTorch rounds twice; fma_rn fuses where PyTorch does. The host
// build uses -ffp-contract=off for the same reason. With these, the CPU (FMA hardware or the
// exact libm fallback) and the GPU compute bit-identical results.
template <typename T>
GRADSYNC_HOST_DEVICE inline T mul_rn(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) return __fmul_rn(a, b); else return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

template <typename T>
GRADSYNC_HOST_DEVICE inline T add_rn(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) return __fadd_rn(a, b); else return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

template <typename T>
GRADSYNC_HOST_DEVICE inline T fma_rn(T a, T b, T c) {  // a * b + c, rounded once
#if defined(__CUDA_ARCH__)
  return fma(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// The gradient as the update sees it: unscaled by the loss scaler, then clipped, each product
// rounded once (torch: grad.mul_(inv_scale) in unscale_, grad.mul_(clip_coef) in clipping).
template <typename T>
GRADSYNC_HOST_DEVICE inline T scaled_gradient(T grad, T unscale, T clip) {
  return mul_rn(mul_rn(grad, unscale), clip);
}

template <typename T>
struct SgdScalars {
  T lr, momentum, one_minus_dampening, weight_decay, grad_unscale, grad_clip;
  bool use_momentum, nesterov, maximize, first_step, use_weight_decay;
};

template <typename T>
GRADSYNC_HOST_DEVICE inline void sgd_element(const SgdScalars<T>& s, T& param, T grad, T* momentum_buffer) {
  grad = scaled_gradient(grad, s.grad_unscale, s.grad_clip);
  T d_p = s.maximize ? -grad : grad;                                 // d_p = -grad if maximize
  if (s.use_weight_decay) d_p = fma_rn(param, s.weight_decay, d_p);   // d_p.add(param, alpha=wd)
  if (s.use_momentum) {
    T buf;
    if (s.first_step) {
      buf = d_p;                                                      // buf = clone(d_p)
    } else {                                                          // buf.mul_(momentum)
      buf = fma_rn(d_p, s.one_minus_dampening, mul_rn(*momentum_buffer, s.momentum));  // .add_(d_p, alpha=1-dampening)
    }
    *momentum_buffer = buf;
    d_p = s.nesterov ? fma_rn(buf, s.momentum, d_p) : buf;            // nesterov: d_p.add(buf, alpha=momentum)
  }
  param = fma_rn(d_p, -s.lr, param);                                  // param.add_(d_p, alpha=-lr)
}

template <typename T>
struct AdamScalars {
  T beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor, neg_step_size,
      bias_correction2_sqrt, grad_unscale, grad_clip;
  bool amsgrad, maximize, decoupled, use_l2;
};

template <typename T>
GRADSYNC_HOST_DEVICE inline void adam_element(const AdamScalars<T>& s, T& param, T grad, T& exp_avg, T& exp_avg_sq,
                                              T* max_exp_avg_sq) {
  grad = scaled_gradient(grad, s.grad_unscale, s.grad_clip);
  T g = s.maximize ? -grad : grad;                                    // grad = -grad if maximize
  if (s.decoupled) param = mul_rn(param, s.decay_factor);              // AdamW: param.mul_(1 - lr*wd)
  if (s.use_l2) g = fma_rn(param, s.weight_decay, g);                  // Adam: grad.add(param, alpha=wd)
  exp_avg = fma_rn(g, s.one_minus_beta1, mul_rn(exp_avg, s.beta1));    // exp_avg.mul_(b1).add_(g, alpha=1-b1)
  exp_avg_sq = fma_rn(mul_rn(s.one_minus_beta2, g), g, mul_rn(exp_avg_sq, s.beta2));  // .mul_(b2).addcmul_(g, g, 1-b2)
  T second = exp_avg_sq;
  if (s.amsgrad) {
    second = *max_exp_avg_sq > exp_avg_sq ? *max_exp_avg_sq : exp_avg_sq;  // torch.maximum(max, exp_avg_sq)
    *max_exp_avg_sq = second;
  }
  const T denom = add_rn(std::sqrt(second) / s.bias_correction2_sqrt, s.eps);   // (sqrt(v) / bc2_sqrt).add_(eps)
  param = add_rn(param, mul_rn(s.neg_step_size, exp_avg) / denom);              // param.addcdiv_(m, denom, -step_size)
}

// Host-side conversion of a segment's double scalars to T, done once per segment.
template <typename T, typename Segment>
SgdScalars<T> sgd_scalars(const Segment& segment) {
  return {static_cast<T>(segment.lr),
          static_cast<T>(segment.momentum),
          static_cast<T>(1.0 - segment.dampening),
          static_cast<T>(segment.weight_decay),
          static_cast<T>(segment.grad_unscale),
          static_cast<T>(segment.grad_clip),
          segment.momentum != 0.0,
          segment.nesterov,
          segment.maximize,
          segment.first_step,
          segment.weight_decay != 0.0};
}

template <typename T, typename Segment>
AdamScalars<T> adam_scalars(const Segment& segment) {
  return {static_cast<T>(segment.beta1),
          static_cast<T>(1.0 - segment.beta1),
          static_cast<T>(segment.beta2),
          static_cast<T>(1.0 - segment.beta2),
          static_cast<T>(segment.eps),
          static_cast<T>(segment.weight_decay),
          static_cast<T>(segment.decay_factor),
          static_cast<T>(-segment.step_size),
          static_cast<T>(segment.bias_correction2_sqrt),
          static_cast<T>(segment.grad_unscale),
          static_cast<T>(segment.grad_clip),
          segment.amsgrad,
          segment.maximize,
          segment.decoupled,
          !segment.decoupled && segment.weight_decay != 0.0};
}

}  // namespace gradsync::kernels
