// The models the multi-rank tests train: small, hand-written forward and backward passes whose
// gradients a test can also compute on one rank as the reference.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "gradsync/io/safetensors.h"
#include "gradsync/nn/layers.h"
#include "gradsync/registry/parameter_registry.h"

namespace gradsync::testing {

// Linear regression written out by hand: pred = x.w + b, loss = mean 0.5 (pred - y)^2. The
// data set is the same on every rank (seeded); a rank trains on its slice of each batch.
struct Regression {
  static constexpr std::int64_t kFeatures = 37;
  ParameterRegistry registry;
  Parameter* w;
  Parameter* b;
  std::vector<std::vector<double>> x;
  std::vector<double> y;
  Device device;

  explicit Regression(std::int64_t samples, DType dtype = DType::f32, Device device_ = Device::cpu());
  // Gradients of the mean loss over samples [begin, end), written and marked ready last
  // layer first (b, then w), as an engine's backward would. Without `with_bias` the bias's
  // gradient is not written (a parameter this backward does not use); it is returned either way.
  double backward(std::int64_t begin, std::int64_t end, bool mark_ready = true, bool with_bias = true);
};

// The MLP of the FSDP2 fixtures (tests/reference/generate_fsdp_fixtures.py): Linear(8, 16), ReLU,
// Linear(16, 16), ReLU, Linear(16, 4), its parameters named as torch.nn.Sequential's ("0.weight",
// ...). The registry is finalized and each value read from the fixture's "init.<name>".
std::shared_ptr<nn::Sequential> fixture_mlp(ParameterRegistry& registry, const io::SafetensorsReader& fixture);

// Parameters of odd sizes, so that ZeRO's pieces cut through them; each rank's gradient depends
// on the current weights, its rank, the step and the microbatch.
struct ShardModel {
  ParameterRegistry registry;
  std::vector<Parameter*> parameters;  // embedding, weight, bias, head, scale
  explicit ShardModel(DType dtype, Device device = Device::cpu());
  // Every parameter's values, in registration order.
  std::vector<double> all_values() const;
  // A backward: gradients written last parameter first, `skip` left out.
  void backward(int rank, int step, int micro, const Parameter* skip);
};

// The registry's values, every arena's bytes in order (on the host).
std::vector<char> arena_bytes(const ParameterRegistry& registry);
// Bytes of `dtype` elements as doubles.
std::vector<double> as_doubles(const std::vector<char>& bytes, DType dtype);

}  // namespace gradsync::testing
