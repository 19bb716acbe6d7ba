// PyTorch's master-weight recipe and GradScaler (tests/fixtures/mixed_precision.safetensors,
// made by tests/reference/generate_mixed_precision_fixtures.py) replayed through our
// optimizers on any device: the unit suite runs them on the CPU, the gpu suite on CUDA.
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <string>

#include "gradsync/io/safetensors.h"
#include "gradsync/optim/adam.h"
#include "gradsync/optim/clip.h"
#include "gradsync/optim/grad_scaler.h"
#include "gradsync/optim/sgd.h"
#include "optimizer_cases.h"
#include "test_util.h"

namespace gradsync::testing {

struct MixedCase {
  std::string name;
  std::string kind;       // "master" or "scaler"
  std::string optimizer;  // SGD, Adam, AdamW
  nlohmann::json options;
  DType model_dtype;
  DType grad_dtype;
  double clip = 0.0;  // scaler cases: clip_grad_norm's max_norm after unscale (0: none)
  nlohmann::json scaler;
};

inline DType mixed_dtype(const std::string& name) {
  if (name == "bf16") return DType::bf16;
  if (name == "f16") return DType::f16;
  return DType::f32;
}

class MixedFile {
 public:
  MixedFile() : file_(fixture_path("mixed_precision.safetensors")) {
    steps_ = std::stoi(file_.metadata().at("steps"));
    for (const auto& shape : nlohmann::json::parse(file_.metadata().at("shapes"))) shapes_.push_back(shape.get<Shape>());
    for (const auto& entry : nlohmann::json::parse(file_.metadata().at("cases"))) {
      MixedCase c{entry["name"], entry["kind"], entry["optimizer"], entry["options"],
                  mixed_dtype(entry["model_dtype"]), mixed_dtype(entry["grad_dtype"]), 0.0, {}};
      if (entry.contains("clip") && entry["clip"].is_number()) c.clip = entry["clip"].get<double>();
      if (entry.contains("scaler")) c.scaler = entry["scaler"];
      cases_.push_back(c);
    }
  }
  const std::vector<MixedCase>& cases() const { return cases_; }
  const MixedCase& at(const std::string& name) const {
    for (const MixedCase& c : cases_) {
      if (c.name == name) return c;
    }
    throw std::runtime_error("no mixed-precision case " + name);
  }
  const std::vector<Shape>& shapes() const { return shapes_; }
  int steps() const { return steps_; }
  bool has(const std::string& key) const { return file_.find(key) != nullptr; }
  Tensor read(const std::string& key) const { return file_.read(key); }
  std::vector<double> values(const std::string& key) const { return file_.read(key).to_double_vector(); }

