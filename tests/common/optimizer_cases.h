// The torch.optim trajectories (tests/fixtures/optimizer_trajectories.safetensors, made by
// tests/reference/generate_optimizer_fixtures.py) replayed through our optimizers, on any
// device: the unit suite runs them on the CPU, the gpu suite on CUDA.
#pragma once

#include <nlohmann/json.hpp>

#include <cmath>
#include <map>
#include <memory>
#include <string>

#include "gradsync/io/safetensors.h"
#include "gradsync/optim/adam.h"
#include "gradsync/optim/sgd.h"
#include "optimizers.h"
#include "test_util.h"

namespace gradsync::testing {

struct OptimizerCase {
  std::string name;
  std::string optimizer;  // SGD, Adam, AdamW
  DType dtype;
  nlohmann::json groups;  // [{"params": [indices], "options": {...}}]
};

class TrajectoryFile {
 public:
  // optimizer_trajectories.safetensors: torch 1.13; optimizer_trajectories_current.safetensors:
  // a current torch, each case once per implementation (loop, foreach, fused).
  explicit TrajectoryFile(const std::string& name = "optimizer_trajectories.safetensors")
      : file_(fixture_path(name)) {
    const auto& metadata = file_.metadata();
    steps_ = std::stoi(metadata.at("steps"));
    for (const auto& shape : nlohmann::json::parse(metadata.at("shapes"))) shapes_.push_back(shape.get<Shape>());
    for (const auto& entry : nlohmann::json::parse(metadata.at("cases"))) {
      cases_.push_back({entry["name"], entry["optimizer"], entry["dtype"] == "f64" ? DType::f64 : DType::f32,
                        entry["groups"]});
    }
  }
  const io::SafetensorsReader& file() const { return file_; }
  const std::vector<OptimizerCase>& cases() const { return cases_; }
  const std::vector<Shape>& shapes() const { return shapes_; }
  int steps() const { return steps_; }
  bool has(const std::string& key) const { return file_.find(key) != nullptr; }
  Tensor read(const std::string& key) const { return file_.read(key); }

 private:
  io::SafetensorsReader file_;
  std::vector<OptimizerCase> cases_;
  std::vector<Shape> shapes_;
  int steps_ = 0;
};

// A registry of the case's four parameters, initialized from the fixture, on `device`.
inline std::unique_ptr<ParameterRegistry> make_case_registry(const TrajectoryFile& data, const OptimizerCase& c,
                                                             Device device) {
  auto registry = std::make_unique<ParameterRegistry>();
  for (std::size_t i = 0; i < data.shapes().size(); ++i) registry->add("p" + std::to_string(i), data.shapes()[i], c.dtype, device);
  registry->finalize();
  for (std::size_t i = 0; i < data.shapes().size(); ++i) {
    (*registry)[i].value().copy_from(data.read(c.name + ".init." + std::to_string(i)));
  }
  return registry;
}

// torch.optim's options as the fixture wrote them (numbers and booleans), as hyperparameters.
inline optim::Hyperparameters hyperparameters_of(const nlohmann::json& options) {
  optim::Hyperparameters values;
  for (auto item = options.begin(); item != options.end(); ++item) {
    values[item.key()] = item.value().is_boolean() ? (item.value().get<bool>() ? 1.0 : 0.0) : item.value().get<double>();
  }
  return values;
}

inline std::unique_ptr<optim::Optimizer> make_case_optimizer(const OptimizerCase& c, ParameterRegistry& registry) {
  std::vector<optim::GroupSettings> groups;
  for (const auto& group : c.groups) {
    std::vector<Parameter*> parameters;
    for (const auto& index : group["params"]) parameters.push_back(&registry[index.get<std::size_t>()]);
    groups.push_back({parameters, hyperparameters_of(group["options"])});
  }
  return make_test_optimizer(c.optimizer, registry, std::move(groups));
}

// Runs steps [first, last) of the case: gradients from the fixture, absent ones undefined.
inline void run_case_steps(const TrajectoryFile& data, const OptimizerCase& c, ParameterRegistry& registry,
                           optim::Optimizer& optimizer, int first, int last) {
  for (int step = first; step < last; ++step) {
    optimizer.zero_grad();
    for (std::size_t i = 0; i < registry.size(); ++i) {
      const std::string key = c.name + ".grad." + std::to_string(step) + "." + std::to_string(i);
      if (data.has(key)) registry[i].set_grad(data.read(key));
    }
    optimizer.step();
  }
}

// Relative agreement: |ours - torch| <= tolerance * max(|ours|, |torch|), and identical
// non-finite values.
inline void expect_matches_torch(const std::string& what, const Tensor& ours, const Tensor& torch, double tolerance) {
  const std::vector<double> a = ours.to_double_vector();
  const std::vector<double> b = torch.to_double_vector();
  ASSERT_EQ(a.size(), b.size()) << what;
  int reported = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const bool same_special = (std::isnan(a[i]) && std::isnan(b[i])) || (std::isinf(a[i]) && a[i] == b[i]);
    const double bound = tolerance * std::max(std::abs(a[i]), std::abs(b[i]));
    if (!same_special && !(std::abs(a[i] - b[i]) <= bound) && reported++ < 3) {
      ADD_FAILURE() << what << "[" << i << "]: ours " << a[i] << ", torch " << b[i] << " (relative difference "
                    << std::abs(a[i] - b[i]) / std::max(std::abs(a[i]), std::abs(b[i])) << ")";
    }
  }
}

