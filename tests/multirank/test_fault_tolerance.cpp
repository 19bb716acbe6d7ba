// Fault tolerance across replica groups (dist/fault_tolerance.h, comm/coordinator.h) with the
// groups as threads of this process, each a world of one, and the coordinator in-process: the
// average over the live groups, a group leaving mid-step (every survivor discards that step), a
// replacement recovering bit for bit with the data position, a hung group left out and coming
// back, a coordinator restart between steps, a quorum short of min_replicas, and groups that
// disagree. (Processes killed in each
// phase, under a launcher that restarts them: tests/examples/fault_tolerance.sh.)
#include <gtest/gtest.h>

#include <atomic>
#include <optional>
#include <thread>

#include "gradsync/comm/quorum/coordinator.h"
#include "gradsync/comm/gloo/gloo.h"
#include "gradsync/dist/fault_tolerance/fault_tolerance.h"
#include "optimizers.h"

namespace gradsync {
namespace {

using Ms = std::chrono::milliseconds;

comm::CoordinatorOptions coordinator_options(int groups, int min_replicas = 1) {
  comm::CoordinatorOptions options;
  options.replica_groups = groups;
  options.min_replicas = min_replicas;
  options.heartbeat_timeout = Ms(500);
  options.join_timeout = Ms(2000);
  options.quiet = true;
  options.token = "test-token";
  return options;
}

// A group's options against the coordinator on `port`.
dist::FaultToleranceOptions options_for(int port, int group) {
  dist::FaultToleranceOptions options;
  options.coordinator.port = port;
  options.coordinator.group = group;
  options.coordinator.token = "test-token";
  options.coordinator.answer_timeout = Ms(20000);
  options.coordinator.cross_options.timeout = Ms(5000);
  options.coordinator.cross_options.rendezvous_timeout = Ms(3000);
  options.samples_per_group = 10;
  return options;
}

// One replica group of one rank: its model (w, 4 elements, starting at `start`), SGD, and its
// side of the protocol.
struct Group {
  Group(int id, int port, float start) : Group(start, options_for(port, id)) {}
  Group(float start, const dist::FaultToleranceOptions& options) : comm(comm::gloo_tcp_store("127.0.0.1", 1, 0, 1)) {
    Parameter& w = registry.add("w", {4});
    registry.finalize();
    w.value().copy_from(Tensor::from_vector(std::vector<float>(4, start), {4}));
    optimizer = testing::make_test_optimizer("sgd", registry, {{"lr", 0.5}, {"momentum", 0.9}});
    ft.emplace(registry, optimizer.get(), *comm, options);
  }
  // One step with gradient `grad` everywhere; whether it committed.
  bool step(float grad) {
    ran_with = ft->start_step().members.size();
    registry.at("w").set_grad(Tensor::from_vector(std::vector<float>(4, grad), {4}));
    ft->average_gradients();
    committed = ft->should_commit();
    if (committed) optimizer->step();
    registry.zero_grad();
    return committed;
  }
  // Whether the last step committed in a quorum of every group, at `steps` steps or more: the
  // same step for every group (they all ran and committed it), whatever the timing before.
  bool finished(std::size_t groups, std::int64_t steps) const {
    return committed && ran_with == groups && ft->step() >= steps;
  }
  std::vector<double> values() { return registry.at("w").value().to_double_vector(); }