 private:
  io::SafetensorsReader file_;
  std::vector<MixedCase> cases_;
  std::vector<Shape> shapes_;
  int steps_ = 0;
};

// The case's model: four parameters of the model dtype with gradients of the grad dtype.
inline std::unique_ptr<ParameterRegistry> make_mixed_registry(const MixedFile& data, const MixedCase& c, Device device) {
  auto registry = std::make_unique<ParameterRegistry>();
  for (std::size_t i = 0; i < data.shapes().size(); ++i) {
    registry->add("p" + std::to_string(i), data.shapes()[i], c.model_dtype, device, true, c.grad_dtype);
  }
  registry->finalize();
  for (std::size_t i = 0; i < data.shapes().size(); ++i) {
    (*registry)[i].value().copy_from(data.read(c.name + ".init." + std::to_string(i)));
  }
  return registry;
}

inline std::unique_ptr<optim::Optimizer> make_mixed_optimizer(const MixedCase& c, ParameterRegistry& registry) {
  return make_test_optimizer(c.optimizer, registry, hyperparameters_of(c.options), optim::MasterWeights::f32);
}

inline void set_fixture_grads(const MixedFile& data, const MixedCase& c, ParameterRegistry& registry, int step) {
  for (std::size_t i = 0; i < registry.size(); ++i) {
    const std::string key = c.name + ".grad." + std::to_string(step) + "." + std::to_string(i);
    if (data.has(key)) registry[i].set_grad(data.read(key));
  }
}

// Master-weight cases: steps [first, last) with the fixture's gradients.
inline void run_master_steps(const MixedFile& data, const MixedCase& c, ParameterRegistry& registry,
                             optim::Optimizer& optimizer, int first, int last) {
  for (int step = first; step < last; ++step) {
    optimizer.zero_grad();
    set_fixture_grads(data, c, registry, step);
    optimizer.step();
  }
}

// GradScaler cases: every step checks the scale in use, the skip decision and (with
// clipping) the total norm against PyTorch's.
inline void run_scaler_steps(const MixedFile& data, const MixedCase& c, ParameterRegistry& registry,
                             optim::Optimizer& optimizer, optim::GradScaler& scaler) {
  const std::vector<double> scales = data.values(c.name + ".scales");
  const std::vector<double> skipped = data.values(c.name + ".skipped");
  const std::vector<double> norms = c.clip > 0 ? data.values(c.name + ".norms") : std::vector<double>{};
  for (int step = 0; step < data.steps(); ++step) {
    const auto s = static_cast<std::size_t>(step);
    optimizer.zero_grad();
    EXPECT_EQ(scaler.scale(), scales[s]) << c.name << " step " << step;
    set_fixture_grads(data, c, registry, step);
    if (c.clip > 0) {
      scaler.unscale(optimizer);
      const double norm = optim::clip_grad_norm(optimizer, c.clip);
      if (std::isfinite(norms[s])) {
        EXPECT_NEAR(norm, norms[s], 1e-6 * norms[s]) << c.name << " step " << step;
      } else {
        EXPECT_FALSE(std::isfinite(norm)) << c.name << " step " << step;
      }
    }
    const bool stepped = scaler.step(optimizer);
    EXPECT_EQ(!stepped, skipped[s] != 0.0) << c.name << " step " << step;
    scaler.update();
  }
  EXPECT_EQ(scaler.scale(), data.values(c.name + ".final_scale")[0]) << c.name;
  EXPECT_EQ(scaler.growth_tracker(), data.values(c.name + ".final_growth_tracker")[0]) << c.name;
}

inline optim::GradScalerOptions fixture_scaler_options(const MixedCase& c) {
  optim::GradScalerOptions options;
  options.init_scale = c.scaler["init_scale"].get<double>();
  options.growth_factor = c.scaler["growth_factor"].get<double>();
  options.backoff_factor = c.scaler["backoff_factor"].get<double>();
  options.growth_interval = c.scaler["growth_interval"].get<std::int64_t>();
  return options;
}

// Model values, master weights, state buffers and step counts against PyTorch's.
// Agreement relative to the tensor's largest magnitude: |ours - torch| <= tolerance * max|torch|
// per element (0: identical bits). A moving average that passes near zero keeps the absolute
// error of its larger terms, so an element-wise relative bound would misjudge it.
inline void expect_close(const std::string& what, const Tensor& ours, const Tensor& torch, double tolerance) {
  if (tolerance == 0.0) return expect_matches_torch(what, ours, torch, 0.0);
  const std::vector<double> a = ours.to_double_vector();
  const std::vector<double> b = torch.to_double_vector();
  ASSERT_EQ(a.size(), b.size()) << what;
  double largest = 0.0;
  for (const double value : b) largest = std::max(largest, std::abs(value));
  int reported = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!(std::abs(a[i] - b[i]) <= tolerance * largest) && reported++ < 3) {
      ADD_FAILURE() << what << "[" << i << "]: ours " << a[i] << ", torch " << b[i] << ", largest " << largest;
    }
  }
}

// `tolerance` (see expect_close; 0: identical bits) for master and state, `model_tolerance` for the
// 16-bit model copy (a master value a few f32 ulps off can round to the neighbouring f16).
inline void expect_mixed_matches(const MixedFile& data, const MixedCase& c, const ParameterRegistry& registry,
                                 const optim::Optimizer& optimizer, double tolerance, double model_tolerance) {
  for (std::size_t i = 0; i < registry.size(); ++i) {
    const std::string index = std::to_string(i);
    const Parameter& parameter = registry[i];
    expect_close(c.name + " model " + index, parameter.value(), data.read(c.name + ".model." + index),
                 model_tolerance);
    const std::string master_key = c.name + ".master." + index;
    const Tensor master = optimizer.master_weight(parameter);
    ASSERT_EQ(master.defined(), data.has(master_key)) << master_key;
    if (master.defined()) {
      expect_close(master_key, master, data.read(master_key), tolerance);
      // The model is always exactly the master rounded to nearest even.
      EXPECT_EQ(parameter.value().to_double_vector(), master.to(parameter.dtype()).to_double_vector()) << master_key;
    }
    for (const std::string& buffer : optimizer.state_buffer_names()) {
      if (buffer == "master") continue;
      const std::string key = c.name + ".state." + index + "." + buffer;
      const Tensor ours = optimizer.state(parameter, buffer);
      ASSERT_EQ(ours.defined(), data.has(key)) << key << ": state exists in one implementation only";
      if (data.has(key)) expect_close(key, ours, data.read(key), tolerance);
    }
    if (data.has(c.name + ".step." + index)) {
      EXPECT_EQ(optimizer.step_count(parameter), data.values(c.name + ".step." + index)[0]) << c.name;
    }
  }
}

}  // namespace gradsync::testing
