// CPU optimizer updates: one pass per segment, each element's parameter, gradient and state
// read once and written once (src/kernels/optimizer_math.h holds the arithmetic).
//
// The loops are written so GCC vectorizes them: restrict-qualified pointers (the buffers are
// distinct arenas), the per-segment flags hoisted into template parameters so that the loop
// body has no branches left, and -fno-math-errno (meson.build) so that sqrt becomes a SIMD
// instruction. bench_optimizers shows the result against memory bandwidth.
#include "../optimizer_kernels.h"

#include "../optimizer_math.h"
#include "gradsync/core/error.h"

namespace gradsync::kernels::cpu {

namespace {

template <typename T, bool kMomentum, bool kFirstStep>
void sgd_loop(SgdScalars<T> scalars, T* __restrict params, const T* __restrict grads, T* __restrict momentum,
              std::int64_t count) {
  scalars.use_momentum = kMomentum;
  scalars.first_step = kFirstStep;
  for (std::int64_t i = 0; i < count; ++i) {
    sgd_element(scalars, params[i], grads[i], kMomentum ? &momentum[i] : nullptr);
  }
}

template <typename T>
void sgd_segments(void* params, const void* grads, void* momentum, std::span<const SgdSegment> segments) {
  for (const SgdSegment& segment : segments) {
    const SgdScalars<T> scalars = sgd_scalars<T>(segment);
    T* p = static_cast<T*>(params) + segment.begin;
    const T* g = static_cast<const T*>(grads) + segment.begin;
    T* buf = momentum ? static_cast<T*>(momentum) + segment.begin : nullptr;
    if (!scalars.use_momentum) {
      sgd_loop<T, false, false>(scalars, p, g, buf, segment.count);
    } else {
      GRADSYNC_CHECK(buf != nullptr, "sgd_update: momentum requested without a momentum buffer");
      if (scalars.first_step) {
        sgd_loop<T, true, true>(scalars, p, g, buf, segment.count);
      } else {
        sgd_loop<T, true, false>(scalars, p, g, buf, segment.count);
      }
    }
  }
}

template <typename T, bool kAmsgrad, bool kDecoupled>
void adam_loop(AdamScalars<T> scalars, T* __restrict params, const T* __restrict grads, T* __restrict exp_avg,
               T* __restrict exp_avg_sq, T* __restrict max_exp_avg_sq, std::int64_t count) {
  scalars.amsgrad = kAmsgrad;
  scalars.decoupled = kDecoupled;
  for (std::int64_t i = 0; i < count; ++i) {
    adam_element(scalars, params[i], grads[i], exp_avg[i], exp_avg_sq[i], kAmsgrad ? &max_exp_avg_sq[i] : nullptr);
  }
}

template <typename T>
void adam_segments(void* params, const void* grads, void* exp_avg, void* exp_avg_sq, void* max_exp_avg_sq,
                   std::span<const AdamSegment> segments) {
  for (const AdamSegment& segment : segments) {
    const AdamScalars<T> scalars = adam_scalars<T>(segment);
    const auto at = [&](void* base) { return base ? static_cast<T*>(base) + segment.begin : nullptr; };
    T* p = at(params);
    const T* g = static_cast<const T*>(grads) + segment.begin;
    T* m = at(exp_avg);
    T* v = at(exp_avg_sq);
    T* v_max = at(max_exp_avg_sq);
    GRADSYNC_CHECK(!scalars.amsgrad || v_max != nullptr, "adam_update: amsgrad without a max_exp_avg_sq buffer");
    if (scalars.amsgrad) {
      if (scalars.decoupled) adam_loop<T, true, true>(scalars, p, g, m, v, v_max, segment.count);
      else adam_loop<T, true, false>(scalars, p, g, m, v, v_max, segment.count);
    } else {
      if (scalars.decoupled) adam_loop<T, false, true>(scalars, p, g, m, v, v_max, segment.count);
      else adam_loop<T, false, false>(scalars, p, g, m, v, v_max, segment.count);
    }
  }
}

[[noreturn]] void unsupported(const char* optimizer, DType dtype) {
  detail::throw_error(optimizer, ": parameters of dtype ", dtype_name(dtype),
                      " are not supported (f32 and f64 are; keep f32 master weights for 16-bit models)");
}

}  // namespace

void sgd_update(DType dtype, void* params, const void* grads, void* momentum, std::span<const SgdSegment> segments) {
  if (dtype == DType::f32) return sgd_segments<float>(params, grads, momentum, segments);
  if (dtype == DType::f64) return sgd_segments<double>(params, grads, momentum, segments);
  unsupported("SGD", dtype);
}

void adam_update(DType dtype, void* params, const void* grads, void* exp_avg, void* exp_avg_sq, void* max_exp_avg_sq,
                 std::span<const AdamSegment> segments) {
  if (dtype == DType::f32) return adam_segments<float>(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, segments);
  if (dtype == DType::f64) return adam_segments<double>(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, segments);
  unsupported("Adam", dtype);
}

}  // namespace gradsync::kernels::cpu
