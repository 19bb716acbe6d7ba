// Training loops with a death (peer_death.h).
#include "peer_death.h"

#include "gradsync/dist/data_parallel/data_parallel.h"
#include "gradsync/dist/join/join.h"
#include "gradsync/dist/zero/zero.h"
#include "gradsync/optim/sgd.h"
#include "models.h"
#include "optimizers.h"

namespace gradsync::testing {

void zero_training_with_a_death(comm::Communicator& comm, int stage, bool in_backward, int victim,
                                const std::function<void()>& die) {
  ShardModel model(DType::f32);
  auto adam = make_test_optimizer("adam", model.registry, zero_settings("adam"));
  dist::DataParallelOptions options{.bucket_cap_mb = 1e-6, .shard_gradients = stage >= 2};
  const std::vector<Parameter*>& p = model.parameters;
  if (stage == 3) options.units = {{p[0]}, {p[1], p[2]}, {p[3]}, {p[4]}};
  dist::DataParallel ddp(model.registry, comm, options);
  dist::ZeroOptimizer zero(*adam, ddp, {.stage = stage});
  for (int step = 0; step < 3; ++step) {
    const bool dies_now = step == 2 && comm.rank() == victim;
    if (stage == 3) {
      if (dies_now && !in_backward) die();  // the others are in the gathers of the forward
      for (std::size_t u = 0; u < zero.unit_count(); ++u) zero.gather(u);  // this small model stays gathered
    }
    ddp.begin_backward();
    if (dies_now && in_backward) die();
    model.backward(comm.rank(), step, 0, nullptr);
    ddp.end_backward();
    if (dies_now) die();
    zero.step();
    zero.zero_grad();
  }
}

void join_training_with_a_death(comm::Communicator& comm, int victim, const std::function<void()>& die) {
  Regression model(64);
  optim::SGD sgd(model.registry, optim::SGD::Options{.lr = 0.05, .momentum = 0.9, .dampening = 0.0,
                                                     .weight_decay = 0.0, .nesterov = false, .maximize = false});
  dist::DataParallel ddp(model.registry, comm, {.bucket_cap_mb = 1e-6});
  const int batches = comm.rank() == 0 ? 1 : 4;
  dist::Join join(ddp, {}, &sgd);
  for (int step = 0; step < batches; ++step) {
    if (comm.rank() == victim && step == 2) die();
    ddp.begin_backward();
    model.backward(step * 4, step * 4 + 4);
    ddp.end_backward();
    sgd.step();
    sgd.zero_grad();
  }
  join.join();
}

}  // namespace gradsync::testing
