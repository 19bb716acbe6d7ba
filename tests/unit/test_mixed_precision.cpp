// Mixed precision: f16/bf16 models stepped through f32 master weights, GradScaler and
// clip_grad_norm, against PyTorch (tests/fixtures/mixed_precision.safetensors) and against
// independent computations.
#include <gtest/gtest.h>

#include <cmath>

#include "gradsync/core/error.h"
#include "gradsync/core/half.h"
#include "gradsync/io/registry_checkpoint.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/nn/layers.h"
#include "mixed_precision_cases.h"

using namespace gradsync;
using namespace gradsync::testing;

namespace {

// A 1-D CPU tensor of `dtype` holding the given values (rounded to it).
Tensor make(const std::vector<double>& values, DType dtype) {
  return Tensor::from_vector(values, {static_cast<std::int64_t>(values.size())}).to(dtype);
}

const MixedFile& mixed_file() {
  static const MixedFile file;
  return file;
}

std::vector<std::string> case_names(const std::string& kind) {
  std::vector<std::string> names;
  for (const MixedCase& c : mixed_file().cases()) {
    if (c.kind == kind) names.push_back(c.name);
  }
  return names;
}

// Where the math is the same, bit for bit: SGD (torch 2.x computes it exactly as we do). Adam
// and AdamW differ in two roundings from current PyTorch: torch 2.x updates exp_avg with
// lerp_ (we follow torch.optim 1.13's mul_/add_, bit for bit, tests/unit/test_optimizers.cpp),
// and the PyPI build's CPU sqrt (MKL's vector math) is not correctly rounded. Their master
// weights and state agree to 1e-5 of each tensor's largest value, the 16-bit model to one unit
// in the last place (a master value a few f32 ulps off can round to the neighbouring 16-bit one).
struct Tolerances {
  double master;
  double model;
};
Tolerances tolerances(const MixedCase& c) {
  if (c.optimizer == "SGD" && c.clip == 0.0) return {0.0, 0.0};
  return {1e-5, c.model_dtype == DType::bf16 ? 1.0 / 128 : 1.0 / 1024};
}

class MasterTrajectory : public ::testing::TestWithParam<std::string> {};
class ScalerTrajectory : public ::testing::TestWithParam<std::string> {};

}  // namespace

// The fused mixed-precision pass reproduces PyTorch's master-weight recipe: the master weights
// and state (f32 arithmetic as torch.optim's on p.grad.float()) and the model copy (the master
// rounded to nearest even, checked exactly against our own master in every case).
TEST_P(MasterTrajectory, MatchesPyTorch) {
  const MixedFile& data = mixed_file();
  const MixedCase& c = data.at(GetParam());
  auto registry = make_mixed_registry(data, c, Device::cpu());
  auto optimizer = make_mixed_optimizer(c, *registry);
  run_master_steps(data, c, *registry, *optimizer, 0, data.steps());
  expect_mixed_matches(data, c, *registry, *optimizer, tolerances(c).master, tolerances(c).model);
}

