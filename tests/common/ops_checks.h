// The element-wise and reduction checks, written once and run per device: the unit suite
// runs them on the CPU, the gpu suite on CUDA. Each op is compared with a naive double
// precision reference on seeded random data of awkward sizes (0, 1, odd, not a multiple of
// any vector width, large).
#pragma once

#include <cmath>
#include <string>

#include "gradsync/kernels/ops.h"
#include "test_util.h"

namespace gradsync::testing {

inline const std::vector<DType>& all_dtypes() {
  static const std::vector<DType> dtypes{DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64};
  return dtypes;
}

inline const std::vector<std::int64_t>& awkward_sizes() {
  static const std::vector<std::int64_t> sizes{0, 1, 7, 64, 1000, 100003};
  return sizes;
}

// Relative tolerance of one result rounding in `dtype` (integers are exact).
inline double rounding_tolerance(DType dtype) {
  switch (dtype) {
    case DType::f32: return 2e-7;
    case DType::f64: return 1e-15;
    case DType::f16: return 1e-3;
    case DType::bf16: return 8e-3;
    default: return 0.0;
  }
}

// Expects every element of `actual` (any device) to equal `expected` within one rounding.
inline void expect_close(const std::string& what, const Tensor& actual, const std::vector<double>& expected) {
  const std::vector<double> values = actual.to_double_vector();
  ASSERT_EQ(values.size(), expected.size()) << what;
  const double tolerance = rounding_tolerance(actual.dtype());
  int reported = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double bound = tolerance * std::max(1.0, std::abs(expected[i]));
    if (!(std::abs(values[i] - expected[i]) <= bound) && reported++ < 5) {
      ADD_FAILURE() << what << ": element " << i << " is " << values[i] << ", expected " << expected[i];
    }
  }
}

inline void check_all_ops(Device device) {
  std::uint64_t seed = 1;
  for (DType dtype : all_dtypes()) {
    for (std::int64_t n : awkward_sizes()) {
      const std::string label = std::string(dtype_name(dtype)) + "[" + std::to_string(n) + "] on " + device.str();
      const Tensor x = random_tensor(n, dtype, seed++).to(device);
      const Tensor y0 = random_tensor(n, dtype, seed++).to(device);
      const std::vector<double> xs = x.to_double_vector();
      const std::vector<double> ys = y0.to_double_vector();
      const bool floating = is_floating(dtype);
      const double alpha = floating ? -0.75 : 3.0;

      Tensor filled = Tensor::empty({n}, dtype, device);
      ops::fill(filled, 2.5);
      expect_close("fill " + label, filled, std::vector<double>(xs.size(), floating ? 2.5 : 2.0));

      Tensor scaled = x.clone();
      ops::scale(scaled, alpha);
      std::vector<double> expected(xs.size());
      for (std::size_t i = 0; i < xs.size(); ++i) expected[i] = alpha * xs[i];
      expect_close("scale " + label, scaled, expected);

      Tensor y = y0.clone();
      ops::axpy(alpha, x, y);
      for (std::size_t i = 0; i < xs.size(); ++i) expected[i] = ys[i] + alpha * xs[i];
      expect_close("axpy " + label, y, expected);

      Tensor sum = Tensor::empty({n}, dtype, device);
      ops::add(x, y0, sum);
      for (std::size_t i = 0; i < xs.size(); ++i) expected[i] = xs[i] + ys[i];
      expect_close("add " + label, sum, expected);

      // In-place add (out aliases an input) is allowed: reducers accumulate that way.
      Tensor accumulated = y0.clone();
      ops::add(accumulated, x, accumulated);
      expect_close("add in place " + label, accumulated, expected);

      Tensor copied = Tensor::empty({n}, dtype, device);
      ops::copy(x, copied);
      expect_close("copy " + label, copied, xs);

      double dot = 0.0;
      double norm = 0.0;
      for (std::size_t i = 0; i < xs.size(); ++i) {
        dot += xs[i] * ys[i];
        norm += xs[i] * xs[i];
      }
      EXPECT_NEAR(ops::dot(x, y0), dot, 1e-12 * std::max(1.0, norm)) << "dot " << label;
      EXPECT_NEAR(ops::squared_norm(x), norm, 1e-12 * std::max(1.0, norm)) << "squared_norm " << label;

      // Casts to every dtype agree with the host conversion of the same values.
      for (DType target : all_dtypes()) {
        Tensor converted = Tensor::empty({n}, target, device);
        ops::cast(x, converted);
        const Tensor host_converted = x.to(Device::cpu()).to(target);
        EXPECT_EQ(converted.to_double_vector(), host_converted.to_double_vector())
            << "cast " << label << " -> " << dtype_name(target);
      }
    }
  }
}

}  // namespace gradsync::testing
