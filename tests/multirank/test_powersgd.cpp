// PowerSGD (gradsync/dist/hooks/powersgd.h) against PyTorch's powerSGD_hook
// (tests/reference/generate_powersgd_fixtures.py, torch 2.x): Gloo ranks as threads feed the
// hook, step by step, the very bucket PyTorch's hook received, and compare what it returns (the
// reduced gradients), its P and Q memories and each rank's error feedback, for 20 steps across
// the switch at start_powerSGD_iter; ranks 1, 2 (Gram-Schmidt) and 4 (Householder QR), worlds
// 2 and 3, batched and cold (no warm start) variants. The generators that seed the random Q are
// checked on their own (numpy's randint, torch's randn). Then the state's checkpoint, and the
// errors.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>

#include "dist/hooks/torch_random.h"
#include "gradsync/comm/gloo/gloo.h"
#include "gradsync/dist/horovod/distributed_optimizer.h"
#include "gradsync/dist/hooks/powersgd.h"
#include "gradsync/io/safetensors.h"
#include "gradsync/registry/parameter_registry.h"
#include "optimizers.h"
#include "ranks_on_device.h"
#include "test_util.h"

namespace gradsync {
namespace {

using dist::PowerSGDOptions;
using dist::PowerSGDState;

const io::SafetensorsReader& fixture() {
  static const io::SafetensorsReader file(testing::fixture_path("powersgd.safetensors"));
  return file;
}

nlohmann::json meta(const std::string& key) { return nlohmann::json::parse(fixture().metadata().at(key)); }

// The largest difference relative to the largest magnitude of the expected tensor.
double relative_difference(const Tensor& got, const Tensor& expected) {
  const std::vector<double> a = got.to_double_vector(), b = expected.to_double_vector();
  EXPECT_EQ(a.size(), b.size());
  double largest = 1e-30, worst = 0;
  for (std::size_t i = 0; i < b.size(); ++i) largest = std::max(largest, std::abs(b[i]));
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst / largest;
}

TEST(PowerSGDRandom, NumpysDrawsSeedTorchsGeneratorAsPyTorchDoes) {
  // Seed 7, as the fixture's states: the draws every case made, in order (the cold case draws
  // at every PowerSGD step).
  for (const char* name : {"w2_r1", "w2_r1_cold"}) {
    dist::random::Mt19937 numpy(7);
    for (const auto& seed : meta(std::string(name) + ".seeds")) {
      EXPECT_EQ(dist::random::numpy_randint(numpy, 1'000'000'000), seed.get<std::int64_t>()) << name;
    }
  }
  const auto seed = static_cast<std::uint32_t>(std::stoul(fixture().metadata().at("randn.seed")));
  dist::random::TorchNormal normal(seed);
  std::vector<float> small(10), large(40);
  std::vector<double> wide(40);
  normal.fill(small.data(), small.size());  // pairs of doubles, one cached across calls
  normal.fill(large.data(), large.size());  // blocks of 16 floats, the tail redrawn
  normal.fill(wide.data(), wide.size());
  const auto near = [](const std::vector<double>& got, const Tensor& expected, const char* what) {
    const std::vector<double> want = expected.to_double_vector();
    ASSERT_EQ(got.size(), want.size()) << what;
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6 * (1 + std::abs(want[i]))) << what << " " << i;
  };
  near(std::vector<double>(small.begin(), small.end()), fixture().read("randn.small"), "randn(10)");
  near(std::vector<double>(large.begin(), large.end()), fixture().read("randn.large"), "randn(40)");
  near(wide, fixture().read("randn.double"), "randn(40, float64)");
}

// Each case on the host and on cuda:0 (the products through cuBLAS, the orthogonalizations in
// gradsync's kernels; the collectives staged through the host by Gloo). The CUDA instances
// skip, saying why, without a usable device.
class PowerSGDReference : public ::testing::TestWithParam<std::tuple<std::string, const char*>> {
 protected:
  void SetUp() override { GRADSYNC_SKIP_UNLESS_USABLE(device()); }
  const std::string& name() const { return std::get<0>(GetParam()); }
  Device device() const { return Device::parse(std::get<1>(GetParam())); }
};
INSTANTIATE_TEST_SUITE_P(Cases, PowerSGDReference,
                         ::testing::Combine(::testing::Values("w2_r1", "w3_r4", "w2_r2_batch", "w2_r1_cold"),
                                            ::testing::Values("cpu", "cuda")),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

// The bounds, relative to each tensor's largest magnitude: f32 products and norms summed in
// another order than torch's BLAS, through two orthogonalizations per step, and carried from
// step to step by the warm start, which amplifies them in the weakest directions: rank 4
// (Householder) grows from 1e-6 at the first compressed step to 2.7e-4 in P at the fifteenth;
// ranks 1 and 2 stay under 5e-5. The gradients and the error feedback stay under 1e-4.
double tolerance(const std::string& key) { return key == "p" || key == "q" ? 5e-4 : 1e-4; }
const bool kVerbose = std::getenv("POWERSGD_VERBOSE") != nullptr;

// The fixture case's options and its parameters, registered as DDP had them.
PowerSGDOptions options_of(const nlohmann::json& the_case) {
  return PowerSGDOptions{.matrix_approximation_rank = the_case["rank"],
                         .start_powerSGD_iter = the_case["start"],
                         .warm_start = the_case["warm"],
                         .random_seed = 7,
                         .batch_tensors_with_same_shape = the_case["batch"]};
}

void register_layout(ParameterRegistry& registry, const nlohmann::json& layout) {
  for (const auto& entry : layout[0]) registry.add(entry[0].get<std::string>(), entry[1].get<Shape>());
  registry.finalize();
}

// The bucket as DDP laid it out at `step` (it reorders its buckets after the first step).
dist::BucketInfo bucket_at(ParameterRegistry& registry, const nlohmann::json& layout, int step) {
  dist::BucketInfo info;
  for (const auto& entry : layout[static_cast<std::size_t>(step)]) {
    Parameter& member = registry.at(entry[0].get<std::string>());
    info.members.push_back(&member);
    info.member_offset.push_back(entry[2].get<std::int64_t>());
    info.numel = std::max(info.numel, entry[2].get<std::int64_t>() + member.numel());
  }
  return info;
}

Tensor input_of(const std::string& name, int rank, int step) {
  return fixture().read(name + ".rank" + std::to_string(rank) + ".step" + std::to_string(step) + ".input").clone();
}

TEST_P(PowerSGDReference, EveryStepMatchesPyTorch) {
  const std::string name = this->name();
  const Device device = this->device();
  const nlohmann::json the_case = meta(name + ".case");
  const nlohmann::json layout = meta(name + ".layout");
  const int world = the_case["world"];
  const int steps = std::stoi(fixture().metadata().at("steps"));
  std::vector<double> worst(static_cast<std::size_t>(world), 0.0);
  comm::run_gloo_thread_group(world, [&](comm::Communicator& comm) {
    const int rank = comm.rank();
    ParameterRegistry registry;
    register_layout(registry, layout);
    auto state = std::make_shared<PowerSGDState>(options_of(the_case));
    const dist::ReduceHook hook = dist::powersgd_hook(state);
    for (int step = 0; step < steps; ++step) {
      const std::string prefix = name + ".rank" + std::to_string(rank) + ".step" + std::to_string(step);
      const std::string where = prefix + " (iteration " + std::to_string(state->iteration()) + ")";
      Tensor flat = input_of(name, rank, step).to(device);
      hook(comm, flat, bucket_at(registry, layout, step))->wait();
      const auto check = [&](const Tensor& got, const std::string& key) {
        const double difference = relative_difference(got, fixture().read(prefix + "." + key));
        worst[static_cast<std::size_t>(rank)] = std::max(worst[static_cast<std::size_t>(rank)], difference);
        EXPECT_LT(difference, tolerance(key)) << key << " at " << where;
        if (kVerbose && rank == 0) std::printf("%s %s %.2e\n", where.c_str(), key.c_str(), difference);
      };
      check(flat, "output");
      const auto saved = state->state_dict();
      const bool compressed = step >= the_case["start"].get<int>();
      EXPECT_EQ(saved.count("p.0") == 1, compressed && the_case["warm"].get<bool>()) << where;
      if (saved.count("p.0") != 0) {
        check(saved.at("p.0"), "p");
        check(saved.at("q.0"), "q");
      }
      EXPECT_EQ(saved.count("error.0") == 1, compressed) << where;
      if (saved.count("error.0") != 0) check(saved.at("error.0"), "error");
    }
    EXPECT_EQ(state->iteration(), steps);
  });
  double largest = 0;
  for (const double w : worst) largest = std::max(largest, w);
  std::printf("%s on %s: worst difference relative to the largest magnitude %.2e\n", name.c_str(),
              device.str().c_str(), largest);
}

// The hook off the caller's thread (the default, overlap_backward) and on it: every output and
// every state entry the same bit for bit, at every step (the same operations in the same order,
// over a duplicate of the communicator).
TEST(PowerSGD, OffTheCallersThreadItComputesTheSame) {
  const std::string name = "w3_r4";
  const nlohmann::json the_case = meta(name + ".case");
  const nlohmann::json layout = meta(name + ".layout");
  const int steps = std::stoi(fixture().metadata().at("steps"));
  comm::run_gloo_thread_group(the_case["world"].get<int>(), [&](comm::Communicator& comm) {
    ParameterRegistry registry;
    register_layout(registry, layout);
    PowerSGDOptions inline_options = options_of(the_case);
    inline_options.overlap_backward = false;
    auto overlapped = std::make_shared<PowerSGDState>(options_of(the_case));
    auto on_caller = std::make_shared<PowerSGDState>(inline_options);
    const dist::ReduceHook overlapped_hook = dist::powersgd_hook(overlapped);
    const dist::ReduceHook caller_hook = dist::powersgd_hook(on_caller);
    for (int step = 0; step < steps; ++step) {
      Tensor a = input_of(name, comm.rank(), step), b = a.clone();
      const dist::BucketInfo info = bucket_at(registry, layout, step);
      const comm::WorkHandle work = overlapped_hook(comm, a, info);  // in flight while the other runs
      caller_hook(comm, b, info)->wait();
      work->wait();
      ASSERT_EQ(a.to_double_vector(), b.to_double_vector()) << "step " << step;
      const auto x = overlapped->state_dict(), y = on_caller->state_dict();
      ASSERT_EQ(x.size(), y.size());
      for (const auto& [key, tensor] : x) EXPECT_EQ(tensor.to_double_vector(), y.at(key).to_double_vector()) << key;
    }
  });
}

// A run stopped after step 12 (each rank's state saved to a safetensors file, loaded into a new
// state) continues as the uninterrupted one, bit for bit: error, P, Q, the iteration and the
// random generator are all in the state.
TEST(PowerSGD, AResumedStateContinuesBitForBit) {
  const std::string name = "w3_r4";
  const nlohmann::json the_case = meta(name + ".case");
  const nlohmann::json layout = meta(name + ".layout");
  const int steps = std::stoi(fixture().metadata().at("steps"));
  const testing::TempDir folder;
  comm::run_gloo_thread_group(the_case["world"].get<int>(), [&](comm::Communicator& comm) {
    ParameterRegistry registry;
    register_layout(registry, layout);
    const auto run = [&](PowerSGDState& state, int from, int to) {
      std::vector<Tensor> outputs;
      auto shared = std::shared_ptr<PowerSGDState>(&state, [](PowerSGDState*) {});
      const dist::ReduceHook hook = dist::powersgd_hook(shared);
      for (int step = from; step < to; ++step) {
        outputs.push_back(input_of(name, comm.rank(), step));
        hook(comm, outputs.back(), bucket_at(registry, layout, step))->wait();
      }
      return outputs;
    };
    PowerSGDState whole(options_of(the_case));
    const std::vector<Tensor> uninterrupted = run(whole, 0, steps);

    PowerSGDState first(options_of(the_case));
    run(first, 0, 12);
    const auto path = folder / ("powersgd.rank" + std::to_string(comm.rank()) + ".safetensors");
    std::vector<io::NamedTensor> saved;
    for (const auto& [key, tensor] : first.state_dict()) saved.push_back({key, tensor});
    io::save_safetensors(path, saved);
    PowerSGDState resumed(options_of(the_case));
    std::map<std::string, Tensor> loaded;
    for (io::NamedTensor& entry : io::SafetensorsReader(path).read_all()) loaded[entry.name] = entry.tensor;
    resumed.load_state_dict(loaded);
    EXPECT_EQ(resumed.iteration(), 12);
    const std::vector<Tensor> rest = run(resumed, 12, steps);
    for (std::size_t k = 0; k < rest.size(); ++k) {
      EXPECT_EQ(rest[k].to_double_vector(), uninterrupted[12 + k].to_double_vector()) << "step " << 12 + k;
    }
  });
}

// Through the DistributedOptimizer: every rank's gradient of w is a multiple of one rank-1
// matrix u v^T, so their average is rank 1 and PowerSGD at rank 1 reduces it exactly (up to
// rounding); the bias goes uncompressed. SGD with lr 1 makes the parameters minus the sum of the
// averaged gradients, which the test computes.
TEST(PowerSGD, TheDistributedOptimizerReducesThroughIt) {
  comm::run_gloo_thread_group(3, [](comm::Communicator& comm) {
    ParameterRegistry registry;
    Parameter& w = registry.add("w", {16, 12});
    Parameter& b = registry.add("b", {16});
    registry.finalize();
    std::unique_ptr<optim::Optimizer> sgd = testing::make_test_optimizer("sgd", registry, {{"lr", 1.0}});
    auto state = std::make_shared<PowerSGDState>(PowerSGDOptions{.start_powerSGD_iter = 2});
    dist::DistributedOptimizer optimizer(*sgd, comm, {.powersgd = state});
    const double mean_factor = (1.0 + 2.0 + 3.0) / 3.0;  // ranks scale by 1, 2, 3
    const std::vector<double> w0 = w.value().to_double_vector(), b0 = b.value().to_double_vector();
    std::vector<double> expected_w(16 * 12, 0.0), expected_b(16, 0.0);
    for (int step = 0; step < 5; ++step) {
      const double scale = comm.rank() + 1.0;
      std::vector<float> gw(16 * 12), gb(16);
      for (int i = 0; i < 16; ++i) {
        gb[static_cast<std::size_t>(i)] = static_cast<float>(scale * (i - 7) * 0.1);
        for (int j = 0; j < 12; ++j) {
          const double uv = std::sin(0.3 * i + step) * std::cos(0.7 * j - step);
          gw[static_cast<std::size_t>(i * 12 + j)] = static_cast<float>(scale * uv);
          expected_w[static_cast<std::size_t>(i * 12 + j)] -= mean_factor * uv;
        }
        expected_b[static_cast<std::size_t>(i)] -= mean_factor * (i - 7) * 0.1;
      }
      w.set_grad(Tensor::from_vector(gw, {16, 12}));
      b.set_grad(Tensor::from_vector(gb, {16}));
      registry.mark_ready(w);
      registry.mark_ready(b);
      optimizer.step();
      optimizer.zero_grad();
    }
    EXPECT_EQ(state->iteration(), 5);
    EXPECT_GT(state->numel_before_compression(), state->numel_after_compression());
    const std::vector<double> got_w = w.value().to_double_vector(), got_b = b.value().to_double_vector();
    for (std::size_t i = 0; i < got_w.size(); ++i) ASSERT_NEAR(got_w[i] - w0[i], expected_w[i], 1e-5) << i;
    for (std::size_t i = 0; i < got_b.size(); ++i) ASSERT_NEAR(got_b[i] - b0[i], expected_b[i], 1e-5) << i;
  });
  // Options it does not combine with, named.
  comm::run_gloo_thread_group(2, [](comm::Communicator& comm) {
    ParameterRegistry registry;
    registry.add("w", {4, 4});
    registry.finalize();
    std::unique_ptr<optim::Optimizer> sgd = testing::make_test_optimizer("sgd", registry, {{"lr", 1.0}});
    auto state = std::make_shared<PowerSGDState>(PowerSGDOptions{.start_powerSGD_iter = 2});
    EXPECT_GRADSYNC_ERROR(dist::DistributedOptimizer(*sgd, comm, {.op = dist::Op::sum, .powersgd = state}),
                          "only with op Average");
    EXPECT_GRADSYNC_ERROR(dist::DistributedOptimizer(*sgd, comm, {.compression = dist::Compression::fp16, .powersgd = state}),
                          "no compression");
  });
}

TEST(PowerSGD, MistakesAreNamed) {
  EXPECT_GRADSYNC_ERROR(PowerSGDState(PowerSGDOptions{.start_powerSGD_iter = 1}), "start_powerSGD_iter must be > 1");
  EXPECT_GRADSYNC_ERROR(PowerSGDState(PowerSGDOptions{.matrix_approximation_rank = 0}), "matrix_approximation_rank");
  PowerSGDState state(PowerSGDOptions{.start_powerSGD_iter = 2});
  EXPECT_GRADSYNC_ERROR(state.load_state_dict({}), "lacks 'iteration'");
  std::map<std::string, Tensor> bad = state.state_dict();
  bad["momentum.0"] = Tensor::zeros({4}, DType::f32);
  EXPECT_GRADSYNC_ERROR(state.load_state_dict(bad), "'momentum.0' is not error.<bucket>");
  bad = state.state_dict();
  bad["rng"] = Tensor::zeros({3}, DType::i64);
  EXPECT_GRADSYNC_ERROR(state.load_state_dict(bad), "625 entries");

  // A bf16 bucket is refused, naming it, on every rank (before any collective).
  comm::run_gloo_thread_group(2, [](comm::Communicator& comm) {
    ParameterRegistry registry;
    registry.add("encoder.weight", {8, 8}, DType::bf16);
    registry.finalize();
    dist::BucketInfo info;
    info.members.push_back(&registry[0]);
    info.member_offset.push_back(0);
    info.numel = 64;
    info.dtype = DType::bf16;
    Tensor flat = Tensor::zeros({64}, DType::bf16);
    const dist::ReduceHook hook = dist::powersgd_hook(std::make_shared<PowerSGDState>(PowerSGDOptions{}));
    EXPECT_GRADSYNC_ERROR(hook(comm, flat, info), "bucket 0 (encoder.weight) holds bf16");
  });
}

// A damaged state is refused at load, naming PowerSGD and the entry, and leaves the state as it
// was; none of them can reach the hook (a state without q.<bucket> used to be a SIGSEGV there).
// A Q that is whole but the wrong size for the bucket is found at the next step, named.
TEST(PowerSGD, EveryDamagedStateEntryIsRefused) {
  comm::run_gloo_thread_group(1, [](comm::Communicator& comm) {
    ParameterRegistry registry;
    registry.add("w", {16, 12});
    registry.finalize();
    dist::BucketInfo info;
    info.members.push_back(&registry[0]);
    info.member_offset.push_back(0);
    info.numel = 192;
    auto state = std::make_shared<PowerSGDState>(PowerSGDOptions{.matrix_approximation_rank = 2, .start_powerSGD_iter = 2});
    const dist::ReduceHook hook = dist::powersgd_hook(state);
    const auto step = [&] {
      Tensor flat = Tensor::zeros({192}, DType::f32);
      std::vector<float> values(192);
      for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i)));
      flat.copy_from(Tensor::from_vector(values, {192}));
      hook(comm, flat, info)->wait();
    };
    for (int k = 0; k < 3; ++k) step();
    const std::map<std::string, Tensor> good = state->state_dict();
    ASSERT_TRUE(good.count("q.0") && good.count("p.0") && good.count("error.0"));
    const auto with = [&](const std::string& key, const Tensor& tensor) {
      std::map<std::string, Tensor> changed = good;
      if (tensor.defined()) changed[key] = tensor; else changed.erase(key);
      return changed;
    };
    const auto poisoned = [&](const std::string& key, double value) {
      Tensor copy = good.at(key).clone();
      copy.data_as<float>()[1] = static_cast<float>(value);
      return copy;
    };
    const auto counters = [](std::int64_t step, std::int64_t held, std::int64_t sent) {
      Tensor t = Tensor::empty({3}, DType::i64);
      t.data_as<std::int64_t>()[0] = step;
      t.data_as<std::int64_t>()[1] = held;
      t.data_as<std::int64_t>()[2] = sent;
      return t;
    };
    const std::vector<std::pair<std::map<std::string, Tensor>, std::string>> cases = {
        {with("q.0", Tensor()), "'p.0' has no 'q.0'"},
        {with("p.0", Tensor()), "'q.0' has no 'p.0'"},
        {with("q.0", good.at("q.0").to(DType::f64)), "one state holds the gradients' one dtype"},
        {with("q.0", Tensor::zeros({7}, DType::f32)), "not a whole number of rank-2 factors"},
        {with("q.0", Tensor::zeros({0}, DType::f32)), "'q.0' is empty"},
        {with("q.0", poisoned("q.0", std::nan(""))), "'q.0' holds nan at element 1"},
        {with("error.0", poisoned("error.0", INFINITY)), "'error.0' holds inf at element 1"},
        {with("iteration", counters(-1, 0, 0)), "counter 0 (the step) is -1"},
        {with("iteration", counters(std::int64_t{1} << 60, 0, 0)), "outside 0 to 2^53"},
        {with("iteration", counters(3, 10, 20)), "20 elements were sent for 10 held"},
        {with("q.0", Tensor::zeros({4}, DType::i64)), "must be f32 or f64"},
        {with("extra", Tensor::zeros({4}, DType::f32)), "'extra' is not error.<bucket>"},
        {with("rng", Tensor()), "lacks 'rng'"},
    };
    for (const auto& [damaged, message] : cases) {
      SCOPED_TRACE(message);
      EXPECT_GRADSYNC_ERROR(state->load_state_dict(damaged), "PowerSGDState::load_state_dict", message);
      EXPECT_EQ(state->iteration(), 3);  // unchanged
    }
    // Error feedback in a state whose options have none.
    PowerSGDState plain(PowerSGDOptions{.matrix_approximation_rank = 2, .start_powerSGD_iter = 2, .use_error_feedback = false,
                                        .warm_start = false});
    EXPECT_GRADSYNC_ERROR(plain.load_state_dict(good), "'error.0' is error feedback, which this state's options turn off");
    // A Q of the wrong size for the bucket loads (its bucket is not known then) and the next step
    // refuses it, naming PowerSGD and the bucket.
    state->load_state_dict(with("q.0", Tensor::zeros({8}, DType::f32)));
    EXPECT_GRADSYNC_ERROR(step(), "PowerSGD: bucket 0 (w) needs");
    state->load_state_dict(good);
    step();
    EXPECT_EQ(state->iteration(), 4);
  });
}

}  // namespace
}  // namespace gradsync
