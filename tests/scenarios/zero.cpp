// ZeRO's scenarios (gradsync/dist/zero/zero.h).
#include "zero.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "expectations.h"
#include "gradsync/dist/horovod/distributed_optimizer.h"
#include "gradsync/dist/zero/zero.h"
#include "gradsync/optim/clip.h"
#include "models.h"
#include "optimizers.h"

namespace gradsync::testing {

namespace {

std::vector<char> train_sharded(comm::Communicator& comm, const ZeroCase& c, int zero_stage) {
  ShardModel model(c.dtype, c.device);
  const optim::MasterWeights master = c.dtype == DType::f32 ? optim::MasterWeights::none : optim::MasterWeights::f32;
  std::unique_ptr<optim::Optimizer> optimizer =
      make_test_optimizer(c.optimizer, model.registry, zero_settings(c.optimizer), master);
  dist::DataParallelOptions options{.bucket_cap_mb = c.bucket_cap_mb, .find_unused_parameters = c.find_unused_parameters,
                                    .shard_gradients = zero_stage >= 2};
  // Stage 3: each parameter a unit (the embedding and the weight one together).
  if (zero_stage == 3) {
    options.units = {{model.parameters[0], model.parameters[1]}, {model.parameters[2]}, {model.parameters[3]},
                     {model.parameters[4]}};
  }
  dist::DataParallel ddp(model.registry, comm, options);
  std::unique_ptr<dist::ZeroOptimizer> zero;
  if (zero_stage > 0) zero = std::make_unique<dist::ZeroOptimizer>(*optimizer, ddp, dist::ZeroOptions{.stage = zero_stage});
  const auto gather_all = [&] {
    for (std::size_t u = 0; zero_stage == 3 && u < zero->unit_count(); ++u) zero->gather(u);
  };
  const Parameter* bias = model.parameters[2];
  for (int step = 0; step < c.steps; ++step) {
    for (int micro = 0; micro < 2; ++micro) {
      auto context = dist::ddp_sync_context(ddp, micro == 1, c.strategy);
      // Stage 3: the model gathered for the backward, which reads every value (released after
      // it: the units' other pieces go back until the next use).
      gather_all();
      ddp.begin_backward();
      const bool skip = c.find_unused_parameters && (step + comm.rank() + micro) % 3 == 0;
      model.backward(comm.rank(), step, micro, skip ? bias : nullptr);
      ddp.end_backward();
      context.close();
      for (std::size_t u = 0; zero_stage == 3 && u < zero->unit_count(); ++u) zero->release(u);
    }
    if (c.clip > 0) {
      const double norm = zero ? zero->clip_grad_norm(c.clip) : optim::clip_grad_norm(*optimizer, c.clip);
      EXPECT_TRUE(std::isfinite(norm));
    }
    if (zero) {
      zero->step();
      zero->zero_grad();
    } else {
      optimizer->step();
      optimizer->zero_grad();
    }
  }
  if (zero) {
    // This rank's state: its pieces only (the last rank also holds each bucket's remainder, under
    // W elements).
    std::int64_t total = 0, owned = 0;  // the buckets' elements, and this rank's
    for (std::size_t a = 0; a < model.registry.arenas().size(); ++a) owned += optimizer->state_elements(a);
    const auto buckets = static_cast<std::int64_t>(ddp.reducer().bucket_count());
    for (std::size_t b = 0; b < ddp.reducer().bucket_count(); ++b) total += ddp.reducer().bucket(b).numel;
    EXPECT_LE(owned, total / comm.size() + buckets * (comm.size() - 1)) << "owned elements of " << total;
    EXPECT_GE(owned, total / comm.size() - buckets * comm.size());
    EXPECT_FALSE(optimizer->state(*model.parameters[0], optimizer->state_buffer_names()[0]).defined());
  }
  gather_all();  // stage 3: the whole model, to compare
  return arena_bytes(model.registry);
}

std::vector<char> train_horovod(comm::Communicator& comm, const std::string& kind, int zero_stage, int passes,
                                dist::Compression compression) {
  ShardModel model(DType::f32);
  auto inner = make_test_optimizer(kind, model.registry, zero_settings(kind));
  dist::DistributedOptimizer optimizer(*inner, comm,
                                       {.compression = compression, .backward_passes_per_step = passes,
                                        .fusion_threshold_bytes = 256,  // several buckets
                                        .zero_stage = zero_stage});
  if (zero_stage > 0) {
    EXPECT_NE(optimizer.zero(), nullptr);
  }
  for (int step = 0; step < 5; ++step) {
    for (int pass = 0; pass < passes; ++pass) model.backward(comm.rank(), step, pass, nullptr);
    optimizer.clip_grad_norm(1.0);
    optimizer.step();
    optimizer.zero_grad();
  }
  return arena_bytes(model.registry);
}

}  // namespace

void zero_matches_unsharded(comm::Communicator& comm, const ZeroCase& c) {
  SCOPED_TRACE(c.describe() + " on " + std::to_string(comm.size()) + " ranks");
  const std::vector<char> plain = train_sharded(comm, c, 0);
  const std::vector<char> sharded = train_sharded(comm, c, c.stage);
  ASSERT_EQ(plain.size(), sharded.size());
  if (c.stage == 1 && c.clip == 0 && c.strategy != dist::DDPSyncStrategy::auto_select) {
    EXPECT_EQ(std::memcmp(plain.data(), sharded.data(), plain.size()), 0) << "stage 1 differs from unsharded";
  } else {
    expect_near_vectors("weights", as_doubles(sharded, c.dtype), as_doubles(plain, c.dtype),
                        c.dtype == DType::f32 ? 1e-6 : 1e-2);
  }
  // Every rank holds the same weights (the gathers).
  const std::vector<double> values = as_doubles(sharded, c.dtype);
  Tensor mine = Tensor::from_vector(values, {static_cast<std::int64_t>(values.size())});
  Tensor all = Tensor::empty({mine.numel() * comm.size()}, DType::f64);
  comm.allgather_host(mine, all);
  for (int r = 0; r < comm.size(); ++r) {
    EXPECT_EQ(std::memcmp(static_cast<const char*>(all.data()) + r * mine.nbytes(), mine.data(), mine.nbytes()), 0)
        << "rank " << comm.rank() << " and rank " << r << " hold different weights";
  }
}

void horovod_zero_matches_unsharded(comm::Communicator& comm, const HorovodZeroCase& c) {
  SCOPED_TRACE(c.describe());
  const std::vector<char> plain = train_horovod(comm, c.optimizer, 0, c.passes, c.compression);
  for (const int stage : {1, 2}) {
    const std::vector<char> sharded = train_horovod(comm, c.optimizer, stage, c.passes, c.compression);
    expect_near_vectors("stage " + std::to_string(stage), as_doubles(sharded, DType::f32), as_doubles(plain, DType::f32),
                        c.compression == dist::Compression::none ? 1e-6 : 1e-3);
  }
}

}  // namespace gradsync::testing
