// The CPU work on all cores: results are bitwise independent of the number of threads
// (optimizer steps, element-wise ops, reductions), and the vectorized casts convert exactly as
// the scalar conversion functions (every 16-bit value, and f32 edge cases).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "gradsync/core/half.h"
#include "gradsync/core/threads.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/optim/adam.h"
#include "gradsync/optim/sgd.h"
#include "test_util.h"

namespace gradsync {
namespace {

// Restores the thread count after a test.
class Threads {
 public:
  Threads() : saved_(num_threads()) {}
  ~Threads() { set_num_threads(saved_); }

 private:
  int saved_;
};

std::vector<std::uint8_t> bytes_of(const Tensor& tensor) {
  const auto* data = static_cast<const std::uint8_t*>(tensor.data());
  return std::vector<std::uint8_t>(data, data + tensor.nbytes());
}

// 20 Adam steps on ~1.2 M parameters (f32 and a bf16 model with master weights), in pieces.
std::vector<std::uint8_t> adam_result(int threads, DType dtype) {
  set_num_threads(threads);
  ParameterRegistry registry;
  registry.add("a", {700001}, dtype);
  registry.add("b", {500003}, dtype);
  registry.finalize();
  for (Parameter& p : registry) p.value().copy_from(testing::random_tensor(p.numel(), dtype, p.index() + 1).reshape(p.shape()));
  optim::AdamW adamw(registry, optim::AdamW::defaults(),
                     dtype == DType::f32 ? optim::MasterWeights::none : optim::MasterWeights::f32);
  for (int step = 0; step < 20; ++step) {
    for (Parameter& p : registry) p.set_grad(testing::random_tensor(p.numel(), dtype, 100 * step + p.index(), 1e-2));
    adamw.step();
  }
  std::vector<std::uint8_t> out = bytes_of(registry.arenas()[0].values);
  const std::vector<std::uint8_t> state = bytes_of(adamw.state(registry.at("b"), "exp_avg_sq"));
  out.insert(out.end(), state.begin(), state.end());
  return out;
}

TEST(Parallel, OptimizerStepsAreIndependentOfTheThreadCount) {
  Threads restore;
  for (const DType dtype : {DType::f32, DType::bf16}) {
    const auto one = adam_result(1, dtype);
    EXPECT_EQ(adam_result(2, dtype), one) << dtype_name(dtype);
    EXPECT_EQ(adam_result(3, dtype), one) << dtype_name(dtype);
  }
}

TEST(Parallel, OpsAndReductionsAreIndependentOfTheThreadCount) {
  Threads restore;
  const std::int64_t n = 3'000'017;  // several reduction chunks and an odd tail
  const Tensor x = testing::random_tensor(n, DType::f32, 7);
  const Tensor y = testing::random_tensor(n, DType::f32, 8);
  std::vector<std::vector<std::uint8_t>> results;
  std::vector<double> norms, dots;
  for (const int threads : {1, 2, 3}) {
    set_num_threads(threads);
    Tensor a = x.clone();
    ops::scale(a, 0.75);
    ops::axpy(-1.5, y, a);
    Tensor half = Tensor::empty({n}, DType::bf16);
    ops::cast(a, half);
    results.push_back(bytes_of(half));
    norms.push_back(ops::squared_norm(a));
    dots.push_back(ops::dot(a, y));
    const ops::NormStatistics statistics = ops::norm_statistics(a, 0.5);
    EXPECT_EQ(statistics.nonfinite, 0);
    EXPECT_NEAR(statistics.sum_of_squares, 0.25 * norms.back(), 1e-9 * norms.back());
  }
  EXPECT_EQ(results[1], results[0]);
  EXPECT_EQ(results[2], results[0]);
  EXPECT_EQ(norms[1], norms[0]);
  EXPECT_EQ(norms[2], norms[0]);
  EXPECT_EQ(dots[1], dots[0]);
  EXPECT_EQ(dots[2], dots[0]);
}

// Every f16 and bf16 bit pattern widens exactly as the scalar functions say (NaNs included,
// compared as bits), and narrows back to itself where it is not a NaN.
TEST(Parallel, VectorizedCastsMatchTheScalarConversionsOnEvery16BitValue) {
  Tensor f16 = Tensor::empty({65536}, DType::f16);
  Tensor bf16 = Tensor::empty({65536}, DType::bf16);
  for (std::uint32_t bits = 0; bits < 65536; ++bits) {
    static_cast<std::uint16_t*>(f16.data())[bits] = static_cast<std::uint16_t>(bits);
    static_cast<std::uint16_t*>(bf16.data())[bits] = static_cast<std::uint16_t>(bits);
  }
  for (const auto& [tensor, widen, narrow] :
       {std::tuple{f16, &half_bits_to_float, &float_to_half_bits}, std::tuple{bf16, &bf16_bits_to_float, &float_to_bf16_bits}}) {
    Tensor wide = Tensor::empty({65536}, DType::f32);
    ops::cast(tensor, wide);
    Tensor back = Tensor::empty({65536}, tensor.dtype());
    ops::cast(wide, back);
    const float* w = wide.data_as<float>();
    const auto* b = static_cast<const std::uint16_t*>(back.data());
    int mismatches = 0;
    for (std::uint32_t bits = 0; bits < 65536; ++bits) {
      const float expected = widen(static_cast<std::uint16_t>(bits));
      if (float_bits(w[bits]) != float_bits(expected) && mismatches++ < 3) {
        ADD_FAILURE() << dtype_name(tensor.dtype()) << " widen 0x" << std::hex << bits;
      }
      if (b[bits] != narrow(expected) && mismatches++ < 3) {
        ADD_FAILURE() << dtype_name(tensor.dtype()) << " narrow 0x" << std::hex << bits;
      }
    }
    EXPECT_EQ(mismatches, 0);
  }
}

TEST(Parallel, VectorizedNarrowingMatchesTheScalarConversionsOnF32EdgeCases) {
  std::vector<float> values{0.0f, -0.0f, 1.0f, 65504.0f, 65519.99f, 65520.0f, 1e-8f, 5.96e-8f, 2.98e-8f,
                            6.1e-5f, -6.1e-5f, 3.0e38f, std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::denorm_min(), 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048};
  std::mt19937 generator(5);
  for (int i = 0; i < 100000; ++i) values.push_back(bits_float(static_cast<std::uint32_t>(generator())));
  const Tensor source = Tensor::from_vector(values, {static_cast<std::int64_t>(values.size())});
  for (const DType dtype : {DType::f16, DType::bf16}) {
    Tensor narrow = Tensor::empty(source.shape(), dtype);
    ops::cast(source, narrow);
    const auto* bits = static_cast<const std::uint16_t*>(narrow.data());
    int mismatches = 0;
    for (std::size_t i = 0; i < values.size(); ++i) {
      const std::uint16_t expected = dtype == DType::f16 ? float_to_half_bits(values[i]) : float_to_bf16_bits(values[i]);
      if (bits[i] != expected && mismatches++ < 3) ADD_FAILURE() << dtype_name(dtype) << " value " << values[i];
    }
    EXPECT_EQ(mismatches, 0);
  }
}

// The reductions' association is fixed (1 Mi-element chunks in order; in each, eight double
// lanes by element index mod 8, then the tail first, then the lanes): recomputed here by hand,
// the results must match to the bit on either instruction set (meson runs this test a second
// time with GRADSYNC_CPU_ISA=baseline).
double expected_dot(const float* a, const float* b, std::int64_t n) {
  constexpr std::int64_t kChunk = std::int64_t{1} << 20;
  double total = 0;
  for (std::int64_t begin = 0; begin < n; begin += kChunk) {
    const std::int64_t count = std::min(kChunk, n - begin);
    double lanes[8] = {};
    std::int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
      for (int lane = 0; lane < 8; ++lane) {
        lanes[lane] += static_cast<double>(a[begin + i + lane]) * static_cast<double>(b[begin + i + lane]);
      }
    }
    double sum = 0;
    for (; i < count; ++i) sum += static_cast<double>(a[begin + i]) * static_cast<double>(b[begin + i]);
    for (const double lane : lanes) sum += lane;
    total = begin == 0 ? sum : total + sum;
  }
  return total;
}

TEST(Parallel, ReductionsFollowTheDocumentedAssociation) {
  const std::int64_t n = 2'500'013;
  const Tensor x = testing::random_tensor(n, DType::f32, 11);
  const Tensor y = testing::random_tensor(n, DType::f32, 12);
  EXPECT_EQ(ops::dot(x, y), expected_dot(x.data_as<float>(), y.data_as<float>(), n));
  EXPECT_EQ(ops::squared_norm(x), expected_dot(x.data_as<float>(), x.data_as<float>(), n));
}

TEST(Parallel, ThreadCountIsConfigurable) {
  Threads restore;
  EXPECT_GE(default_num_threads(), 1);
  set_num_threads(3);
  EXPECT_EQ(num_threads(), 3);
  EXPECT_GRADSYNC_ERROR(set_num_threads(0), "at least one thread");
}

}  // namespace
}  // namespace gradsync
