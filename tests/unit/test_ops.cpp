// CPU element-wise and reduction operations against naive references, and argument errors.
#include "expectations.h"
#include "ops.h"
#include "test_util.h"
#include "gradsync/kernels/ops.h"

namespace gradsync {
namespace {

TEST(CpuOps, AllOpsAllDTypesAwkwardSizes) { testing::check_all_ops(Device::cpu()); }

TEST(CpuOps, HalfArithmeticRoundsOncePerElement) {
  // 2049 is not representable in f16 (spacing 2 there): 2048 + 1 rounds to even, 2048.
  Tensor y = Tensor::from_vector(std::vector<float>{2048, 2048}, {2}).to(DType::f16);
  Tensor x = Tensor::from_vector(std::vector<float>{1, 3}, {2}).to(DType::f16);
  ops::axpy(1.0, x, y);
  EXPECT_EQ(y.to_double_vector(), (std::vector<double>{2048, 2052}));
}

TEST(CpuOps, ReductionsAccumulateInDouble) {
  // 2^24 ones plus 1: an f32 accumulator would stop growing at 2^24.
  const std::int64_t n = (std::int64_t{1} << 24) + 1;
  Tensor ones = Tensor::empty({n}, DType::f32);
  ops::fill(ones, 1.0);
  EXPECT_EQ(ops::squared_norm(ones), static_cast<double>(n));
}

TEST(CpuOps, UnalignedWrappedBuffersWork) {
  std::vector<float> storage(11, 1.0f);
  Tensor unaligned = Tensor::wrap(storage.data() + 1, {10}, DType::f32);  // 4-byte aligned only
  ops::scale(unaligned, 3.0);
  EXPECT_EQ(storage[0], 1.0f);
  EXPECT_EQ(storage[1], 3.0f);
  EXPECT_EQ(storage[10], 3.0f);
}

TEST(CpuOps, ArgumentErrorsNameTheOperationAndTensors) {
  Tensor a = Tensor::zeros({4}, DType::f32);
  Tensor b = Tensor::zeros({5}, DType::f32);
  Tensor c = Tensor::zeros({4}, DType::f64);
  Tensor i = Tensor::zeros({4}, DType::i32);
  EXPECT_GRADSYNC_ERROR(ops::axpy(1.0, a, b), "axpy", "element count mismatch", "f32[4]", "f32[5]");
  EXPECT_GRADSYNC_ERROR(ops::add(a, c, a), "add", "dtype mismatch", "f64[4]");
  EXPECT_GRADSYNC_ERROR(ops::dot(a, b), "dot", "element count mismatch");
  EXPECT_GRADSYNC_ERROR(ops::scale(i, 0.5), "scale", "0.5", "i32[4]");
  EXPECT_GRADSYNC_ERROR(ops::cast(a, b), "cast", "element count mismatch");
  Tensor empty;
  EXPECT_GRADSYNC_ERROR(ops::fill(empty, 1.0), "fill", "empty tensor");
  ops::scale(i, 2.0);  // an integral factor is fine
}

}  // namespace
}  // namespace gradsync