  std::unique_ptr<comm::Communicator> comm;
  ParameterRegistry registry;
  std::unique_ptr<optim::Optimizer> optimizer;
  std::optional<dist::FaultTolerance> ft;
  std::size_t ran_with = 0;  // the groups in the last step's quorum
  bool committed = false;    // the last step committed
};

// Runs body(group id) on one thread per group; rethrows the first failure.
void run_groups(int groups, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  std::mutex mutex;
  std::exception_ptr first;
  for (int g = 0; g < groups; ++g) {
    threads.emplace_back([&, g] {
      try {
        body(g);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  if (first) std::rethrow_exception(first);
}

TEST(FaultTolerance, ThreeGroupsAverageAndCommitTogether) {
  comm::Coordinator coordinator(coordinator_options(3));
  std::vector<std::vector<double>> finals(3);
  run_groups(3, [&](int g) {
    Group group(g, coordinator.port(), 1.0f);
    for (int step = 0; step < 4; ++step) {
      // Gradients 1, 2, 3: the average is 2 on every group.
      EXPECT_TRUE(group.step(static_cast<float>(g + 1))) << "group " << g << ", step " << step;
      EXPECT_EQ(group.ft->quorum().members, (std::vector<int>{0, 1, 2}));
    }
    EXPECT_EQ(group.ft->step(), 4);
    EXPECT_EQ(group.ft->position(), 4 * 30);  // 3 groups x 10 samples per committed step
    finals[static_cast<std::size_t>(g)] = group.values();
  });
  // SGD with momentum 0.9 on a constant gradient 2: 1 - 0.5 x 2 x (1 + 1.9 + 2.71 + 3.439).
  for (const auto& values : finals) {
    for (const double v : values) EXPECT_NEAR(v, 1.0 - 0.5 * 2 * (1 + 1.9 + 2.71 + 3.439), 1e-6);
  }
  EXPECT_EQ(coordinator.counters().commits, 4);
}

// Group 2 leaves in the middle of step 3 (its communicator closes while the others reduce): both
// survivors discard that step, go on as two, and a replacement of group 2, started with other
// values, recovers the survivors' state (values, momentum, step, position) and trains with them.
TEST(FaultTolerance, ADeathIsDiscardedByAllAndAReplacementRecovers) {
  comm::Coordinator coordinator(coordinator_options(3));
  std::atomic<int> survivors_as_two{0};
  std::vector<std::vector<double>> finals(3);
  std::vector<std::int64_t> positions(3);
  run_groups(3, [&](int g) {
    if (g == 2) {
      {
        Group doomed(g, coordinator.port(), 1.0f);
        for (int step = 0; step < 2; ++step) EXPECT_TRUE(doomed.step(3.0f));
        doomed.ft->start_step();  // then it is gone: its leader says so, its sockets close
      }
      while (survivors_as_two < 2) std::this_thread::sleep_for(Ms(5));
      Group replacement(g, coordinator.port(), -7.0f);
      while (!replacement.finished(3, 12)) replacement.step(3.0f);
      finals[2] = replacement.values();
      positions[2] = replacement.ft->position();
      const auto events = replacement.ft->take_events();
      EXPECT_TRUE(std::any_of(events.begin(), events.end(), [](const auto& e) { return e.kind == "recovered"; }));
      return;
    }
    Group group(g, coordinator.port(), 1.0f);
    int discarded = 0;
    bool as_two = false;
    // Until the replacement is back (however long it takes to start), the two train on, slowly.
    while (!group.finished(3, 12)) {
      if (!group.step(static_cast<float>(g + 1))) ++discarded;
      if (!as_two && group.committed && group.ran_with == 2 && group.ft->step() >= 5) {
        as_two = true;
        ++survivors_as_two;
      }
      if (as_two && group.ran_with == 2) std::this_thread::sleep_for(Ms(20));
    }
    EXPECT_GE(discarded, 1) << "group " << g;
    finals[static_cast<std::size_t>(g)] = group.values();
    positions[static_cast<std::size_t>(g)] = group.ft->position();
  });
  EXPECT_EQ(finals[0], finals[1]);
  EXPECT_EQ(finals[0], finals[2]);
  EXPECT_EQ(positions[0], positions[1]);
  EXPECT_EQ(positions[0], positions[2]);
  EXPECT_GE(coordinator.counters().recoveries, 1);
}

// Group 2 hangs inside a step (its heartbeat still beating): the others' reduction times out,
// they report it, and the coordinator leaves group 2 out vote_timeout later; the two go on. When
// group 2 wakes, its reduction fails at once (the others have left that quorum), it votes late,
// joins as a newcomer behind the others, recovers, and all three end alike.
TEST(FaultTolerance, AHungGroupIsLeftOutAndComesBack) {
  comm::CoordinatorOptions options = coordinator_options(3);
  options.vote_timeout = Ms(300);
  comm::Coordinator coordinator(options);
  std::vector<std::vector<double>> finals(3);
  std::vector<int> discarded(3, 0);
  std::atomic<bool> hung_done{false};
  run_groups(3, [&](int g) {
    dist::FaultToleranceOptions mine = options_for(coordinator.port(), g);
    mine.coordinator.cross_options.timeout = Ms(800);
    Group group(1.0f, mine);
    while (!group.finished(3, 10)) {
      if (g == 2 && group.ft->step() == 3 && !hung_done) {
        group.ft->start_step();
        std::this_thread::sleep_for(Ms(2000));  // hung: no vote, no reduction
        hung_done = true;
        group.registry.at("w").set_grad(Tensor::from_vector(std::vector<float>(4, 3.0f), {4}));
        EXPECT_FALSE(group.ft->average_gradients());  // the others left that quorum
        EXPECT_FALSE(group.ft->should_commit());
        group.registry.zero_grad();
        continue;
      }
      if (!group.step(static_cast<float>(g + 1))) ++discarded[static_cast<std::size_t>(g)];
      if (group.ran_with == 2) std::this_thread::sleep_for(Ms(20));  // two, until group 2 is back
    }
    finals[static_cast<std::size_t>(g)] = group.values();
  });
  EXPECT_GE(discarded[0], 1);
  EXPECT_EQ(finals[0], finals[1]);
  EXPECT_EQ(finals[0], finals[2]);
  EXPECT_GE(coordinator.counters().recoveries, 1);
}

TEST(FaultTolerance, TheCoordinatorRestartsBetweenSteps) {
  auto coordinator = std::make_unique<comm::Coordinator>(coordinator_options(2));
  const int port = coordinator.get()->port();
  std::atomic<int> at_three{0};
  std::atomic<bool> restarted{false};
  std::thread restarter([&] {
    while (at_three < 2) std::this_thread::sleep_for(Ms(2));
    coordinator.reset();
    std::this_thread::sleep_for(Ms(300));
    comm::CoordinatorOptions options = coordinator_options(2);
    options.port = port;
    coordinator = std::make_unique<comm::Coordinator>(options);
    restarted = true;
  });
  run_groups(2, [&](int g) {
    Group group(g, port, 1.0f);
    while (group.ft->step() < 6) {
      group.step(1.0f);
      if (group.ft->step() == 3 && !restarted) {
        ++at_three;
        while (!restarted) std::this_thread::sleep_for(Ms(2));
      }
    }
  });
  restarter.join();
  EXPECT_GE(coordinator->counters().commits, 3);
}

TEST(FaultTolerance, AQuorumShortOfMinReplicasNamesTheMissingGroups) {
  comm::CoordinatorOptions options = coordinator_options(3, 2);
  options.join_timeout = Ms(300);
  comm::Coordinator coordinator(options);
  try {
    Group lonely(0, coordinator.port(), 1.0f);
    lonely.step(1.0f);
    FAIL() << "a quorum of one formed with min_replicas 2";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("a quorum needs at least 2 of 3 replica groups"), std::string::npos) << message;
    EXPECT_NE(message.find("groups 1,2 did not"), std::string::npos) << message;
  }
}

// Two groups whose steps consume different numbers of samples would deal the data apart: the
// quorum is refused, and both groups end with the error naming both settings.
TEST(FaultTolerance, GroupsThatDisagreeAreRefused) {
  comm::Coordinator coordinator(coordinator_options(2));
  std::vector<std::string> errors(2);
  run_groups(2, [&](int g) {
    auto comm = comm::gloo_tcp_store("127.0.0.1", 1, 0, 1);
    ParameterRegistry registry;
    registry.add("w", {4});
    registry.finalize();
    dist::FaultToleranceOptions options = options_for(coordinator.port(), g);
    options.samples_per_group = g == 0 ? 10 : 12;
    dist::FaultTolerance ft(registry, nullptr, *comm, options);
    try {
      ft.start_step();
    } catch (const Error& error) {
      errors[static_cast<std::size_t>(g)] = error.what();
    }
  });
  for (const std::string& error : errors) {
    EXPECT_NE(error.find("says 'samples_per_group=12 parameters=4', group 0 says 'samples_per_group=10 parameters=4'"),
              std::string::npos)
        << error;
  }
}

TEST(FaultTolerance, MpiAcrossGroupsIsRefusedWithItsReason) {
  comm::Coordinator coordinator(coordinator_options(1));
  auto comm = comm::gloo_tcp_store("127.0.0.1", 1, 0, 1);
  ParameterRegistry registry;
  registry.add("w", {2});
  registry.finalize();
  dist::FaultToleranceOptions options = options_for(coordinator.port(), 0);
  options.cross_backend = "mpi";
  try {
    dist::FaultTolerance ft(registry, nullptr, *comm, options);
    FAIL() << "MPI across groups was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("MPI cannot go on without a dead rank"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace gradsync