// A checkpoint with master weights resumes exactly: save halfway, load into a fresh model and
// optimizer, finish, and the result equals PyTorch's uninterrupted run.
TEST_P(MasterTrajectory, ResumesBitwiseFromACheckpoint) {
  const MixedFile& data = mixed_file();
  const MixedCase& c = data.at(GetParam());
  TempDir folder;
  const int half = data.steps() / 2;
  {
    auto registry = make_mixed_registry(data, c, Device::cpu());
    auto optimizer = make_mixed_optimizer(c, *registry);
    run_master_steps(data, c, *registry, *optimizer, 0, half);
    io::save_registry(*registry, folder / "model.safetensors");
    optimizer->save_state(folder / "optimizer.safetensors");
  }
  auto registry = make_mixed_registry(data, c, Device::cpu());
  auto optimizer = make_mixed_optimizer(c, *registry);
  io::load_registry(*registry, folder / "model.safetensors");
  optimizer->load_state(folder / "optimizer.safetensors");
  run_master_steps(data, c, *registry, *optimizer, half, data.steps());
  expect_mixed_matches(data, c, *registry, *optimizer, tolerances(c).master, tolerances(c).model);

  // And bit for bit what the uninterrupted run gives here.
  auto straight = make_mixed_registry(data, c, Device::cpu());
  auto straight_optimizer = make_mixed_optimizer(c, *straight);
  run_master_steps(data, c, *straight, *straight_optimizer, 0, data.steps());
  for (std::size_t i = 0; i < straight->size(); ++i) {
    EXPECT_EQ((*registry)[i].value().to_double_vector(), (*straight)[i].value().to_double_vector()) << i;
    EXPECT_EQ(optimizer->master_weight((*registry)[i]).to_double_vector(),
              straight_optimizer->master_weight((*straight)[i]).to_double_vector()) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(AllCases, MasterTrajectory, ::testing::ValuesIn(case_names("master")),
                         [](const auto& info) { return info.param; });

// The GradScaler's sequence of scales and skipped steps equals torch's on gradients that
// overflow on purpose, and so do the weights; with clipping (computed in double here, in f32
// by torch) the norms agree to 1e-6 and the weights to f32 rounding.
TEST_P(ScalerTrajectory, MatchesPyTorch) {
  const MixedFile& data = mixed_file();
  const MixedCase& c = data.at(GetParam());
  auto registry = make_mixed_registry(data, c, Device::cpu());
  auto optimizer = make_mixed_optimizer(c, *registry);
  optim::GradScaler scaler(fixture_scaler_options(c));
  run_scaler_steps(data, c, *registry, *optimizer, scaler);
  expect_mixed_matches(data, c, *registry, *optimizer, tolerances(c).master, tolerances(c).model);
}

INSTANTIATE_TEST_SUITE_P(AllCases, ScalerTrajectory, ::testing::ValuesIn(case_names("scaler")),
                         [](const auto& info) { return info.param; });

// ---------------------------------------------------------------------------------------------
// Master weights: loading, errors

TEST(MasterWeights, A16BitParameterWithoutMasterWeightsIsAnErrorNamingIt) {
  ParameterRegistry registry;
  registry.add("encoder.weight", {4}, DType::bf16);
  registry.finalize();
  EXPECT_GRADSYNC_ERROR(optim::Adam(registry, optim::Adam::Options{}), "'encoder.weight'", "bf16",
                        "MasterWeights::f32");
  EXPECT_GRADSYNC_ERROR(optim::SGD(registry, optim::SGD::Options{.lr = 0.1}), "'encoder.weight'", "MasterWeights::f32");
}

TEST(MasterWeights, AGradientDtypeOnlyFor16BitParameters) {
  ParameterRegistry registry;
  EXPECT_GRADSYNC_ERROR(registry.add("w", {4}, DType::f32, Device::cpu(), true, DType::bf16), "'w'",
                        "only a f16/bf16 parameter");
  Parameter& p = registry.add("v", {4}, DType::bf16, Device::cpu(), true, DType::f32);
  registry.finalize();
  EXPECT_EQ(p.grad().dtype(), DType::f32);
  EXPECT_GRADSYNC_ERROR(p.set_grad(Tensor::zeros({4}, DType::bf16)), "'v'", "f32");
}

// A plain bf16 model file (no master weights) loads, and the optimizer takes its master copy
// from the loaded values at the next step.
TEST(MasterWeights, APlainBf16FileSeedsTheMasterCopy) {
  TempDir folder;
  ParameterRegistry source;
  source.add("w", {5}, DType::bf16);
  source.finalize();
  source.at("w").value().copy_from(make({1.5, -2.0, 0.25, 3.0, 1e-3}, DType::bf16));
  io::save_registry(source, folder / "plain.safetensors");

  ParameterRegistry registry;
  Parameter& w = registry.add("w", {5}, DType::bf16);
  registry.finalize();
  optim::SGD sgd(registry, optim::SGD::Options{.lr = 0.5}, optim::MasterWeights::f32);
  io::load_registry(registry, folder / "plain.safetensors");
  w.set_grad(make({1.0, 1.0, 1.0, 1.0, 1.0}, DType::bf16));
  sgd.step();
  EXPECT_EQ(sgd.master_weight(w).to_double_vector(),
            (std::vector<double>{1.0, -2.5, -0.25, 2.5, static_cast<float>(bf16_bits_to_float(float_to_bf16_bits(1e-3f)) - 0.5f)}));
}

// An f32 checkpoint into a bf16 model: the model gets the rounded values (convert_dtypes), and
// load_master_weights keeps the exact f32 values as the master copy.
TEST(MasterWeights, AnF32CheckpointLoadsIntoABf16ModelKeepingF32Masters) {
  TempDir folder;
  ParameterRegistry source;
  source.add("w", {3});
  source.finalize();
  const std::vector<double> exact{1.0 + 1.0 / 1024, -3.14159274101257324, 1e-5};
  source.at("w").value().copy_from(Tensor::from_vector(exact, {3}).to(DType::f32));
  io::save_registry(source, folder / "f32.safetensors");

  ParameterRegistry registry;
  Parameter& w = registry.add("w", {3}, DType::bf16);
  registry.finalize();
  EXPECT_GRADSYNC_ERROR(io::load_registry(registry, folder / "f32.safetensors"), "'w' has dtype f32", "bf16");
  io::load_registry(registry, folder / "f32.safetensors", {.convert_dtypes = true});
  EXPECT_EQ(w.value().to_double_vector(), Tensor::from_vector(exact, {3}).to(DType::bf16).to_double_vector());

  optim::Adam adam(registry, optim::Adam::Options{}, optim::MasterWeights::f32);
  EXPECT_EQ(adam.load_master_weights(io::SafetensorsReader(folder / "f32.safetensors")), 1u);
  EXPECT_EQ(adam.master_weight(w).to_double_vector(), Tensor::from_vector(exact, {3}).to(DType::f32).to_double_vector());
  // The first step starts from the f32 values, not from their bf16 image.
  w.set_grad(Tensor::zeros({3}, DType::bf16));
  adam.step();
  EXPECT_EQ(adam.master_weight(w).to_double_vector(), Tensor::from_vector(exact, {3}).to(DType::f32).to_double_vector());
}

TEST(MasterWeights, StateOfAnotherPrecisionDoesNotLoad) {
  TempDir folder;
  ParameterRegistry a;
  Parameter& pa = a.add("w", {4}, DType::bf16);
  a.finalize();
  optim::Adam with_master(a, optim::Adam::Options{}, optim::MasterWeights::f32);
  pa.set_grad(Tensor::zeros({4}, DType::bf16));
  with_master.step();
  with_master.save_state(folder / "state.safetensors");

  ParameterRegistry b;
  b.add("w", {4}, DType::f32);
  b.finalize();
  optim::Adam plain(b, optim::Adam::Options{});
  EXPECT_GRADSYNC_ERROR(plain.load_state(folder / "state.safetensors"), "no state buffer 'master'");
}

// ---------------------------------------------------------------------------------------------
// clip_grad_norm

namespace {

// Three parameters with known gradients (one undefined, skipped as PyTorch skips None).
struct ClipFixture {
  ParameterRegistry registry;
  Parameter* a;
  Parameter* b;
  Parameter* c;
  ClipFixture() {
    a = &registry.add("a", {3});
    b = &registry.add("b", {2});
    c = &registry.add("c", {2});
    registry.finalize();
    a->set_grad(make({3.0, 0.0, -4.0}, DType::f32));  // norm 5
    b->set_grad(make({12.0, 0.0}, DType::f32));       // norm 12
  }
  std::vector<Parameter*> all() { return {a, b, c}; }
};

}  // namespace

TEST(ClipGradNorm, NormsAndCoefficientsAsTorch) {
  ClipFixture f;
  const auto all = f.all();
  EXPECT_EQ(optim::clip_grad_norm(all, 26.0), 13.0);  // sqrt(25 + 144); coefficient > 1 clamps to 1
  EXPECT_EQ(f.b->grad().to_double_vector(), (std::vector<double>{12.0, 0.0}));
  EXPECT_EQ(optim::clip_grad_norm(all, 1.0, optim::kInfinityNorm), 12.0);
  const float coefficient = static_cast<float>(1.0 / (12.0 + 1e-6));
  EXPECT_EQ(f.b->grad().to_double_vector()[0], static_cast<double>(12.0f * coefficient));
  EXPECT_FALSE(f.c->grad_defined());
}

// The optimizer overload defers the coefficient into the fused step: the same result, to the
// bit, as scaling the gradients in place first.
TEST(ClipGradNorm, DeferredIntoTheStepEqualsClippingInPlace) {
  ClipFixture deferred, in_place;
  optim::SGD sgd_deferred(deferred.registry, optim::SGD::Options{.lr = 0.1, .momentum = 0.9});
  optim::SGD sgd_in_place(in_place.registry, optim::SGD::Options{.lr = 0.1, .momentum = 0.9});
  const auto parameters = in_place.all();
  EXPECT_EQ(optim::clip_grad_norm(sgd_deferred, 2.0), optim::clip_grad_norm(parameters, 2.0));
  EXPECT_EQ(sgd_deferred.pending_gradient_clip(), 2.0 / (13.0 + 1e-6));
  sgd_deferred.step();
  sgd_in_place.step();
  EXPECT_EQ(sgd_deferred.pending_gradient_clip(), 1.0);  // used once
  for (const char* name : {"a", "b", "c"}) {
    EXPECT_EQ(deferred.registry.at(name).value().to_double_vector(), in_place.registry.at(name).value().to_double_vector())
        << name;
  }
}

TEST(ClipGradNorm, NonFiniteNormNamesTheParameters) {
  ClipFixture f;
  f.b->grad_for_overwrite().copy_from(make({std::nan(""), 1.0}, DType::f32));
  optim::SGD sgd(f.registry, optim::SGD::Options{.lr = 0.1});
  EXPECT_GRADSYNC_ERROR(optim::clip_grad_norm(sgd, 1.0, 2.0, true), "non-finite", "'b'", "1 gradient element",
                        "error_if_nonfinite");
  EXPECT_TRUE(std::isnan(optim::clip_grad_norm(sgd, 1.0)));  // without the flag: PyTorch's NaN total
  EXPECT_GRADSYNC_ERROR(optim::clip_grad_norm(sgd, 1.0, 1.0), "norm_type 1");
}

// ---------------------------------------------------------------------------------------------
// GradScaler

TEST(GradScaler, ChecksOrderAndOptions) {
  ParameterRegistry registry;
  Parameter& w = registry.add("w", {2}, DType::f16);
  registry.finalize();
  optim::SGD sgd(registry, optim::SGD::Options{.lr = 0.1}, optim::MasterWeights::f32);
  optim::GradScaler scaler;
  w.set_grad(make({1.0, 2.0}, DType::f16));
  scaler.unscale(sgd);
  EXPECT_GRADSYNC_ERROR(scaler.unscale(sgd), "unscale() has already been called");
  EXPECT_TRUE(scaler.step(sgd));
  EXPECT_GRADSYNC_ERROR(scaler.step(sgd), "step() has already been called");
  scaler.update();
  EXPECT_GRADSYNC_ERROR(scaler.update(), "without a step()");
  EXPECT_GRADSYNC_ERROR(optim::GradScaler({.init_scale = 1.0, .growth_factor = 0.5}), "growth_factor");
  EXPECT_GRADSYNC_ERROR(optim::GradScaler({.init_scale = -1.0}), "init_scale");
}

TEST(GradScaler, StateRoundTripsThroughCheckpointMetadata) {
  optim::GradScaler scaler({.init_scale = 1024.0, .growth_factor = 2.0, .backoff_factor = 0.25, .growth_interval = 7});
  scaler.update(3.0);
  optim::GradScaler restored;
  restored.load_state(scaler.state_metadata());
  EXPECT_EQ(restored.scale(), 3.0);
  EXPECT_EQ(restored.options().backoff_factor, 0.25);
  EXPECT_EQ(restored.options().growth_interval, 7);
  io::Metadata broken = scaler.state_metadata();
  broken["grad_scaler.scale"] = "lots";
  EXPECT_GRADSYNC_ERROR(restored.load_state(broken), "grad_scaler.scale", "not a number");
  EXPECT_EQ(restored.scale(), 3.0);  // unchanged by the failed load
}

TEST(GradScaler, WarnsOnceForBf16Gradients) {
  ParameterRegistry registry;
  Parameter& w = registry.add("w", {2}, DType::bf16);
  registry.finalize();
  optim::SGD sgd(registry, optim::SGD::Options{.lr = 0.1}, optim::MasterWeights::f32);
  std::vector<std::string> warnings;
  const auto previous = set_warning_handler([&](const std::string& text) { warnings.push_back(text); });
  optim::GradScaler scaler;
  for (int step = 0; step < 3; ++step) {
    w.set_grad(make({1.0, 2.0}, DType::bf16));
    scaler.step(sgd);
    scaler.update();
  }
  set_warning_handler(previous);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("'w' has bf16 gradients"), std::string::npos) << warnings[0];
}

// A skipped step leaves the parameters, master copies, state and step counts untouched, and
// its factors do not leak into the next step.
TEST(GradScaler, ASkippedStepChangesNothing) {
  ParameterRegistry registry;
  Parameter& w = registry.add("w", {3}, DType::f16);
  registry.finalize();
  w.value().copy_from(make({1.0, 2.0, 3.0}, DType::f16));
  optim::Adam adam(registry, optim::Adam::Options{.lr = 0.1}, optim::MasterWeights::f32);
  optim::GradScaler scaler;
  w.set_grad(make({1.0, INFINITY, 1.0}, DType::f16));
  EXPECT_FALSE(scaler.step(adam));
  EXPECT_TRUE(scaler.found_inf());
  EXPECT_EQ(adam.step_count(w), 0);
  EXPECT_FALSE(adam.state(w, "exp_avg").defined());
  EXPECT_EQ(w.value().to_double_vector(), (std::vector<double>{1.0, 2.0, 3.0}));
  EXPECT_EQ(adam.pending_gradient_unscale(), 1.0);
  scaler.update();
  EXPECT_EQ(scaler.scale(), 32768.0);
}

// ---------------------------------------------------------------------------------------------
// Layers with 16-bit parameters compute in f32

TEST(MixedPrecisionLayers, Bf16LinearComputesInF32WithF32MainGradients) {
  ParameterRegistry low, high;
  nn::Linear low_layer(low, "fc", 3, 2, DType::bf16, Device::cpu(), DType::f32);
  nn::Linear high_layer(high, "fc", 3, 2, DType::f32);
  low.finalize();
  high.finalize();
  low_layer.initialize(7);
  // The f32 layer holds exactly the bf16 values, widened.
  for (const char* name : {"fc.weight", "fc.bias"}) high.at(name).value().copy_from(low.at(name).value().to(DType::f32));
  const Tensor input = random_tensor(12, DType::f32, 3, 1.0).reshape({4, 3});
  EXPECT_EQ(low_layer.forward(input).to_double_vector(), high_layer.forward(input).to_double_vector());
  const Tensor grad = random_tensor(8, DType::f32, 4, 1.0).reshape({4, 2});
  EXPECT_EQ(low_layer.backward(grad).to_double_vector(), high_layer.backward(grad).to_double_vector());
  for (const char* name : {"fc.weight", "fc.bias"}) {
    EXPECT_EQ(low.at(name).grad().dtype(), DType::f32);
    EXPECT_EQ(low.at(name).grad().to_double_vector(), high.at(name).grad().to_double_vector()) << name;
  }
}
