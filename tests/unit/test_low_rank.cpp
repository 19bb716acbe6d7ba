// The low-rank kernels behind PowerSGD (src/kernels/low_rank.h) on the host and on cuda:0:
// products in the four transpose combinations against a triple loop in double, and the
// orthonormalization (Gram-Schmidt to two columns, Householder beyond) checked for what it must
// give: orthonormal columns spanning the input's, LAPACK's sign for Householder, torch's
// norm + epsilon for Gram-Schmidt, the index of a matrix with an all-zero column. On cuda:0 the
// results must also equal the host's within float rounding. The CUDA instances skip, saying
// why, without a usable device.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/low_rank.h"
#include "ranks_on_device.h"
#include "test_util.h"

namespace gradsync {
namespace {

class LowRank : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { GRADSYNC_SKIP_UNLESS_USABLE(device()); }
  Device device() const { return Device::parse(GetParam()); }
};
INSTANTIATE_TEST_SUITE_P(Devices, LowRank, ::testing::Values("cpu", "cuda"), [](const auto& info) { return info.param; });

Tensor random_matrix(std::int64_t rows, std::int64_t cols, DType dtype, std::uint64_t seed) {
  return testing::random_tensor(rows * cols, dtype, seed).reshape({rows, cols});
}

double tolerance(DType dtype) { return dtype == DType::f32 ? 2e-5 : 1e-12; }

// x[r, c] of a host copy, as double.
struct HostMatrix {
  explicit HostMatrix(const Tensor& x) : values(x.to_double_vector()), cols(x.shape()[1]) {}
  double operator()(std::int64_t r, std::int64_t c) const { return values[static_cast<std::size_t>(r * cols + c)]; }
  std::vector<double> values;
  std::int64_t cols;
};

TEST_P(LowRank, ProductsInEveryTransposeMatchATripleLoop) {
  const std::int64_t m = 37, n = 5, k = 129;
  for (DType dtype : {DType::f32, DType::f64}) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        const Tensor a = random_matrix(ta ? k : m, ta ? m : k, dtype, 1);
        const Tensor b = random_matrix(tb ? n : k, tb ? k : n, dtype, 2);
        Tensor out = Tensor::zeros({m, n}, dtype, device());
        kernels::matmul(a.to(device()), ta, b.to(device()), tb, out);
        const HostMatrix A(a), B(b), got(out);
        double worst = 0;
        for (std::int64_t i = 0; i < m; ++i) {
          for (std::int64_t j = 0; j < n; ++j) {
            double want = 0;
            for (std::int64_t p = 0; p < k; ++p) want += (ta ? A(p, i) : A(i, p)) * (tb ? B(j, p) : B(p, j));
            worst = std::max(worst, std::abs(got(i, j) - want) / (1 + std::abs(want)));
          }
        }
        EXPECT_LT(worst, tolerance(dtype) * 10) << dtype_name(dtype) << " ta " << ta << " tb " << tb;
      }
    }
  }
}

