// ParameterRegistry: arena layout and alignment, defined/undefined gradients, readiness
// listeners, and every error path.
#include "gradsync/registry/parameter_registry.h"

#include "gradsync/kernels/ops.h"
#include "test_util.h"

namespace gradsync {
namespace {

TEST(Registry, ArenasGroupByDeviceAndDTypeWithAlignedOffsets) {
  ParameterRegistry registry;
  registry.add("embed", {10, 3});                      // f32, 30 elements
  registry.add("scale", {}, DType::f64);               // a scalar, f64
  registry.add("bias", {5});                           // f32
  registry.add("half_weight", {3, 3}, DType::f16);     // f16
  registry.add("last", {65});                          // f32
  registry.finalize();

  const auto& arenas = registry.arenas();
  ASSERT_EQ(arenas.size(), 3u) << "f32, f64, f16 in order of first appearance";
  EXPECT_EQ(arenas[0].dtype, DType::f32);
  EXPECT_EQ(arenas[1].dtype, DType::f64);
  EXPECT_EQ(arenas[2].dtype, DType::f16);
  EXPECT_EQ(arenas[0].parameters, (std::vector<std::size_t>{0, 2, 4}));

  // f32 offsets are multiples of 64 elements (256 bytes): 0, 64, 128; the arena ends at 128+65.
  EXPECT_EQ(registry.at("embed").arena_offset(), 0u);
  EXPECT_EQ(registry.at("bias").arena_offset(), 64u);
  EXPECT_EQ(registry.at("last").arena_offset(), 128u);
  EXPECT_EQ(arenas[0].values.numel(), 193);
  EXPECT_EQ(arenas[0].grads.numel(), 193);
  EXPECT_EQ(registry.total_numel(), 30 + 1 + 5 + 9 + 65);

  for (const Parameter& parameter : registry) {
    const Arena& arena = arenas[parameter.arena_index()];
    EXPECT_TRUE(parameter.value().shares_storage_with(arena.values)) << parameter.name();
    EXPECT_TRUE(parameter.grad().shares_storage_with(arena.grads)) << parameter.name();
    EXPECT_EQ(parameter.value().storage_offset(), parameter.arena_offset());
    EXPECT_EQ(parameter.grad().storage_offset(), parameter.arena_offset()) << "same layout for grads";
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(parameter.value().data()) % kArenaAlignmentBytes, 0u)
        << parameter.name() << " starts 256-byte aligned";
    EXPECT_EQ(parameter.value().shape(), parameter.shape());
    for (double value : parameter.value().to_double_vector()) EXPECT_EQ(value, 0.0);
  }
}

TEST(Registry, LookupAndIterationFollowRegistrationOrder) {
  ParameterRegistry registry;
  for (const char* name : {"c", "a", "b"}) registry.add(name, {2});
  registry.finalize();
  std::vector<std::string> names;
  for (const Parameter& parameter : registry) names.push_back(parameter.name());
  EXPECT_EQ(names, (std::vector<std::string>{"c", "a", "b"}));
  EXPECT_EQ(registry.at("a").index(), 1u);
  EXPECT_EQ(&registry[2], &registry.at("b"));
  EXPECT_EQ(registry.find("zzz"), nullptr);
  EXPECT_TRUE(registry.contains("c"));
  EXPECT_GRADSYNC_ERROR(registry.at("zzz"), "no parameter named 'zzz'");
  EXPECT_GRADSYNC_ERROR(registry[3], "index 3 out of range");
}

TEST(Registry, RegistrationErrorsNameTheParameter) {
  ParameterRegistry registry;
  registry.add("w", {2, 2});
  EXPECT_GRADSYNC_ERROR(registry.add("w", {3}), "duplicate parameter name 'w'");
  EXPECT_GRADSYNC_ERROR(registry.add("", {3}), "empty name");
  EXPECT_GRADSYNC_ERROR(registry.add("zero", {3, 0}), "'zero'", "[3, 0]", "positive");
  EXPECT_GRADSYNC_ERROR(registry.add("negative", {-2}), "'negative'");
  EXPECT_GRADSYNC_ERROR(registry.at("w").value(), "'w'", "not finalized");
  EXPECT_GRADSYNC_ERROR(registry.arenas(), "not finalized");
  registry.finalize();
  registry.finalize();  // idempotent
  EXPECT_GRADSYNC_ERROR(registry.add("late", {1}), "'late'", "already finalized");
  ParameterRegistry empty;
  EXPECT_GRADSYNC_ERROR(empty.finalize(), "empty parameter registry");
}

TEST(Registry, GradientsAreDefinedOrUndefined) {
  ParameterRegistry registry;
  Parameter& w = registry.add("w", {3});
  Parameter& b = registry.add("b", {2});
  registry.finalize();
  EXPECT_FALSE(w.grad_defined()) << "gradients start undefined, as PyTorch's None";

  w.set_grad(Tensor::from_vector(std::vector<float>{1, 2, 3}, {3}));
  EXPECT_TRUE(w.grad_defined());
  w.accumulate_grad(Tensor::from_vector(std::vector<float>{1, 1, 1}, {3}));
  EXPECT_EQ(w.grad().to_double_vector(), (std::vector<double>{2, 3, 4}));

  // Accumulating into an undefined gradient starts from zero, whatever the buffer held.
  w.zero_grad(/*set_to_undefined=*/true);
  EXPECT_FALSE(w.grad_defined());
  w.accumulate_grad(Tensor::from_vector(std::vector<float>{5, 5, 5}, {3}));
  EXPECT_EQ(w.grad().to_double_vector(), (std::vector<double>{5, 5, 5}));
  w.zero_grad(true);
  Tensor& buffer = w.grad_for_accumulate();
  EXPECT_EQ(buffer.to_double_vector(), (std::vector<double>{0, 0, 0}));
  ops::axpy(2.0, Tensor::from_vector(std::vector<float>{1, 2, 3}, {3}), buffer);
  EXPECT_EQ(w.grad().to_double_vector(), (std::vector<double>{2, 4, 6}));

  // grad_for_overwrite does not clear: the engine promises to write every element.
  Tensor& overwrite = b.grad_for_overwrite();
  EXPECT_TRUE(b.grad_defined());
  ops::fill(overwrite, 7.0);
  EXPECT_EQ(b.grad().to_double_vector(), (std::vector<double>{7, 7}));

  registry.zero_grad(/*set_to_undefined=*/false);
  EXPECT_TRUE(w.grad_defined());
  EXPECT_TRUE(b.grad_defined());
  EXPECT_EQ(b.grad().to_double_vector(), (std::vector<double>{0, 0}));
  registry.zero_grad();
  EXPECT_FALSE(w.grad_defined());
  EXPECT_FALSE(b.grad_defined());

  EXPECT_GRADSYNC_ERROR(w.set_grad(Tensor::zeros({4}, DType::f32)), "set_grad", "'w'", "f32[4]");
  EXPECT_GRADSYNC_ERROR(w.accumulate_grad(Tensor::zeros({3}, DType::f64)), "accumulate_grad", "'w'", "f64[3]");
}

TEST(Registry, FrozenParametersNeverGetGradients) {
  ParameterRegistry registry;
  Parameter& frozen = registry.add("frozen", {2}, DType::f32, Device::cpu(), /*requires_grad=*/false);
  registry.add("trained", {2});
  registry.finalize();
  EXPECT_FALSE(frozen.requires_grad());
  EXPECT_GRADSYNC_ERROR(frozen.set_grad(Tensor::zeros({2}, DType::f32)), "'frozen'", "frozen");
  EXPECT_GRADSYNC_ERROR(frozen.grad_for_overwrite(), "'frozen'", "frozen");
  EXPECT_GRADSYNC_ERROR(registry.mark_ready(frozen), "mark_ready", "'frozen'");
  registry.zero_grad(/*set_to_undefined=*/false);
  EXPECT_FALSE(frozen.grad_defined()) << "zero_grad(false) leaves frozen parameters undefined";
  EXPECT_TRUE(registry.at("trained").grad_defined());
}

TEST(Registry, ReadinessListenersHearEveryMarkInOrder) {
  ParameterRegistry registry;
  registry.add("layer0.w", {4});
  registry.add("layer1.w", {4});
  registry.finalize();

  std::vector<std::string> first;
  std::vector<std::string> second;
  auto subscription_a = registry.on_ready([&](Parameter& p) { first.push_back(p.name()); });
  auto subscription_b = registry.on_ready([&](Parameter& p) { second.push_back("b:" + p.name()); });

  // Backward runs last layer first; listeners hear the marks in that order.
  for (const char* name : {"layer1.w", "layer0.w"}) {
    registry.at(name).grad_for_overwrite();
    registry.mark_ready(name);
  }
  EXPECT_EQ(first, (std::vector<std::string>{"layer1.w", "layer0.w"}));
  EXPECT_EQ(second, (std::vector<std::string>{"b:layer1.w", "b:layer0.w"}));

  subscription_a.reset();
  registry.mark_ready("layer0.w");
  EXPECT_EQ(first.size(), 2u) << "an unsubscribed listener hears nothing";
  EXPECT_EQ(second.size(), 3u);

  {
    auto scoped = registry.on_ready([&](Parameter&) { first.push_back("scoped"); });
    registry.mark_ready("layer0.w");
  }
  registry.mark_ready("layer0.w");
  EXPECT_EQ(std::count(first.begin(), first.end(), "scoped"), 1) << "the handle's destructor unsubscribes";
}

TEST(Registry, ListenersMayUnsubscribeWhileBeingNotified) {
  ParameterRegistry registry;
  Parameter& p = registry.add("p", {1});
  registry.finalize();
  p.grad_for_overwrite();
  int calls_a = 0;
  int calls_b = 0;
  ParameterRegistry::Subscription a;
  a = registry.on_ready([&](Parameter&) {
    ++calls_a;
    a.reset();  // one-shot listener
  });
  auto b = registry.on_ready([&](Parameter&) { ++calls_b; });
  registry.mark_ready(p);
  registry.mark_ready(p);
  EXPECT_EQ(calls_a, 1);
  EXPECT_EQ(calls_b, 2) << "removing a listener mid-notification must not skip the next one";
}

TEST(Registry, MarkReadyErrors) {
  ParameterRegistry registry;
  Parameter& p = registry.add("p", {1});
  registry.finalize();
  EXPECT_GRADSYNC_ERROR(registry.mark_ready(p), "mark_ready", "'p'", "undefined");
  EXPECT_GRADSYNC_ERROR(registry.mark_ready("nope"), "'nope'");
  ParameterRegistry other;
  other.add("p", {1});
  other.finalize();
  other.at("p").grad_for_overwrite();
  EXPECT_GRADSYNC_ERROR(registry.mark_ready(other.at("p")), "belongs to another registry");
}

}  // namespace
}  // namespace gradsync