// The bound: f64 within 1e-12, f32 within 1e-5 relative.
inline double torch_tolerance(DType dtype) { return dtype == DType::f64 ? 1e-12 : 1e-5; }

// Compares final parameters, state buffers and step counts with PyTorch's, within
// `tolerance` (relative; 0 demands identical bits).
inline void expect_case_matches(const TrajectoryFile& data, const OptimizerCase& c, const ParameterRegistry& registry,
                                const optim::Optimizer& optimizer, double tolerance) {
  for (std::size_t i = 0; i < registry.size(); ++i) {
    const std::string index = std::to_string(i);
    const Parameter& parameter = registry[i];
    expect_matches_torch(c.name + " param " + index, parameter.value(), data.read(c.name + ".final." + index), tolerance);
    for (const std::string& buffer : optimizer.state_buffer_names()) {
      const std::string key = c.name + ".state." + index + "." + buffer;
      const Tensor ours = optimizer.state(parameter, buffer);
      ASSERT_EQ(ours.defined(), data.has(key)) << key << ": state exists in one implementation only";
      if (data.has(key)) expect_matches_torch(key, ours, data.read(key), tolerance);
    }
    if (data.has(c.name + ".step." + index)) {
      EXPECT_EQ(optimizer.step_count(parameter), data.read(c.name + ".step." + index).to_double_vector()[0]) << c.name;
    }
  }
}

// ZeRO's building block (Optimizer::shard): three optimizers over one registry, each owning
// every third run of 7 elements of every arena, step the case together. Their union must be the
// unsharded trajectory: the parameters, and the state gathered from the three, match torch.
inline void run_sharded_case(const TrajectoryFile& data, const OptimizerCase& c, Device device, double tolerance) {
  auto registry = make_case_registry(data, c, device);
  constexpr int kShards = 3;
  constexpr std::int64_t kRun = 7;
  std::vector<std::unique_ptr<optim::Optimizer>> shards;
  for (int k = 0; k < kShards; ++k) {
    shards.push_back(make_case_optimizer(c, *registry));
    std::vector<std::vector<optim::Optimizer::ElementRange>> ranges(registry->arenas().size());
    for (std::size_t a = 0; a < ranges.size(); ++a) {
      const std::int64_t size = registry->arenas()[a].values.numel();
      for (std::int64_t begin = k * kRun; begin < size; begin += kShards * kRun) {
        ranges[a].push_back({begin, std::min(size, begin + kRun)});
      }
    }
    shards.back()->shard(ranges);
  }
  for (int step = 0; step < data.steps(); ++step) {
    shards[0]->zero_grad();
    for (std::size_t i = 0; i < registry->size(); ++i) {
      const std::string key = c.name + ".grad." + std::to_string(step) + "." + std::to_string(i);
      if (data.has(key)) (*registry)[i].set_grad(data.read(key));
    }
    for (auto& shard : shards) shard->step();
  }
  // Every shard's packed buffers, put back in the arena layout.
  const std::size_t buffers = shards[0]->state_buffer_names().size();
  std::vector<std::vector<Tensor>> full(registry->arenas().size(), std::vector<Tensor>(buffers));
  for (std::size_t a = 0; a < full.size(); ++a) {
    for (std::size_t b = 0; b < buffers; ++b) {
      for (auto& shard : shards) {
        const Tensor packed = shard->shard_state(a, b);
        if (!packed.defined()) continue;
        if (!full[a][b].defined()) full[a][b] = Tensor::zeros({registry->arenas()[a].values.numel()}, packed.dtype(), device);
        std::int64_t at = 0;
        for (const auto& range : shard->shard_ranges(a)) {
          Tensor target = full[a][b].view(static_cast<std::size_t>(range.begin), {range.end - range.begin});
          target.copy_from(packed.view(static_cast<std::size_t>(at), {range.end - range.begin}));
          at += range.end - range.begin;
        }
      }
    }
  }
  std::map<std::string, Tensor> state;
  for (const io::NamedTensor& tensor : shards[0]->state_tensors_of(full)) state[tensor.name] = tensor.tensor;
  for (std::size_t i = 0; i < registry->size(); ++i) {
    const std::string index = std::to_string(i);
    const Parameter& parameter = (*registry)[i];
    expect_matches_torch(c.name + " sharded param " + index, parameter.value(), data.read(c.name + ".final." + index),
                         tolerance);
    for (const std::string& buffer : shards[0]->state_buffer_names()) {
      const std::string key = c.name + ".state." + index + "." + buffer;
      const auto ours = state.find("optimizer.state." + parameter.name() + "." + buffer);
      ASSERT_EQ(ours != state.end(), data.has(key)) << key << ": state exists in one implementation only";
      if (data.has(key)) expect_matches_torch(key + " (sharded)", ours->second, data.read(key), tolerance);
    }
  }
}

}  // namespace gradsync::testing
