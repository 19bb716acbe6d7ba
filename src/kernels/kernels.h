// Internal: the per-device kernel entry points behind gradsync::ops. Pointers are raw and
// already checked by the dispatcher (src/kernels/ops.cpp); n is an element count. The CPU
// and CUDA implementations have the same signatures so the dispatcher reads as a table.
#pragma once

#include <cstdint>

#include "gradsync/core/device.h"
#include "gradsync/core/dtype.h"
#include "gradsync/kernels/ops.h"

namespace gradsync::kernels {

namespace cpu {
void fill(void* x, DType dtype, std::int64_t n, double value);
void scale(void* x, DType dtype, std::int64_t n, double alpha);
void axpy(double alpha, const void* x, void* y, DType dtype, std::int64_t n);
void add(const void* a, const void* b, void* out, DType dtype, std::int64_t n);
double dot(const void* a, const void* b, DType dtype, std::int64_t n);
double squared_norm(const void* x, DType dtype, std::int64_t n);
ops::NormStatistics norm_statistics(const void* x, DType dtype, std::int64_t n, double factor);
}  // namespace cpu

namespace cuda {
void fill(Device device, void* x, DType dtype, std::int64_t n, double value);
void scale(Device device, void* x, DType dtype, std::int64_t n, double alpha);
void axpy(Device device, double alpha, const void* x, void* y, DType dtype, std::int64_t n);
void add(Device device, const void* a, const void* b, void* out, DType dtype, std::int64_t n);
double dot(Device device, const void* a, const void* b, DType dtype, std::int64_t n);
double squared_norm(Device device, const void* x, DType dtype, std::int64_t n);
ops::NormStatistics norm_statistics(Device device, const void* x, DType dtype, std::int64_t n, double factor);
}  // namespace cuda

}  // namespace gradsync::kernels
