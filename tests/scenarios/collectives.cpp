// The collective checks (collectives.h).
#include "collectives.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "expectations.h"

namespace gradsync::testing {

namespace {

double input_value(int rank, std::int64_t i) { return static_cast<double>((i * 7 + rank * 3) % 11 - 5); }
double product_value(int rank, std::int64_t i) { return ((i + rank) % 3 == 0 ? 2.0 : 1.0) * ((i + rank) % 2 ? -1.0 : 1.0); }

}  // namespace

void check_collectives(comm::Communicator& comm, const std::vector<std::int64_t>& sizes,
                       const std::vector<DType>& dtypes, std::optional<Device> on) {
  const Device device = on.value_or(comm.device_type());
  const int rank = comm.rank();
  const int size = comm.size();
  for (DType dtype : dtypes) {
    for (std::int64_t n : sizes) {
      const std::string label = std::string(dtype_name(dtype)) + " x " + std::to_string(n) + ", world " +
                                std::to_string(size) + ", rank " + std::to_string(rank);
      std::vector<double> expected(static_cast<std::size_t>(n));
      const auto expect = [&](const char* what, const Tensor& actual) { expect_close(std::string(what) + " " + label, actual, expected); };

      // allreduce: sum, min, max, prod, avg
      for (comm::ReduceOp op : {comm::ReduceOp::sum, comm::ReduceOp::min, comm::ReduceOp::max}) {
        Tensor t = filled(n, dtype, [&](std::int64_t i) { return input_value(rank, i); }, device);
        comm.allreduce(t, op);
        for (std::int64_t i = 0; i < n; ++i) {
          double value = input_value(0, i);
          for (int r = 1; r < size; ++r) {
            const double x = input_value(r, i);
            value = op == comm::ReduceOp::sum ? value + x : op == comm::ReduceOp::min ? std::min(value, x) : std::max(value, x);
          }
          expected[static_cast<std::size_t>(i)] = value;
        }
        expect(comm::reduce_op_name(op), t);
      }
      {
        Tensor t = filled(n, dtype, [&](std::int64_t i) { return product_value(rank, i); }, device);
        comm.allreduce(t, comm::ReduceOp::prod);
        for (std::int64_t i = 0; i < n; ++i) {
          double value = 1.0;
          for (int r = 0; r < size; ++r) value *= product_value(r, i);
          expected[static_cast<std::size_t>(i)] = value;
        }
        expect("prod", t);
      }
      if (is_floating(dtype)) {
        Tensor t = filled(n, dtype, [&](std::int64_t i) { return input_value(rank, i); }, device);
        Tensor out = Tensor::empty({n}, dtype, device);
        comm.allreduce(t, out, comm::ReduceOp::avg);  // out of place: t is untouched
        for (std::int64_t i = 0; i < n; ++i) {
          double sum = 0;
          for (int r = 0; r < size; ++r) sum += input_value(r, i);
          expected[static_cast<std::size_t>(i)] = sum / size;
        }
        expect("avg", out);
        for (std::int64_t i = 0; i < n; ++i) expected[static_cast<std::size_t>(i)] = input_value(rank, i);
        expect("out-of-place input", t);
      }

      // broadcast from the last rank
      {
        Tensor t = filled(n, dtype, [&](std::int64_t i) { return input_value(rank, i); }, device);
        comm.broadcast(t, size - 1);
        for (std::int64_t i = 0; i < n; ++i) expected[static_cast<std::size_t>(i)] = input_value(size - 1, i);
        expect("broadcast", t);
      }

      // allgather, allgatherv (rank r contributes n + r elements), reduce_scatter
      {
        Tensor mine = filled(n, dtype, [&](std::int64_t i) { return input_value(rank, i); }, device);
        Tensor all = Tensor::empty({n * size}, dtype, device);
        comm.allgather(mine, all);
        std::vector<double> gathered;
        for (int r = 0; r < size; ++r) {
          for (std::int64_t i = 0; i < n; ++i) gathered.push_back(input_value(r, i));
        }
        expect_close("allgather " + label, all, gathered);

        std::vector<std::int64_t> counts;
        std::vector<double> gathered_v;
        for (int r = 0; r < size; ++r) {
          counts.push_back(n + r);
          for (std::int64_t i = 0; i < n + r; ++i) gathered_v.push_back(input_value(r, i));
        }
        Tensor mine_v = filled(n + rank, dtype, [&](std::int64_t i) { return input_value(rank, i); }, device);
        Tensor all_v = Tensor::empty({static_cast<std::int64_t>(gathered_v.size())}, dtype, device);
        comm.allgatherv(mine_v, all_v, counts);
        expect_close("allgatherv " + label, all_v, gathered_v);

        Tensor input = filled(n * size, dtype, [&](std::int64_t i) { return input_value(rank, i); }, device);
        Tensor chunk = Tensor::empty({n}, dtype, device);
        comm.reduce_scatter(input, chunk, comm::ReduceOp::sum);
        for (std::int64_t i = 0; i < n; ++i) {
          double sum = 0;
          for (int r = 0; r < size; ++r) sum += input_value(r, rank * n + i);
          expected[static_cast<std::size_t>(i)] = sum;
        }
        expect("reduce_scatter", chunk);
      }

      // coalesced: two tensors through one flat buffer
      {
        Tensor a = filled(n, dtype, [&](std::int64_t i) { return input_value(rank, i); }, device);
        Tensor b = filled(3, dtype, [&](std::int64_t i) { return input_value(rank, 100 + i); }, device);
        comm.allreduce_coalesced({a, b}, comm::ReduceOp::sum);
        for (std::int64_t i = 0; i < n; ++i) {
          double sum = 0;
          for (int r = 0; r < size; ++r) sum += input_value(r, i);
          expected[static_cast<std::size_t>(i)] = sum;
        }
        expect("coalesced[0]", a);
        std::vector<double> expected_b;
        for (std::int64_t i = 0; i < 3; ++i) {
          double sum = 0;
          for (int r = 0; r < size; ++r) sum += input_value(r, 100 + i);
          expected_b.push_back(sum);
        }
        expect_close("coalesced[1] " + label, b, expected_b);
      }

      // send/recv around a ring. A send completes when the peer has taken the message (for
      // large messages, as MPI's standard-mode send), and each rank's operations run in order,
      // so even ranks send first and odd ranks receive first: no cycle of waiting sends.
      if (size > 1) {
        Tensor out = filled(n, dtype, [&](std::int64_t i) { return input_value(rank, i); }, device);
        Tensor in = Tensor::empty({n}, dtype, device);
        if (rank % 2 == 0) {
          comm.send(out, (rank + 1) % size, 7);
          comm.recv(in, (rank + size - 1) % size, 7);
        } else {
          comm.recv(in, (rank + size - 1) % size, 7);
          comm.send(out, (rank + 1) % size, 7);
        }
        for (std::int64_t i = 0; i < n; ++i) expected[static_cast<std::size_t>(i)] = input_value((rank + size - 1) % size, i);
        expect("recv", in);
      }
    }
  }
  comm.barrier();
}

}  // namespace gradsync::testing
