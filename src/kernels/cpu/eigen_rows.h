// Internal: row-major Eigen views of gradsync's buffers, for the CPU code that multiplies
// matrices through Eigen (nn's Linear, PowerSGD's factors). gradsync stores a [rows, cols]
// tensor row by row, as PyTorch does; Eigen's default is column-major.
#pragma once

#include <Eigen/Dense>

namespace gradsync::kernels::cpu {

template <typename T>
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using RowMap = Eigen::Map<RowMatrix<T>>;
template <typename T>
using ConstRowMap = Eigen::Map<const RowMatrix<T>>;

}  // namespace gradsync::kernels::cpu
