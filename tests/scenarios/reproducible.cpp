// Reproducible reductions (reproducible.h).
#include "reproducible.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "gradsync/dist/data_parallel/data_parallel.h"
#include "gradsync/kernels/ops.h"
#include "models.h"
#include "optimizers.h"
#include "test_util.h"

namespace gradsync::testing {

namespace {

using comm::ReduceOp;

const std::vector<DType>& float_dtypes() {
  static const std::vector<DType> dtypes{DType::f32, DType::f64, DType::f16, DType::bf16};
  return dtypes;
}

Tensor input_of(int rank, std::int64_t n, DType dtype) {
  return filled(n, dtype, [rank](std::int64_t i) { return reproducible_input(rank, i); });
}

// ((x0 + x1) + x2) + ... with the dtype's rounding after every addition.
Tensor ascending_fold(int world, std::int64_t n, DType dtype) {
  std::vector<double> sum = input_of(0, n, dtype).to_double_vector();
  for (int rank = 1; rank < world; ++rank) {
    const std::vector<double> x = input_of(rank, n, dtype).to_double_vector();
    for (std::size_t i = 0; i < sum.size(); ++i) {
      // f64 adds in double; f32, f16 and bf16 in float (the 16-bit ones are rounded below).
      sum[i] = dtype == DType::f64 ? sum[i] + x[i]
                                   : static_cast<double>(static_cast<float>(sum[i]) + static_cast<float>(x[i]));
    }
    if (dtype == DType::f16 || dtype == DType::bf16) sum = Tensor::from_vector(sum, {n}).to(dtype).to_double_vector();
  }
  return Tensor::from_vector(sum, {n}).to(dtype);
}

// Bitwise equality, naming the first element that differs.
void expect_same_bits(const Tensor& got, const Tensor& expected, const std::string& what) {
  ASSERT_EQ(got.nbytes(), expected.nbytes()) << what;
  if (std::memcmp(got.data(), expected.data(), got.nbytes()) == 0) return;
  const std::vector<double> a = got.to_double_vector(), b = expected.to_double_vector();
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(double)) != 0) {
      ADD_FAILURE() << what << ": element " << i << " is " << a[i] << ", the ascending fold gives " << b[i];
      return;
    }
  }
}

}  // namespace

double reproducible_input(int rank, std::int64_t i) {
  const int exponent = static_cast<int>((i * 7 + rank * 5) % 23) - 11;
  return std::sin(0.7 * static_cast<double>(i) + 1.9 * rank + 0.3) * std::ldexp(1.0, exponent);
}

void reproducible_reductions(comm::Communicator& comm, const std::vector<std::int64_t>& sizes) {
  const int world = comm.size();
  const int rank = comm.rank();
  for (const DType dtype : float_dtypes()) {
    for (const std::int64_t n : sizes) {
      const std::string where = std::string(dtype_name(dtype)) + " x " + std::to_string(n) + ", rank " +
                                std::to_string(rank) + " of " + std::to_string(world);
      const Tensor expected = ascending_fold(world, n, dtype);

      Tensor sum = input_of(rank, n, dtype);
      comm.allreduce(sum, ReduceOp::sum);
      expect_same_bits(sum, expected, "allreduce sum " + where);

      Tensor average = input_of(rank, n, dtype);
      comm.allreduce(average, ReduceOp::avg);
      Tensor expected_average = expected.clone();
      ops::scale(expected_average, 1.0 / world);
      expect_same_bits(average, expected_average, "allreduce avg " + where);

      // Three tensors of unequal sizes, one collective.
      std::vector<Tensor> parts;
      for (const std::int64_t begin : {std::int64_t{0}, n / 3, n / 2}) {
        const std::int64_t end = begin == 0 ? n / 3 : (begin == n / 3 ? n / 2 : n);
        parts.push_back(input_of(rank, n, dtype).view(static_cast<std::size_t>(begin), {end - begin}).clone());
      }
      comm.allreduce_coalesced(parts, ReduceOp::sum);
      std::int64_t offset = 0;
      for (const Tensor& part : parts) {
        expect_same_bits(part, expected.view(static_cast<std::size_t>(offset), {part.numel()}).clone(),
                         "allreduce_coalesced " + where);
        offset += part.numel();
      }

      // Reduce-scatter of n elements per rank: into its own tensor, and in place.
      const Tensor scattered_expected = ascending_fold(world, n * world, dtype)
                                            .view(static_cast<std::size_t>(n * rank), {n})
                                            .clone();
      const Tensor scatter_input = input_of(rank, n * world, dtype);
      Tensor out = Tensor::zeros({n}, dtype);
      comm.reduce_scatter(scatter_input, out, ReduceOp::sum);
      expect_same_bits(out, scattered_expected, "reduce_scatter " + where);
      Tensor in_place = scatter_input.clone();
      Tensor mine = in_place.view(static_cast<std::size_t>(n * rank), {n});
      comm.reduce_scatter(in_place, mine, ReduceOp::sum);
      expect_same_bits(mine, scattered_expected, "in-place reduce_scatter " + where);

      // The maximum is order-free; it shows the op reaches the ordered path intact.
      Tensor maximum = input_of(rank, n, dtype);
      comm.allreduce(maximum, ReduceOp::max);
      std::vector<double> best = input_of(0, n, dtype).to_double_vector();
      for (int q = 1; q < world; ++q) {
        const std::vector<double> x = input_of(q, n, dtype).to_double_vector();
        for (std::size_t i = 0; i < best.size(); ++i) best[i] = std::max(best[i], x[i]);
      }
      expect_same_bits(maximum, Tensor::from_vector(best, {n}).to(dtype), "allreduce max " + where);
    }
  }
}

bool ordinary_allreduce_differs(comm::Communicator& comm, std::int64_t size) {
  Tensor sum = input_of(comm.rank(), size, DType::f32);
  comm.allreduce(sum, ReduceOp::sum);
  const Tensor expected = ascending_fold(comm.size(), size, DType::f32);
  return std::memcmp(sum.data(), expected.data(), sum.nbytes()) != 0;
}

std::vector<std::vector<char>> train_with_three_bucket_caps(comm::Communicator& comm) {
  std::vector<std::vector<char>> results;
  for (const std::optional<double> cap : {std::optional<double>(0.001), std::optional<double>(0.016), std::optional<double>()}) {
    ShardModel model(DType::f32);
    auto optimizer = make_test_optimizer("adamw", model.registry, zero_settings("adamw"));
    dist::DataParallel ddp(model.registry, comm, {.bucket_cap_mb = cap});
    for (int step = 0; step < 3; ++step) {
      ddp.begin_backward();
      model.backward(comm.rank(), step, 0, nullptr);
      ddp.end_backward();
      optimizer->step();
      optimizer->zero_grad();
    }
    results.push_back(arena_bytes(model.registry));
  }
  return results;
}

}  // namespace gradsync::testing
