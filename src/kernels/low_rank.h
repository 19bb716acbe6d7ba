// Internal: the small dense linear algebra of low-rank gradient compression (PowerSGD): a
// matrix product and the orthonormalization of a tall, thin matrix's columns, on the CPU
// (Eigen) and on a CUDA device (cuBLAS and small kernels). Matrices are 2-D row-major tensor
// views of f32 or f64; the dispatcher (low_rank.cpp) checks shapes, dtypes and devices, then
// calls the device's implementation, which trusts them.
#pragma once

#include <cstdint>
#include <vector>

#include "gradsync/core/tensor.h"

namespace gradsync::kernels {

// out = op(a) op(b), op(x) = x^T where asked; out is overwritten.
void matmul(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, Tensor& out);

// Orthonormalizes the columns of each matrix in place, as torch's PowerSGD hook does: up to
// two columns by Gram-Schmidt, each column divided by its norm + epsilon; beyond two, the thin
// Q of a Householder QR (LAPACK's signs, as torch.linalg.qr). Gram-Schmidt cannot normalise an
// all-zero column when epsilon is 0: the index of the first matrix that had one is returned
// (its contents are then unspecified), or -1 when all went well. On a device the matrices are
// orthonormalized without waiting on each other, and the answer costs one wait at the end.
std::int64_t orthonormalize_columns(const std::vector<Tensor>& matrices, double epsilon);

// A row-major matrix in device-specific memory, for the implementations below.
struct MatrixRef {
  void* data;
  std::int64_t rows;
  std::int64_t cols;
};

namespace cpu {
// out (m x n) = op(a) (m x k) op(b) (k x n)
void matmul(DType dtype, bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k, const void* a,
            const void* b, void* out);
std::int64_t orthonormalize_columns(DType dtype, const std::vector<MatrixRef>& matrices, double epsilon);
}  // namespace cpu

namespace cuda {
void matmul(Device device, DType dtype, bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k,
            const void* a, const void* b, void* out);
std::int64_t orthonormalize_columns(Device device, DType dtype, const std::vector<MatrixRef>& matrices, double epsilon);
}  // namespace cuda

}  // namespace gradsync::kernels
