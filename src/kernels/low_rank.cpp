// The low-rank kernels' dispatcher (low_rank.h): argument checks, then the device's code.
#include "low_rank.h"

#include "gradsync/config.h"

namespace gradsync::kernels {

namespace {

void require_matrix(const char* op, const Tensor& x, const char* which) {
  GRADSYNC_CHECK(x.defined(), op, ": ", which, " is an empty tensor handle");
  GRADSYNC_CHECK(x.shape().size() == 2, op, ": ", which, " must be a matrix, got ", x.describe());
  GRADSYNC_CHECK(x.dtype() == DType::f32 || x.dtype() == DType::f64, op, ": ", which, " must be f32 or f64, got ",
                 x.describe());
}

[[maybe_unused]] [[noreturn]] void no_cuda(const char* op, const Tensor& x) {
  detail::throw_error(op, ": ", x.describe(), " is a CUDA tensor, but gradsync was built without CUDA");
}

}  // namespace

void matmul(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, Tensor& out) {
  require_matrix("matmul", a, "a");
  require_matrix("matmul", b, "b");
  require_matrix("matmul", out, "out");
  const std::int64_t m = a.shape()[transpose_a ? 1 : 0];
  const std::int64_t k = a.shape()[transpose_a ? 0 : 1];
  const std::int64_t n = b.shape()[transpose_b ? 0 : 1];
  GRADSYNC_CHECK(b.shape()[transpose_b ? 1 : 0] == k && out.shape()[0] == m && out.shape()[1] == n,
                 "matmul: shapes do not multiply: ", a.describe(), transpose_a ? "^T" : "", " x ", b.describe(),
                 transpose_b ? "^T" : "", " -> ", out.describe());
  GRADSYNC_CHECK(a.dtype() == out.dtype() && b.dtype() == out.dtype() && a.device() == out.device() &&
                     b.device() == out.device(),
                 "matmul: dtype or device mismatch among ", a.describe(), ", ", b.describe(), " and ", out.describe());
  if (out.device().is_cpu()) return cpu::matmul(out.dtype(), transpose_a, transpose_b, m, n, k, a.data(), b.data(), out.data());
#if GRADSYNC_WITH_CUDA
  cuda::matmul(out.device(), out.dtype(), transpose_a, transpose_b, m, n, k, a.data(), b.data(), out.data());
#else
  no_cuda("matmul", out);
#endif
}

std::int64_t orthonormalize_columns(const std::vector<Tensor>& matrices, double epsilon) {
  GRADSYNC_CHECK(epsilon >= 0, "orthonormalize_columns: epsilon must be >= 0, got ", epsilon);
  if (matrices.empty()) return -1;
  std::vector<MatrixRef> refs;
  refs.reserve(matrices.size());
  for (const Tensor& matrix : matrices) {
    require_matrix("orthonormalize_columns", matrix, "a matrix");
    GRADSYNC_CHECK(matrix.dtype() == matrices[0].dtype() && matrix.device() == matrices[0].device(),
                   "orthonormalize_columns: ", matrix.describe(), " differs from ", matrices[0].describe(),
                   " in dtype or device");
    GRADSYNC_CHECK(matrix.shape()[0] >= matrix.shape()[1], "orthonormalize_columns: ", matrix.describe(),
                   " has more columns than rows; they cannot all be orthonormal");
    refs.push_back({matrix.data(), matrix.shape()[0], matrix.shape()[1]});
  }
  const Tensor& first = matrices[0];
  if (first.device().is_cpu()) return cpu::orthonormalize_columns(first.dtype(), refs, epsilon);
#if GRADSYNC_WITH_CUDA
  return cuda::orthonormalize_columns(first.device(), first.dtype(), refs, epsilon);
#else
  no_cuda("orthonormalize_columns", first);
#endif
}

}  // namespace gradsync::kernels
