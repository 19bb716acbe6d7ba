// ZeRO (dist/zero.h), written once against a Communicator: run on Gloo ranks-as-threads
// (multirank/test_zero.cpp, 2-4 ranks) and on MPI processes (multirank/test_mpi.cpp). Each
// scenario trains the same model twice, unsharded DataParallel and ZeRO, on the same data,
// and compares the weights.
#pragma once

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/dist/zero.h"
#include "gradsync/optim/adam.h"
#include "gradsync/optim/clip.h"
#include "gradsync/optim/sgd.h"
#include "join_scenarios.h"

namespace gradsync::testing {

struct ZeroCase {
  int stage = 1;
  std::string optimizer = "adam";  // sgd (momentum, weight decay) | adam | adamw
  dist::DDPSyncStrategy strategy = dist::DDPSyncStrategy::single_auto_sync;
  bool find_unused_parameters = false;  // then "bias" is skipped by some ranks at some steps
  std::optional<double> bucket_cap_mb = 1e-6;  // unset: DDP's default buckets (one here)
  DType dtype = DType::f32;  // bf16: 16-bit model with f32 master weights
  double clip = 0;           // clip to this global norm before each step (0: off)
  int steps = 6;
  Device device = Device::cpu();  // where the parameters live (device_scenarios.h runs cuda too)
  std::string describe() const {
    return "stage " + std::to_string(stage) + " " + optimizer + " " + dist::sync_strategy_name(strategy) +
           (find_unused_parameters ? " unused" : "") + (bucket_cap_mb ? " small buckets" : " one bucket") + " " +
           dtype_name(dtype) + (clip > 0 ? " clip" : "") + " on " + device.str();
  }
};

// Parameters of odd sizes, so that pieces cut through them; each rank's gradient depends on
// the current weights, its rank, the step and the microbatch.
struct ShardModel {
  ParameterRegistry registry;
  std::vector<Parameter*> parameters;
  explicit ShardModel(DType dtype, Device device = Device::cpu()) {
    for (const auto& [name, shape] : std::vector<std::pair<std::string, Shape>>{
             {"embedding", {13, 7}}, {"weight", {37}}, {"bias", {1}}, {"head", {5, 11}}, {"scale", {129}}}) {
      parameters.push_back(&registry.add(name, shape, dtype, device));
    }
    registry.finalize();
    for (std::size_t k = 0; k < parameters.size(); ++k) {
      std::vector<double> init(static_cast<std::size_t>(parameters[k]->numel()));
      for (std::size_t i = 0; i < init.size(); ++i) init[i] = 0.05 * std::sin(1.7 * static_cast<double>(i) + static_cast<double>(k));
      parameters[k]->value().copy_from(Tensor::from_vector(init, parameters[k]->shape()).to(dtype).to(device));
    }
  }
  // Every parameter's values, in registration order.
  std::vector<double> all_values() const {
    std::vector<double> all;
    for (const Parameter* p : parameters) {
      const std::vector<double> v = p->value().to_double_vector();
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  }
  // A backward: gradients written last parameter first, `skip` left out.
  void backward(int rank, int step, int micro, const Parameter* skip) {
    for (std::size_t k = parameters.size(); k-- > 0;) {
      Parameter& p = *parameters[k];
      if (&p == skip) continue;
      const std::vector<double> v = p.value().to_double_vector();
      std::vector<double> g(v.size());
      for (std::size_t i = 0; i < g.size(); ++i) {
        g[i] = 0.3 * v[i] + 0.02 * (rank + 1) * std::cos(0.37 * static_cast<double>(i) + step + 0.5 * micro + static_cast<double>(k));
      }
      p.accumulate_grad(Tensor::from_vector(g, p.shape()).to(p.grad_dtype()).to(p.device()));
      registry.mark_ready(p);
    }
  }
};

inline std::unique_ptr<optim::Optimizer> make_zero_test_optimizer(const std::string& kind, ParameterRegistry& registry,
                                                                  optim::MasterWeights master) {
  if (kind == "sgd") {
    return std::make_unique<optim::SGD>(registry, optim::SGD::Options{.lr = 0.1, .momentum = 0.9, .dampening = 0.0,
                                                                      .weight_decay = 0.01, .nesterov = true,
                                                                      .maximize = false},
                                        master);
  }
  const optim::Adam::Options options{.lr = 0.01, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1,
                                     .amsgrad = kind == "adamw", .maximize = false};
  if (kind == "adamw") return std::make_unique<optim::AdamW>(registry, options, master);
  return std::make_unique<optim::Adam>(registry, options, master);
}

inline std::vector<char> arena_bytes(const ParameterRegistry& registry) {
  std::vector<char> bytes;
  for (const Arena& arena : registry.arenas()) {
    const Tensor host = arena.values.to(Device::cpu());
    const char* data = static_cast<const char*>(host.data());
    bytes.insert(bytes.end(), data, data + host.nbytes());
  }
  return bytes;
}

// Trains `c.steps` steps of 2 microbatches; `zero_stage` 0 is plain DataParallel.
inline std::vector<char> train_sharded(comm::Communicator& comm, const ZeroCase& c, int zero_stage) {
  ShardModel model(c.dtype, c.device);
  const optim::MasterWeights master = c.dtype == DType::f32 ? optim::MasterWeights::none : optim::MasterWeights::f32;
  std::unique_ptr<optim::Optimizer> optimizer = make_zero_test_optimizer(c.optimizer, model.registry, master);
  dist::DataParallel ddp(model.registry, comm,
                         {.bucket_cap_mb = c.bucket_cap_mb, .find_unused_parameters = c.find_unused_parameters,
                          .shard_gradients = zero_stage == 2});
  std::unique_ptr<dist::ZeroOptimizer> zero;
  if (zero_stage > 0) zero = std::make_unique<dist::ZeroOptimizer>(*optimizer, ddp, dist::ZeroOptions{.stage = zero_stage});
  const Parameter* bias = model.parameters[2];
  for (int step = 0; step < c.steps; ++step) {
    for (int micro = 0; micro < 2; ++micro) {
      auto context = dist::ddp_sync_context(ddp, micro == 1, c.strategy);
      ddp.begin_backward();
      const bool skip = c.find_unused_parameters && (step + comm.rank() + micro) % 3 == 0;
      model.backward(comm.rank(), step, micro, skip ? bias : nullptr);
      ddp.end_backward();
      context.close();
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
  return arena_bytes(model.registry);
}

inline std::vector<double> as_doubles(const std::vector<char>& bytes, DType dtype) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(bytes.size() / dtype_size(dtype))}, dtype);
  std::memcpy(t.data(), bytes.data(), bytes.size());
  return t.to_double_vector();
}

// ZeRO's weights equal unsharded DataParallel's: bitwise for stage 1 without clipping or AUTO (AUTO
// may time its trials differently in the two runs and pick another strategy; the same
// allreduce, an element-wise update), within 1e-6 relative otherwise; every replica the same.
inline void zero_matches_unsharded(comm::Communicator& comm, const ZeroCase& c) {
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

// The DistributedOptimizer with zero_stage 1 and 2 against itself unsharded (Horovod's Average,
// backward_passes_per_step, compression): stage 1 bit for bit, stage 2 within 1e-6.
inline std::vector<char> train_horovod(comm::Communicator& comm, const std::string& kind, int zero_stage, int passes,
                                       dist::Compression compression) {
  ShardModel model(DType::f32);
  auto inner = make_zero_test_optimizer(kind, model.registry, optim::MasterWeights::none);
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

inline void horovod_zero_matches_unsharded(comm::Communicator& comm) {
  for (const std::string kind : {"sgd", "adam"}) {
    for (const int passes : {1, 2}) {
      for (const dist::Compression compression : {dist::Compression::none, dist::Compression::fp16}) {
        SCOPED_TRACE(kind + " passes " + std::to_string(passes) + " " + dist::compression_name(compression));
        const std::vector<char> plain = train_horovod(comm, kind, 0, passes, compression);
        for (const int stage : {1, 2}) {
          const std::vector<char> sharded = train_horovod(comm, kind, stage, passes, compression);
          // Clipping sums the norm's pieces in another order: within 1e-6 even at stage 1.
          expect_near_vectors("stage " + std::to_string(stage), as_doubles(sharded, DType::f32),
                              as_doubles(plain, DType::f32), compression == dist::Compression::none ? 1e-6 : 1e-3);
        }
      }
    }
  }
}

}  // namespace gradsync::testing
