// The low-rank kernels on the CPU (low_rank.h), through Eigen's row-major maps.
#include "../low_rank.h"

#include <Eigen/Dense>

#include "eigen_rows.h"

namespace gradsync::kernels::cpu {

namespace {

template <typename T>
void matmul_as(bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k, const T* a, const T* b,
               T* out) {
  const ConstRowMap<T> left(a, transpose_a ? k : m, transpose_a ? m : k);
  const ConstRowMap<T> right(b, transpose_b ? n : k, transpose_b ? k : n);
  RowMap<T> result(out, m, n);
  if (transpose_a && transpose_b) {
    result.noalias() = left.transpose() * right.transpose();
  } else if (transpose_a) {
    result.noalias() = left.transpose() * right;
  } else if (transpose_b) {
    result.noalias() = left * right.transpose();
  } else {
    result.noalias() = left * right;
  }
}

// torch's _orthogonalize_gram_schmidt: each column is divided by its norm plus epsilon, then
// its projection is removed from the columns after it. False on an all-zero column with
// epsilon 0 (a division by zero, which torch does silently).
template <typename T>
bool gram_schmidt(RowMap<T> matrix, double epsilon) {
  for (Eigen::Index i = 0; i < matrix.cols(); ++i) {
    const T norm = matrix.col(i).norm();
    if (!(norm + epsilon > 0)) return false;
    matrix.col(i) /= norm + static_cast<T>(epsilon);
    for (Eigen::Index j = i + 1; j < matrix.cols(); ++j) matrix.col(j) -= matrix.col(i).dot(matrix.col(j)) * matrix.col(i);
  }
  return true;
}

// torch.linalg.qr's Q (LAPACK's Householder reflections, whose signs Eigen's follow too).
template <typename T>
void householder(RowMap<T> matrix) {
  const Eigen::HouseholderQR<RowMatrix<T>> qr(matrix);
  // The thin Q: the reflections applied to the first columns of the identity (never the
  // rows x rows Q, which for a 1024 x 4 P would be a thousand times the work).
  RowMatrix<T> thin = RowMatrix<T>::Identity(matrix.rows(), matrix.cols());
  qr.householderQ().applyThisOnTheLeft(thin);
  matrix = thin;
}

template <typename T>
std::int64_t orthonormalize_as(const std::vector<MatrixRef>& matrices, double epsilon) {
  std::int64_t failed = -1;
  for (std::size_t i = 0; i < matrices.size(); ++i) {
    RowMap<T> matrix(static_cast<T*>(matrices[i].data), matrices[i].rows, matrices[i].cols);
    if (matrix.cols() > 2) {
      householder<T>(matrix);
    } else if (!gram_schmidt<T>(matrix, epsilon) && failed < 0) {
      failed = static_cast<std::int64_t>(i);
    }
  }
  return failed;
}

}  // namespace

void matmul(DType dtype, bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k, const void* a,
            const void* b, void* out) {
  if (dtype == DType::f32) {
    matmul_as<float>(transpose_a, transpose_b, m, n, k, static_cast<const float*>(a), static_cast<const float*>(b),
                     static_cast<float*>(out));
  } else {
    matmul_as<double>(transpose_a, transpose_b, m, n, k, static_cast<const double*>(a), static_cast<const double*>(b),
                      static_cast<double*>(out));
  }
}

std::int64_t orthonormalize_columns(DType dtype, const std::vector<MatrixRef>& matrices, double epsilon) {
  return dtype == DType::f32 ? orthonormalize_as<float>(matrices, epsilon) : orthonormalize_as<double>(matrices, epsilon);
}

}  // namespace gradsync::kernels::cpu
