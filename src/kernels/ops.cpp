// gradsync::ops: argument checks, then one dispatch on the device. This is the only place
// that decides CPU versus CUDA for element-wise work.
#include "gradsync/kernels/ops.h"

#include <cmath>

#include "gradsync/config.h"
#include "core/convert.h"
#include "kernels.h"

namespace gradsync::ops {

namespace {

void require_defined(const char* op, const Tensor& x) {
  GRADSYNC_CHECK(x.defined(), op, ": empty tensor handle");
}

void require_same_layout(const char* op, const Tensor& a, const Tensor& b) {
  require_defined(op, a);
  require_defined(op, b);
  GRADSYNC_CHECK(a.dtype() == b.dtype(), op, ": dtype mismatch between ", a.describe(), " and ", b.describe());
  GRADSYNC_CHECK(a.numel() == b.numel(), op, ": element count mismatch between ", a.describe(), " and ",
                 b.describe());
  GRADSYNC_CHECK(a.device() == b.device(), op, ": device mismatch between ", a.describe(), " and ", b.describe());
}

void require_integral_factor(const char* op, const Tensor& x, double alpha) {
  GRADSYNC_CHECK(is_floating(x.dtype()) || std::trunc(alpha) == alpha, op, ": factor ", alpha,
                 " is not an integer, and ", x.describe(), " cannot hold the result");
}

#if !GRADSYNC_WITH_CUDA
[[noreturn]] void no_cuda(const char* op, const Tensor& x) {
  detail::throw_error(op, ": ", x.describe(), " is a CUDA tensor, but gradsync was built without CUDA");
}
#endif

}  // namespace

// Each op is written once below; CUDA_OR_FAIL expands to the CUDA call, or to the error that
// says CUDA is not compiled in.
#if GRADSYNC_WITH_CUDA
#define CUDA_OR_FAIL(op, tensor, call) return kernels::cuda::call
#else
#define CUDA_OR_FAIL(op, tensor, call) no_cuda(op, tensor)
#endif

void fill(Tensor& x, double value) {
  require_defined("fill", x);
  if (x.device().is_cpu()) return kernels::cpu::fill(x.data(), x.dtype(), x.numel(), value);
  CUDA_OR_FAIL("fill", x, fill(x.device(), x.data(), x.dtype(), x.numel(), value));
}

void copy(const Tensor& source, Tensor& destination) { destination.copy_from(source); }

void scale(Tensor& x, double alpha) {
  require_defined("scale", x);
  require_integral_factor("scale", x, alpha);
  if (x.device().is_cpu()) return kernels::cpu::scale(x.data(), x.dtype(), x.numel(), alpha);
  CUDA_OR_FAIL("scale", x, scale(x.device(), x.data(), x.dtype(), x.numel(), alpha));
}

void axpy(double alpha, const Tensor& x, Tensor& y) {
  require_same_layout("axpy", x, y);
  require_integral_factor("axpy", y, alpha);
  if (y.device().is_cpu()) return kernels::cpu::axpy(alpha, x.data(), y.data(), y.dtype(), y.numel());
  CUDA_OR_FAIL("axpy", y, axpy(y.device(), alpha, x.data(), y.data(), y.dtype(), y.numel()));
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  require_same_layout("add", a, b);
  require_same_layout("add", a, out);
  if (out.device().is_cpu()) return kernels::cpu::add(a.data(), b.data(), out.data(), out.dtype(), out.numel());
  CUDA_OR_FAIL("add", out, add(out.device(), a.data(), b.data(), out.data(), out.dtype(), out.numel()));
}

void cast(const Tensor& source, Tensor& destination) {
  require_defined("cast", source);
  require_defined("cast", destination);
  GRADSYNC_CHECK(source.numel() == destination.numel(), "cast: element count mismatch between ", source.describe(),
                 " and ", destination.describe());
  GRADSYNC_CHECK(source.device() == destination.device(), "cast: ", source.describe(), " and ",
                 destination.describe(), " are on different devices (copy first, then cast)");
  // The conversion itself is core's: Tensor::to(DType) needs it too (core/convert.h).
  detail::convert_elements(source.data(), source.dtype(), destination.data(), destination.dtype(), source.numel(),
                  source.device());
}

double dot(const Tensor& a, const Tensor& b) {
  require_same_layout("dot", a, b);
  if (a.device().is_cpu()) return kernels::cpu::dot(a.data(), b.data(), a.dtype(), a.numel());
  CUDA_OR_FAIL("dot", a, dot(a.device(), a.data(), b.data(), a.dtype(), a.numel()));
}

double squared_norm(const Tensor& x) {
  require_defined("squared_norm", x);
  if (x.device().is_cpu()) return kernels::cpu::squared_norm(x.data(), x.dtype(), x.numel());
  CUDA_OR_FAIL("squared_norm", x, squared_norm(x.device(), x.data(), x.dtype(), x.numel()));
}

NormStatistics norm_statistics(const Tensor& x, double factor) {
  require_defined("norm_statistics", x);
  GRADSYNC_CHECK(is_floating(x.dtype()), "norm_statistics: ", x.describe(), " is not floating");
  if (x.device().is_cpu()) return kernels::cpu::norm_statistics(x.data(), x.dtype(), x.numel(), factor);
  CUDA_OR_FAIL("norm_statistics", x, norm_statistics(x.device(), x.data(), x.dtype(), x.numel(), factor));
}

#undef CUDA_OR_FAIL

}  // namespace gradsync::ops
