// Counter-based initialization (gradsync/registry/initializers.h): a piece filled alone equals the
// same elements of the whole parameter bit for bit, for every cut of worlds 1-5 and every dtype;
// the streams depend on the seed and the name only; the draws have the distribution they claim;
// mistakes are named.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "gradsync/registry/initializers.h"
#include "gradsync/registry/parameter_registry.h"
#include "test_util.h"

namespace gradsync {
namespace {

std::vector<unsigned char> bytes_of(const Tensor& tensor) {
  const Tensor host = tensor.to(Device::cpu());
  const auto* data = static_cast<const unsigned char*>(host.data());
  return {data, data + host.nbytes()};
}

TEST(Initializers, APieceEqualsTheWholeForEveryWorldAndDtype) {
  const std::int64_t numel = 40 * 25 + 3;  // not a multiple of any world
  const std::vector<std::pair<const char*, init::Rule>> rules = {
      {"normal", init::normal(0.0, 0.02)},
      {"uniform", init::uniform(-0.2, 0.2)},
      {"from_index", init::from_index([](std::int64_t i) { return std::sin(0.01 * static_cast<double>(i)); })},
      {"ones", init::ones()}};
  for (const DType dtype : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    for (const auto& [label, rule] : rules) {
      Tensor whole = Tensor::empty({numel}, dtype);
      init::fill(whole, "blocks.3.mlp.fc.weight", 0, rule, 1234);
      const std::vector<unsigned char> expected = bytes_of(whole);
      for (int world = 1; world <= 5; ++world) {
        // Rank r's piece: floor(numel / world) elements each, the last rank the remainder too
        // (ZeRO's cut, dist::shard_bucket).
        const std::int64_t piece = numel / world;
        std::vector<unsigned char> joined;
        for (int rank = 0; rank < world; ++rank) {
          const std::int64_t begin = rank * piece;
          const std::int64_t count = rank + 1 == world ? numel - begin : piece;
          Tensor mine = Tensor::empty({count}, dtype);
          init::fill(mine, "blocks.3.mlp.fc.weight", begin, rule, 1234);
          const std::vector<unsigned char> part = bytes_of(mine);
          joined.insert(joined.end(), part.begin(), part.end());
        }
        EXPECT_EQ(joined, expected) << label << " " << dtype_name(dtype) << " at world " << world;
      }
    }
  }
}

TEST(Initializers, TheStreamDependsOnTheSeedAndTheNameOnly) {
  const auto draw = [](const std::string& name, std::uint64_t seed) {
    Tensor t = Tensor::empty({64}, DType::f64);
    init::fill(t, name, 0, init::normal(0.0, 1.0), seed);
    return t.to_double_vector();
  };
  EXPECT_EQ(draw("w", 1), draw("w", 1));
  EXPECT_NE(draw("w", 1), draw("w", 2));
  EXPECT_NE(draw("w", 1), draw("v", 1));
  // Registered under the same name in another registry, or before other parameters: the same.
  ParameterRegistry first, second;
  Parameter& a = first.add("layer.weight", {8, 8});
  second.add("something.else", {3});
  Parameter& b = second.add("layer.weight", {8, 8});
  first.finalize();
  second.finalize();
  init::initialize(a, init::uniform(-1, 1), 7);
  init::initialize(b, init::uniform(-1, 1), 7);
  EXPECT_EQ(a.value().to_double_vector(), b.value().to_double_vector());
}

TEST(Initializers, DrawsHaveTheirDistribution) {
  const std::int64_t n = 1 << 20;
  Tensor normal = Tensor::empty({n}, DType::f64);
  init::fill(normal, "n", 0, init::normal(0.5, 2.0), 3);
  double sum = 0, squares = 0;
  std::int64_t within_one = 0;
  for (const double v : normal.to_double_vector()) {
    sum += v;
    squares += v * v;
    within_one += std::abs(v - 0.5) < 2.0 ? 1 : 0;
  }
  const double mean = sum / n, std = std::sqrt(squares / n - mean * mean);
  EXPECT_NEAR(mean, 0.5, 0.01);
  EXPECT_NEAR(std, 2.0, 0.01);
  EXPECT_NEAR(static_cast<double>(within_one) / n, 0.6827, 0.002);  // one sigma
  Tensor uniform = Tensor::empty({n}, DType::f64);
  init::fill(uniform, "u", 0, init::uniform(-3.0, 1.0), 3);
  const std::vector<double> u = uniform.to_double_vector();
  double total = 0;
  std::vector<std::int64_t> bins(16, 0);
  for (const double v : u) {
    ASSERT_GE(v, -3.0);
    ASSERT_LT(v, 1.0);
    total += v;
    ++bins[static_cast<std::size_t>((v + 3.0) / 4.0 * 16)];
  }
  EXPECT_NEAR(total / n, -1.0, 0.01);
  for (const std::int64_t count : bins) EXPECT_NEAR(static_cast<double>(count) / n, 1.0 / 16, 0.002);
}

TEST(Initializers, MistakesAreNamed) {
  Tensor integers = Tensor::zeros({4}, DType::i64);
  Tensor floats = Tensor::zeros({4}, DType::f32);
  EXPECT_GRADSYNC_ERROR(init::fill(integers, "ids", 0, init::zeros(), 1), "init: 'ids': the target must be a floating");
  EXPECT_GRADSYNC_ERROR(init::fill(floats, "w", -1, init::zeros(), 1), "'w': first element -1 is negative");
  EXPECT_GRADSYNC_ERROR(init::fill(floats, "w", 0, init::normal(0, 0), 1), "'w': a normal rule needs");
  EXPECT_GRADSYNC_ERROR(init::fill(floats, "w", 0, init::uniform(1, 1), 1), "'w': a uniform rule needs");
  EXPECT_GRADSYNC_ERROR(init::fill(floats, "w", 0, init::from_index({}), 1), "'w': a from_index rule without");
}

}  // namespace
}  // namespace gradsync
