// The ops checks (ops.h).
#include "ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "expectations.h"
#include "gradsync/kernels/ops.h"
#include "test_util.h"

namespace gradsync::testing {

void check_all_ops(Device device) {
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
