// Comparisons the tests share: vectors within a relative tolerance, every element of a tensor,
// results within one rounding of their dtype, and the value a number becomes through a 16-bit
// float (compression's rounding).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "gradsync/core/tensor.h"

namespace gradsync::testing {

inline void expect_near_vectors(const std::string& what, const std::vector<double>& actual,
                                const std::vector<double>& expected, double tolerance) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], tolerance * std::max(1.0, std::abs(expected[i]))) << what << " [" << i << "]";
  }
}

inline void expect_all(const std::string& what, const Tensor& tensor, double expected, double relative = 1e-6) {
  for (const double value : tensor.to_double_vector()) {
    ASSERT_NEAR(value, expected, relative * std::max(1.0, std::abs(expected))) << what;
  }
}

// `numel` copies of `value` as f32 on `device`.
inline Tensor filled_on(std::int64_t numel, double value, Device device) {
  return Tensor::from_vector(std::vector<double>(static_cast<std::size_t>(numel), value), {numel})
      .to(DType::f32)
      .to(device);
}

// What a value becomes after a round trip through `dtype` (the compression's rounding).
inline double rounded_through(double value, DType dtype) {
  return Tensor::from_vector(std::vector<double>{value}, {1}).to(DType::f32).to(dtype).to(DType::f32).to_double_vector()[0];
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

}  // namespace gradsync::testing
