// The uneven-input scenarios (gradsync/dist/join/join.h).
#include "join.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>

#include "expectations.h"
#include "gradsync/dist/horovod/distributed_optimizer.h"
#include "gradsync/dist/join/join.h"
#include "gradsync/dist/zero/zero.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/optim/clip.h"
#include "models.h"
#include "optimizers.h"
#include "test_util.h"

namespace gradsync::testing {

namespace {

int expected_last_joiner(const std::vector<int>& counts) {
  int last = 0;
  for (int r = 0; r < static_cast<int>(counts.size()); ++r) {
    if (counts[static_cast<std::size_t>(r)] >= counts[static_cast<std::size_t>(last)]) last = r;
  }
  return last;
}

}  // namespace

void uneven_data_parallel(comm::Communicator& comm, const UnevenCase& c) {
  SCOPED_TRACE(c.describe());
  const int world = comm.size();
  const int micro = c.microbatches;
  const std::int64_t per_micro = 3;
  int most = 0;
  for (int e = 0; e < c.epochs; ++e) {
    for (int r = 0; r < world; ++r) most = std::max(most, c.count(r, e, world));
  }
  const auto first_sample = [&](int epoch, int step, int rank, int mb) {
    return (((static_cast<std::int64_t>(epoch) * most + step) * world + rank) * micro + mb) * per_micro;
  };
  const auto uses_bias = [&](int epoch, int step, int rank) {
    return !c.find_unused_parameters || (epoch + step + rank) % 3 != 0;
  };
  const std::int64_t samples = first_sample(c.epochs, 0, 0, 0);
  Regression model(samples, DType::f32, c.device);
  Regression single(samples);
  std::unique_ptr<optim::Optimizer> optimizer =
      make_test_optimizer(c.optimizer, model.registry, training_settings(c.optimizer));
  std::unique_ptr<optim::Optimizer> reference =
      make_test_optimizer(c.optimizer, single.registry, training_settings(c.optimizer));
  dist::DataParallel ddp(model.registry, comm,
                         {.bucket_cap_mb = 1e-6,  // a bucket per parameter: several collectives to shadow
                          .find_unused_parameters = c.find_unused_parameters,
                          .compression = c.compression,
                          .shard_gradients = c.zero_stage == 2});
  std::unique_ptr<dist::ZeroOptimizer> zero;
  if (c.zero_stage > 0) zero = std::make_unique<dist::ZeroOptimizer>(*optimizer, ddp, dist::ZeroOptions{.stage = c.zero_stage});
  const double base_lr = optimizer->lr(0);
  const auto schedule = [&](optim::Optimizer& o, int step) {
    if (c.lr_schedule) o.set_lr(0, base_lr * static_cast<double>(step + 1) / 4.0);
  };

  for (int epoch = 0; epoch < c.epochs; ++epoch) {
    std::vector<int> counts;
    for (int r = 0; r < world; ++r) counts.push_back(c.count(r, epoch, world));
    // A ZeroOptimizer joins with its DataParallel: a joined rank keeps stepping its pieces.
    std::vector<dist::Joinable*> participants{&ddp};
    if (zero) participants.push_back(zero.get());
    dist::Join join(participants, {.divide_by_initial_world_size = c.divide_by_initial_world_size}, optimizer.get());
    for (int step = 0; step < counts[static_cast<std::size_t>(comm.rank())]; ++step) {
      for (int mb = 0; mb < micro; ++mb) {
        auto context = dist::ddp_sync_context(ddp, mb + 1 == micro, c.strategy);
        ddp.begin_backward();
        const std::int64_t begin = first_sample(epoch, step, comm.rank(), mb);
        model.backward(begin, begin + per_micro, true, uses_bias(epoch, step, comm.rank()));
        ddp.end_backward();
        context.close();
      }
      if (c.clip > 0) zero ? zero->clip_grad_norm(c.clip) : optim::clip_grad_norm(*optimizer, c.clip);
      schedule(*optimizer, step);
      zero ? zero->step() : optimizer->step();
      optimizer->zero_grad();
    }
    EXPECT_EQ(join.join(), expected_last_joiner(counts)) << "epoch " << epoch;

    // The reference: the ranks still active at each step, averaged by the same rule.
    const int steps = *std::max_element(counts.begin(), counts.end());
    for (int step = 0; step < steps; ++step) {
      int active = 0;
      bool bias_used = false;
      for (int r = 0; r < world; ++r) {
        if (step >= counts[static_cast<std::size_t>(r)]) continue;
        ++active;
        bias_used = bias_used || uses_bias(epoch, step, r);
        for (int mb = 0; mb < micro; ++mb) {
          const std::int64_t begin = first_sample(epoch, step, r, mb);
          single.backward(begin, begin + per_micro, /*mark_ready=*/false, uses_bias(epoch, step, r));
        }
      }
      const double divisor = c.divide_by_initial_world_size ? world : active;
      ops::scale(single.w->grad_for_accumulate(), 1.0 / divisor);
      if (bias_used) ops::scale(single.b->grad_for_accumulate(), 1.0 / divisor);
      if (c.clip > 0) optim::clip_grad_norm(*reference, c.clip);
      schedule(*reference, step);
      reference->step();
      reference->zero_grad();
    }
    expect_near_vectors("w after epoch " + std::to_string(epoch), model.w->value().to_double_vector(),
                        single.w->value().to_double_vector(), c.tolerance);
    expect_near_vectors("b after epoch " + std::to_string(epoch), model.b->value().to_double_vector(),
                        single.b->value().to_double_vector(), c.tolerance);
  }
  // After the joins every rank opens its windows with the same strategy (AUTO: the same
  // decision, or the trials restarted everywhere).
  auto context = dist::ddp_sync_context(ddp, /*is_final_microbatch=*/false, c.strategy);
  Tensor chosen = Tensor::from_vector(std::vector<double>{static_cast<double>(context.strategy())}, {1});
  Tensor all = Tensor::zeros({world}, DType::f64);
  comm.allgather_host(chosen, all);
  for (const double other : all.to_double_vector()) EXPECT_EQ(other, static_cast<double>(context.strategy()));
}

void uneven_distributed_optimizer(comm::Communicator& comm, int passes, bool sparse_bias) {
  SCOPED_TRACE("passes " + std::to_string(passes) + (sparse_bias ? " sparse bias" : ""));
  const int world = comm.size();
  const std::vector<int> counts_of{4, 2, 5, 3};
  std::vector<int> counts;
  for (int r = 0; r < world; ++r) counts.push_back(counts_of[static_cast<std::size_t>(r)]);
  const int steps = *std::max_element(counts.begin(), counts.end());
  const std::int64_t per_pass = 4;
  const auto first_sample = [&](int step, int rank, int pass) {
    return ((static_cast<std::int64_t>(step) * world + rank) * passes + pass) * per_pass;
  };
  Regression model(first_sample(steps, 0, 0));
  Regression single(first_sample(steps, 0, 0));
  std::unique_ptr<optim::Optimizer> inner = make_test_optimizer("adam", model.registry, training_settings("adam"));
  std::unique_ptr<optim::Optimizer> reference = make_test_optimizer("adam", single.registry, training_settings("adam"));
  dist::DistributedOptimizerOptions options{.backward_passes_per_step = passes};
  if (sparse_bias) options.sparse_parameters = {model.b};
  dist::DistributedOptimizer optimizer(*inner, comm, options);
  for (int step = 0; step < counts[static_cast<std::size_t>(comm.rank())]; ++step) {
    for (int pass = 0; pass < passes; ++pass) {
      const std::int64_t begin = first_sample(step, comm.rank(), pass);
      const double bias_grad = model.backward(begin, begin + per_pass, true, /*with_bias=*/!sparse_bias);
      if (sparse_bias) {
        optimizer.set_sparse_grad(*model.b, Tensor::from_vector(std::vector<double>{0.0}, {1}).to(DType::i64),
                                  Tensor::from_vector(std::vector<float>{static_cast<float>(bias_grad)}, {1, 1}));
      }
    }
    optimizer.step();
    optimizer.zero_grad();
  }
  const int last = optimizer.join();
  EXPECT_EQ(last, expected_last_joiner(counts));
  dist::broadcast_parameters(model.registry, comm, last);
  dist::broadcast_optimizer_state(*inner, comm, last);

  for (int step = 0; step < steps; ++step) {
    for (int r = 0; r < world; ++r) {
      if (step >= counts[static_cast<std::size_t>(r)]) continue;
      for (int pass = 0; pass < passes; ++pass) {
        const std::int64_t begin = first_sample(step, r, pass);
        single.backward(begin, begin + per_pass, /*mark_ready=*/false);
      }
    }
    ops::scale(single.w->grad_for_accumulate(), 1.0 / world);  // Horovod: the full size
    ops::scale(single.b->grad_for_accumulate(), 1.0 / world);
    reference->step();
    reference->zero_grad();
  }
  expect_near_vectors("w", model.w->value().to_double_vector(), single.w->value().to_double_vector(), 2e-5);
  expect_near_vectors("b", model.b->value().to_double_vector(), single.b->value().to_double_vector(), 2e-5);
}

void join_throws_on_early_termination(comm::Communicator& comm) {
  const std::vector<int> counts_of{4, 2, 3, 5};
  const int mine = counts_of[static_cast<std::size_t>(comm.rank())];
  const int first_out = *std::min_element(counts_of.begin(), counts_of.begin() + comm.size());
  Regression model(64 * comm.size());
  dist::DataParallel ddp(model.registry, comm);
  int steps = 0;
  std::string message;
  try {
    dist::Join join(ddp, {.throw_on_early_termination = true});
    for (int step = 0; step < mine; ++step) {
      ddp.begin_backward();
      model.backward(step * 2, step * 2 + 2);
      ddp.end_backward();
      model.registry.zero_grad();
      ++steps;
    }
    join.join();
    ADD_FAILURE() << "rank " << comm.rank() << " did not raise";
  } catch (const dist::JoinEarlyTermination& error) {
    message = error.what();
  }
  if (mine == first_out) {
    EXPECT_NE(message.find("Rank " + std::to_string(comm.rank()) + " exhausted all inputs."), std::string::npos) << message;
  } else {
    EXPECT_NE(message.find("Detected at least one rank that exhausted inputs. Throwing across all ranks."),
              std::string::npos)
        << message;
  }
  EXPECT_EQ(steps, first_out) << "every rank stops at the step where the first one ran out (its end_backward raises)";
  comm.barrier();  // still in step
}

}  // namespace gradsync::testing