TEST_P(LowRank, OrthonormalColumnsThatSpanTheInput) {
  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes{{1000, 1}, {1000, 2}, {513, 3}, {300, 8}, {8, 8}, {2, 2}};
  for (DType dtype : {DType::f32, DType::f64}) {
    std::vector<Tensor> inputs, matrices;
    for (std::size_t s = 0; s < shapes.size(); ++s) {
      inputs.push_back(random_matrix(shapes[s].first, shapes[s].second, dtype, 10 + s));
      matrices.push_back(inputs.back().to(device()).clone());
    }
    ASSERT_EQ(kernels::orthonormalize_columns(matrices, 0.0), -1);
    for (std::size_t s = 0; s < shapes.size(); ++s) {
      const auto [rows, cols] = shapes[s];
      const HostMatrix q(matrices[s]), a(inputs[s]);
      const std::string what = std::string(dtype_name(dtype)) + " " + std::to_string(rows) + " x " + std::to_string(cols);
      double worst = 0;
      for (std::int64_t i = 0; i < cols; ++i) {  // Q^T Q = I
        for (std::int64_t j = 0; j < cols; ++j) {
          double dot = 0;
          for (std::int64_t r = 0; r < rows; ++r) dot += q(r, i) * q(r, j);
          worst = std::max(worst, std::abs(dot - (i == j ? 1.0 : 0.0)));
        }
      }
      EXPECT_LT(worst, tolerance(dtype) * 10) << what << ": Q^T Q is not the identity";
      // Q Q^T A = A: the columns span the input's.
      worst = 0;
      double largest = 0;
      for (std::int64_t c = 0; c < cols; ++c) {
        std::vector<double> coefficient(static_cast<std::size_t>(cols), 0.0);
        for (std::int64_t i = 0; i < cols; ++i) {
          for (std::int64_t r = 0; r < rows; ++r) coefficient[static_cast<std::size_t>(i)] += q(r, i) * a(r, c);
        }
        for (std::int64_t r = 0; r < rows; ++r) {
          double projected = 0;
          for (std::int64_t i = 0; i < cols; ++i) projected += q(r, i) * coefficient[static_cast<std::size_t>(i)];
          worst = std::max(worst, std::abs(projected - a(r, c)));
          largest = std::max(largest, std::abs(a(r, c)));
        }
      }
      EXPECT_LT(worst / largest, tolerance(dtype) * 10) << what << ": the columns do not span the input's";
      // The first column is the input's, normalised: kept in sign by Gram-Schmidt, turned to
      // the opposite of a[0, 0]'s sign by Householder (LAPACK's, and torch.linalg.qr's, choice).
      double norm = 0;
      for (std::int64_t r = 0; r < rows; ++r) norm += a(r, 0) * a(r, 0);
      norm = std::sqrt(norm);
      const double sign = cols > 2 && a(0, 0) >= 0 ? -1.0 : 1.0;
      for (std::int64_t r = 0; r < rows; ++r) {
        ASSERT_NEAR(q(r, 0), sign * a(r, 0) / norm, tolerance(dtype) * 10) << what << " row " << r;
      }
      if (device().is_cuda()) {  // and the device's equal the host's
        std::vector<Tensor> host{inputs[s].clone()};
        ASSERT_EQ(kernels::orthonormalize_columns(host, 0.0), -1);
        const std::vector<double> want = host[0].to_double_vector();
        for (std::size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(q.values[i], want[i], tolerance(dtype) * 10) << what << " " << i;
      }
    }
  }
}

TEST_P(LowRank, GramSchmidtDividesByTheNormPlusEpsilon) {
  Tensor column = Tensor::from_vector(std::vector<float>{3, 4}, {2, 1}).to(device());
  std::vector<Tensor> matrices{column};
  ASSERT_EQ(kernels::orthonormalize_columns(matrices, 1.0), -1);
  const std::vector<double> got = column.to_double_vector();
  EXPECT_NEAR(got[0], 0.5, 1e-7);  // 3 / (5 + 1)
  EXPECT_NEAR(got[1], 4.0 / 6.0, 1e-7);
}

TEST_P(LowRank, AnAllZeroColumnIsReportedByItsMatrix) {
  std::vector<Tensor> matrices{random_matrix(50, 2, DType::f32, 1).to(device()), Tensor::zeros({40, 2}, DType::f32, device()),
                               Tensor::zeros({30, 1}, DType::f32, device())};
  EXPECT_EQ(kernels::orthonormalize_columns(matrices, 0.0), 1);
  // With epsilon, a zero column stays zero and nothing is reported (torch's advice).
  std::vector<Tensor> guarded{Tensor::zeros({40, 2}, DType::f32, device())};
  EXPECT_EQ(kernels::orthonormalize_columns(guarded, 1e-8), -1);
  for (const double v : guarded[0].to_double_vector()) EXPECT_EQ(v, 0.0);
  // Householder needs no division by a column's norm: a zero matrix gives I's first columns.
  std::vector<Tensor> zero{Tensor::zeros({5, 3}, DType::f64, device())};
  EXPECT_EQ(kernels::orthonormalize_columns(zero, 0.0), -1);
  const HostMatrix q(zero[0]);
  for (std::int64_t r = 0; r < 5; ++r) {
    for (std::int64_t c = 0; c < 3; ++c) EXPECT_EQ(q(r, c), r == c ? 1.0 : 0.0) << r << ", " << c;
  }
}

TEST_P(LowRank, MistakesAreNamed) {
  Tensor out = Tensor::zeros({3, 4}, DType::f32, device());
  const Tensor a = Tensor::zeros({3, 5}, DType::f32, device());
  EXPECT_GRADSYNC_ERROR(kernels::matmul(a, false, a, false, out), "shapes do not multiply");
  const Tensor vector = Tensor::zeros({12}, DType::f32, device());
  EXPECT_GRADSYNC_ERROR(kernels::matmul(vector, false, a, false, out), "must be a matrix");
  const Tensor wrong = Tensor::zeros({5, 4}, DType::f64, device());
  EXPECT_GRADSYNC_ERROR(kernels::matmul(a, false, wrong, false, out), "dtype or device mismatch");
  std::vector<Tensor> wide{Tensor::zeros({2, 3}, DType::f32, device())};
  EXPECT_GRADSYNC_ERROR(kernels::orthonormalize_columns(wide, 0.0), "more columns than rows");
  std::vector<Tensor> halves{Tensor::zeros({4, 1}, DType::bf16, device())};
  EXPECT_GRADSYNC_ERROR(kernels::orthonormalize_columns(halves, 0.0), "must be f32 or f64");
}

}  // namespace
}  // namespace gradsync
