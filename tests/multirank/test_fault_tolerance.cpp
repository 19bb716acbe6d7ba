// Fault tolerance across replica groups (dist/fault_tolerance.h, comm/coordinator.h) with the
// groups as threads of this process, each a world of one, and the coordinator in-process: the
// average over the live groups, a group leaving mid-step (every survivor discards that step), a
// replacement recovering bit for bit with the data position, a hung group left out and coming
// back, a coordinator restart between steps, a quorum short of min_replicas, and groups that
// disagree; never backwards (a recovery source that hangs as the recovery starts is waited for,
// every group lost ends naming the lost step, across a coordinator restart too), a newcomer that
// disagrees refused alone, a second copy of a group superseding the first; a hung group, or one
// silent rank of a group whose leader beats, costs the others a heartbeat; a claim beyond every
// step a quorum reached is never a recovery source. (Processes killed in
// each phase, under a launcher that restarts them: tests/examples/fault_tolerance.sh.)
#include <gtest/gtest.h>

#include <atomic>
#include <limits>
#include <filesystem>
#include <optional>
#include <thread>
#include <unistd.h>

#include "gradsync/comm/quorum/coordinator.h"
#include "gradsync/comm/gloo/gloo.h"
#include "comm/store/tcp_store.h"
#include "gradsync/dist/fault_tolerance/fault_tolerance.h"
#include "optimizers.h"
#include "test_util.h"

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
    EXPECT_NE(error.find("says 'samples_per_group=12 parameters=4 loss_scaler=off zero=0', group 0 says 'samples_per_group=10 parameters=4 loss_scaler=off zero=0'"),
              std::string::npos)
        << error;
  }
}

// Never backwards. Group 0 trains alone to step 5; group 1 arrives and is to recover from it, but
// group 0 hangs just then (its heartbeat beating): group 1's rendezvous and recovery fail and it
// votes so, and the coordinator leaves group 0 out after vote_timeout. A quorum of group 1 alone
// would be at step 0, below the high-water mark: none forms while group 0 lives. When group 0
// wakes, both meet at step 5, group 1 recovers, and both end alike.
TEST(FaultTolerance, ARecoverySourceThatHangsIsWaitedForNeverSteppingBack) {
  comm::CoordinatorOptions options = coordinator_options(2);
  options.join_timeout = Ms(300);
  options.vote_timeout = Ms(200);
  comm::Coordinator coordinator(options);
  std::atomic<bool> at_five{false};
  std::vector<std::vector<double>> finals(2);
  std::vector<std::int64_t> lowest_quorum_step(2, 1 << 30);
  run_groups(2, [&](int g) {
    dist::FaultToleranceOptions mine = options_for(coordinator.port(), g);
    mine.coordinator.cross_options.timeout = Ms(500);
    mine.coordinator.cross_options.rendezvous_timeout = Ms(500);
    if (g == 1) {
      while (!at_five) std::this_thread::sleep_for(Ms(5));
    }
    Group group(g == 0 ? 1.0f : -7.0f, mine);
    bool hung = false;
    while (!group.finished(2, 9)) {
      if (g == 0 && !hung && group.ft->quorum().members.size() == 2) {
        hung = true;
        std::this_thread::sleep_for(Ms(1500));  // the source hangs as the recovery starts
      }
      group.step(static_cast<float>(g + 1));
      if (group.ft->step() >= 5) at_five = true;
      if (g == 1) lowest_quorum_step[1] = std::min(lowest_quorum_step[1], group.ft->quorum().step);
    }
    finals[static_cast<std::size_t>(g)] = group.values();
  });
  EXPECT_GE(lowest_quorum_step[1], 5) << "group 1 was given a quorum below the high-water mark";
  EXPECT_EQ(finals[0], finals[1]);
  EXPECT_GE(coordinator.counters().high_water, 9);
  EXPECT_GE(coordinator.counters().recoveries, 2);  // the first recovery failed, the second landed
}

// A process claims step 999999 (a state no quorum made: a bug, a wrong file, a token holder):
// nobody vouches for it, so it is never named a source; it is told to recover from a group at
// the real step, the high-water mark stays where the quorums took it, and the honest groups end
// alike when it goes away.
TEST(FaultTolerance, AClaimNoQuorumReachedIsNeverASource) {
  comm::CoordinatorOptions options = coordinator_options(3);
  options.join_timeout = Ms(300);
  comm::Coordinator coordinator(options);
  std::atomic<bool> at_four{false};
  comm::Quorum told;
  std::vector<std::vector<double>> finals(2);
  run_groups(3, [&](int g) {
    if (g == 2) {
      while (!at_four) std::this_thread::sleep_for(Ms(5));
      comm::QuorumClientOptions liar;
      liar.port = coordinator.port();
      liar.token = "test-token";
      liar.group = 2;
      liar.agreement = "samples_per_group=10 parameters=4 loss_scaler=off zero=0";
      comm::QuorumClient client(liar, true);
      told = client.join(999999);
      client.leave("failed");
      return;
    }
    dist::FaultToleranceOptions mine = options_for(coordinator.port(), g);
    mine.coordinator.cross_options.rendezvous_timeout = Ms(500);  // the liar never comes to its recovery
    Group group(1.0f, mine);
    while (group.ft->step() < 10 || group.ran_with != 2 || !group.committed) {
      group.step(static_cast<float>(g + 1));
      if (group.ft->step() >= 4) at_four = true;
      std::this_thread::sleep_for(Ms(5));
    }
    finals[static_cast<std::size_t>(g)] = group.values();
  });
  EXPECT_GE(told.recover_from, 0) << told.describe();
  EXPECT_LT(told.step, 100) << told.describe();
  EXPECT_LT(coordinator.counters().high_water, 100);
  EXPECT_EQ(finals[0], finals[1]);
}

// Every group lost at step 4: fresh groups (at step 0) are not given a quorum; they end with an
// error naming the lost step, also from a coordinator started again over its state file. With
// accept_lost_steps (a restart from a checkpoint, on purpose) they go on from step 0.
TEST(FaultTolerance, EveryGroupLostEndsNamingTheLostStep) {
  const std::string state_file =
      (std::filesystem::temp_directory_path() / ("gradsync-coordinator-" + std::to_string(getpid()) + ".state")).string();
  std::filesystem::remove(state_file);
  comm::CoordinatorOptions options = coordinator_options(2);
  options.join_timeout = Ms(300);
  options.state_file = state_file;
  const auto fresh_groups_fail = [&](int port) {
    std::vector<std::string> errors(2);
    run_groups(2, [&](int g) {
      try {
        Group group(g, port, 0.0f);
        group.step(1.0f);
      } catch (const Error& error) {
        errors[static_cast<std::size_t>(g)] = error.what();
      }
    });
    for (const std::string& error : errors) {
      EXPECT_NE(error.find("step 4 is lost: it is the highest step this job's quorums reached"), std::string::npos)
          << error;
    }
  };
  {
    comm::Coordinator coordinator(options);
    run_groups(2, [&](int g) {
      Group group(g, coordinator.port(), 1.0f);
      while (group.ft->step() < 4) group.step(1.0f);
    });
    fresh_groups_fail(coordinator.port());
    EXPECT_EQ(coordinator.counters().high_water, 4);
  }
  {
    comm::Coordinator again(options);  // only the state file remembers step 4
    EXPECT_EQ(again.counters().high_water, 4);
    fresh_groups_fail(again.port());
  }
  {  // a state file that is not a regular file is refused, never read (a FIFO would block)
    comm::CoordinatorOptions folder = options;
    folder.state_file = state_file + ".folder";
    std::filesystem::create_directory(folder.state_file);
    EXPECT_GRADSYNC_ERROR(comm::Coordinator{folder}, "is not a regular file");
    std::filesystem::remove(folder.state_file);
  }
  options.accept_lost_steps = true;
  {
    comm::Coordinator from_checkpoint(options);
    run_groups(2, [&](int g) {
      Group group(g, from_checkpoint.port(), 0.0f);
      while (group.ft->step() < 2) group.step(1.0f);
    });
    EXPECT_EQ(from_checkpoint.counters().high_water, 2);
  }  // (its last save happens here)
  std::filesystem::remove(state_file);
}

// fp16's loss scaler across the groups: it runs after the commit, on the cross-group average. An
// overflow in one group (group 1's gradient is inf at its third step) makes that average inf in
// every group, so every group skips the step and halves its scale alike. Group 2 then leaves; its
// replacement starts with another scale, recovers the others' scaler with their state, and all
// three end with the same values and the same scale.
TEST(FaultTolerance, AnOverflowInOneGroupSkipsTheStepInEveryGroupAndTheScaleTravels) {
  comm::Coordinator coordinator(coordinator_options(3));
  std::atomic<int> survivors_as_two{0};
  std::vector<std::vector<double>> finals(3);
  std::vector<double> scales(3);
  std::vector<std::vector<bool>> stepped(3);  // each group's first four steps: stepped or skipped
  // One step of a group whose backward scales the loss: grad x scale, the cross-group average,
  // then (committed) the scaler's unscale, inf check, step and update.
  const auto scaled_step = [](Group& group, optim::GradScaler& scaler, float grad) {
    group.ran_with = group.ft->start_step().members.size();
    group.registry.at("w").set_grad(
        Tensor::from_vector(std::vector<float>(4, grad * static_cast<float>(scaler.scale())), {4}));
    group.ft->average_gradients();
    group.committed = group.ft->should_commit();
    bool took = false;
    if (group.committed) {
      took = scaler.step(*group.optimizer);
      scaler.update();
    }
    group.registry.zero_grad();
    return took;
  };
  const auto scaled_options = [&](int g, optim::GradScaler& scaler) {
    dist::FaultToleranceOptions options = options_for(coordinator.port(), g);
    options.grad_scaler = &scaler;
    return options;
  };
  run_groups(3, [&](int g) {
    const auto index = static_cast<std::size_t>(g);
    optim::GradScaler scaler(optim::GradScalerOptions{.init_scale = 1024, .growth_interval = 100});
    if (g == 2) {
      {
        Group first(1.0f, scaled_options(g, scaler));
        while (first.ft->step() < 4) {
          const bool took = scaled_step(first, scaler, 3.0f);
          if (first.committed) stepped[index].push_back(took);
        }
      }
      while (survivors_as_two < 2) std::this_thread::sleep_for(Ms(5));
      optim::GradScaler fresh(optim::GradScalerOptions{.init_scale = 65536, .growth_interval = 100});
      Group replacement(-7.0f, scaled_options(g, fresh));
      while (!replacement.finished(3, 10)) scaled_step(replacement, fresh, 3.0f);
      finals[index] = replacement.values();
      scales[index] = fresh.scale();
      return;
    }
    Group group(1.0f, scaled_options(g, scaler));
    bool as_two = false;
    while (!group.finished(3, 10)) {
      const bool overflow = g == 1 && group.ft->step() == 2;
      const bool took = scaled_step(group, scaler, overflow ? std::numeric_limits<float>::infinity() : g + 1.0f);
      if (group.committed && stepped[index].size() < 4) stepped[index].push_back(took);
      if (!as_two && group.committed && group.ran_with == 2) {
        as_two = true;
        ++survivors_as_two;
      }
      if (as_two && group.ran_with == 2) std::this_thread::sleep_for(Ms(20));
    }
    finals[index] = group.values();
    scales[index] = scaler.scale();
  });
  for (std::size_t g = 0; g < 3; ++g) {
    EXPECT_EQ(stepped[g], (std::vector<bool>{true, true, false, true})) << "group " << g << " (its first four steps)";
  }
  EXPECT_EQ(scales[0], 512.0);  // halved once, by the one overflow, and carried to the replacement
  EXPECT_EQ(scales[1], 512.0);
  EXPECT_EQ(scales[2], 512.0);
  EXPECT_EQ(finals[0], finals[1]);
  EXPECT_EQ(finals[0], finals[2]);
  EXPECT_GE(coordinator.counters().recoveries, 1);
}

// A stop asked by one group (its time budget spent, on its own clock) ends every group at the same
// step: the request rides on its vote, and the decision that commits that step says stop to all.
TEST(FaultTolerance, AStopAskedByOneGroupEndsEveryGroupAtTheSameStep) {
  comm::Coordinator coordinator(coordinator_options(3));
  std::vector<std::int64_t> stopped_at(3);
  run_groups(3, [&](int g) {
    Group group(g, coordinator.port(), 1.0f);
    while (!group.ft->stopping()) {
      if (g == 1 && group.ft->step() == 5) group.ft->request_stop();
      group.step(1.0f);
      ASSERT_LT(group.ft->step(), 50) << "group " << g << " never stopped";
    }
    stopped_at[static_cast<std::size_t>(g)] = group.ft->step();
  });
  EXPECT_EQ(stopped_at, (std::vector<std::int64_t>{6, 6, 6}));
}

// A newcomer started with another batch is refused alone: the two groups training go on without
// a discarded step, and the newcomer's error names both settings.
TEST(FaultTolerance, ANewcomerThatDisagreesIsRefusedAlone) {
  comm::CoordinatorOptions options = coordinator_options(3);
  options.join_timeout = Ms(300);
  comm::Coordinator coordinator(options);
  std::atomic<bool> at_three{false};
  std::atomic<bool> refused{false};
  std::string refusal;  // read once every thread has ended
  run_groups(3, [&](int g) {
    if (g == 2) {
      while (!at_three) std::this_thread::sleep_for(Ms(5));
      dist::FaultToleranceOptions other = options_for(coordinator.port(), 2);
      other.samples_per_group = 12;
      try {
        Group stranger(1.0f, other);
        stranger.step(1.0f);
      } catch (const Error& error) {
        refusal = error.what();
      }
      refused = true;
      return;
    }
    Group group(g, coordinator.port(), 1.0f);
    while (group.ft->step() < 8) {
      EXPECT_TRUE(group.step(1.0f)) << "group " << g << " lost a step to the newcomer";
      if (group.ft->step() >= 3) at_three = true;
      if (!refused) std::this_thread::sleep_for(Ms(10));
    }
  });
  EXPECT_NE(refusal.find("replica group 2 says 'samples_per_group=12 parameters=4 loss_scaler=off zero=0', the job's groups "
                         "0,1 say 'samples_per_group=10 parameters=4 loss_scaler=off zero=0' (the groups of one job must agree): "
                         "this group is refused, the others go on"),
            std::string::npos)
      << refusal;
  EXPECT_EQ(coordinator.counters().discards, 0);
  EXPECT_EQ(coordinator.counters().refused, 1);
}

// A second copy of group 1 starts while the first still trains (a process its launcher did not
// stop): the first is superseded and ends at its next request, naming both incarnations; the
// second recovers from group 0 and both end alike. The two copies never take turns.
TEST(FaultTolerance, ASecondCopyOfAGroupSupersedesTheFirst) {
  comm::Coordinator coordinator(coordinator_options(2));
  std::atomic<bool> at_three{false};
  std::atomic<bool> first_copy_ended{false};
  std::string ended_with;
  std::vector<std::vector<double>> finals(2);
  run_groups(3, [&](int g) {
    if (g == 2) {  // the second copy of group 1
      while (!at_three) std::this_thread::sleep_for(Ms(5));
      Group copy(1, coordinator.port(), -7.0f);
      while (!copy.finished(2, 10)) copy.step(2.0f);
      finals[1] = copy.values();
      return;
    }
    Group group(g, coordinator.port(), 1.0f);
    try {
      while (!group.finished(2, 10)) {
        group.step(static_cast<float>(g + 1));
        if (group.ft->step() >= 3) at_three = true;
        if (g == 1 && at_three) std::this_thread::sleep_for(Ms(20));
      }
    } catch (const Error& error) {
      ended_with = error.what();
      first_copy_ended = true;
      return;
    }
    if (g == 0) finals[0] = group.values();
  });
  EXPECT_TRUE(first_copy_ended);
  EXPECT_NE(ended_with.find("replica group 1: this process (incarnation "), std::string::npos) << ended_with;
  EXPECT_NE(ended_with.find("was superseded by a newer incarnation of the same group"), std::string::npos) << ended_with;
  EXPECT_EQ(finals[0], finals[1]);
  EXPECT_EQ(coordinator.counters().superseded, 1);
}

// A hung group costs a heartbeat, not the cross-group timeout. Group 2 stops inside a step and
// says nothing more (its heartbeat beats only once a minute here, so its requests were its proof
// of life, as for a SIGSTOPped or partitioned process). The others, waiting on it in the
// cross-group reduction, are told by the coordinator once group 2 has been silent for the
// heartbeat timeout, give the reduction up, discard the step and commit the next one as two,
// well before the 5 s cross-group timeout. When group 2 wakes, it comes back and recovers.
TEST(FaultTolerance, AHungGroupCostsAHeartbeatNotTheCrossTimeout) {
  comm::CoordinatorOptions options = coordinator_options(3);
  options.heartbeat_timeout = Ms(1000);
  options.join_timeout = Ms(300);
  comm::Coordinator coordinator(options);
  using Clock = std::chrono::steady_clock;
  std::atomic<std::int64_t> stopped_at{0};  // steady clock, ns
  std::vector<double> next_commit_after(2, 0.0);
  std::vector<std::vector<double>> finals(3);
  run_groups(3, [&](int g) {
    dist::FaultToleranceOptions mine = options_for(coordinator.port(), g);
    mine.coordinator.cross_options.timeout = Ms(5000);
    if (g == 2) mine.coordinator.heartbeat_every = Ms(60000);
    Group group(1.0f, mine);
    bool stopped = false;
    while (!group.finished(3, 10)) {
      if (g == 2 && !stopped && group.ft->step() == 3) {
        stopped = true;
        group.ft->start_step();
        stopped_at = Clock::now().time_since_epoch().count();
        std::this_thread::sleep_for(Ms(3500));  // stopped: no reduction, no vote, no heartbeat
        group.registry.at("w").set_grad(Tensor::from_vector(std::vector<float>(4, 3.0f), {4}));
        EXPECT_FALSE(group.ft->average_gradients());  // the others gave that quorum up
        EXPECT_FALSE(group.ft->should_commit());
        group.registry.zero_grad();
        continue;
      }
      const std::int64_t began = Clock::now().time_since_epoch().count();
      const bool committed = group.step(static_cast<float>(g + 1));
      const std::int64_t since = stopped_at;
      // The first commit of a step begun after group 2 stopped (one begun before may still land).
      if (g < 2 && committed && since != 0 && began > since && next_commit_after[static_cast<std::size_t>(g)] == 0.0) {
        next_commit_after[static_cast<std::size_t>(g)] = static_cast<double>(Clock::now().time_since_epoch().count() - since) * 1e-9;
      }
      if (group.ran_with == 2) std::this_thread::sleep_for(Ms(20));  // two, until group 2 is back
    }
    finals[static_cast<std::size_t>(g)] = group.values();
  });
  for (int g = 0; g < 2; ++g) {
    // The heartbeat timeout (1 s) and a step or two; the cross-group timeout would be 5 s.
    EXPECT_GT(next_commit_after[static_cast<std::size_t>(g)], 0.0) << "group " << g;
    EXPECT_LT(next_commit_after[static_cast<std::size_t>(g)], 2.5) << "group " << g;
    std::printf("group %d: the next commit %.3f s after group 2 stopped\n", g, next_commit_after[static_cast<std::size_t>(g)]);
  }
  EXPECT_EQ(finals[0], finals[1]);
  EXPECT_EQ(finals[0], finals[2]);
}

// Rank 1 of group 0 stops (its heartbeat with it) while group 0's leader beats on, waiting for it
// inside the group and never voting: the coordinator takes group 0 for lost within its heartbeat
// timeout, tells group 1 (which would otherwise wait on it across the groups until its timeout),
// and the next quorum goes on without it.
TEST(FaultTolerance, ASilentRankIsLostWhileItsLeaderBeats) {
  comm::CoordinatorOptions options = coordinator_options(2);
  options.heartbeat_timeout = Ms(500);
  options.join_timeout = Ms(300);
  comm::Coordinator coordinator(options);
  auto client_options = [&](int group) {
    comm::QuorumClientOptions mine;
    mine.port = coordinator.port();
    mine.token = "test-token";
    mine.group = group;
    mine.group_size = 2;
    mine.heartbeat_every = Ms(50);
    return mine;
  };
  auto leader0 = std::make_unique<comm::QuorumClient>(client_options(0), true);
  auto rank1 = std::make_unique<comm::QuorumClient>(client_options(0), false);
  rank1->keep_alive(leader0->incarnation(), 1);
  comm::QuorumClient leader1(client_options(1), true);
  comm::Quorum quorum0, quorum1;
  run_groups(2, [&](int g) { (g == 0 ? quorum0 : quorum1) = g == 0 ? leader0->join(0) : leader1.join(0); });
  ASSERT_EQ(quorum1.members, (std::vector<int>{0, 1})) << quorum1.describe();
  std::this_thread::sleep_for(Ms(800));  // beyond the timeout: every rank beats, nobody is lost
  EXPECT_EQ(leader1.lost_from(quorum1.id), "");
  using Clock = std::chrono::steady_clock;
  const auto stopped = Clock::now();
  rank1.reset();  // stopped: its heartbeat ends, its leader's goes on
  std::string lost;
  while (lost.empty() && Clock::now() - stopped < Ms(5000)) {
    std::this_thread::sleep_for(Ms(10));
    lost = leader1.lost_from(quorum1.id);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - stopped).count();
  EXPECT_EQ(lost, "0");
  EXPECT_GT(seconds, 0.4);
  EXPECT_LT(seconds, 1.5) << "the heartbeat timeout is 0.5 s";
  const comm::Quorum next = leader1.vote(quorum1, 0, false);
  EXPECT_FALSE(next.committed);
  EXPECT_EQ(next.members, (std::vector<int>{1})) << next.describe();
}

// A quorum's keys (its Gloo rendezvous) go when the next quorum forms: over many quorum changes
// (each round the keys a rendezvous leaves, a real one every 100th, then a vote that fails, so a
// new quorum) the store's size stays flat. GRADSYNC_TEST_QUORUM_CHANGES sets the rounds (100000
// by hand, for the note).
TEST(FaultTolerance, TheStoreStaysFlatOverQuorumChanges) {
  comm::Coordinator coordinator(coordinator_options(1));
  comm::QuorumClientOptions options = options_for(coordinator.port(), 0).coordinator;
  comm::QuorumClient client(options, /*leader=*/true);
  const char* rounds_text = std::getenv("GRADSYNC_TEST_QUORUM_CHANGES");
  const int rounds = rounds_text != nullptr ? std::atoi(rounds_text) : 1000;
  comm::Quorum quorum = client.join(0);
  comm::TcpStore rendezvous("127.0.0.1", coordinator.port(), false, Ms(5000), "test-token");
  std::int64_t most = 0;
  for (int round = 0; round < rounds; ++round) {
    if (round % 100 == 0) {
      client.connect(quorum.id, "reduce", 0, 0, 1);  // a real rendezvous now and then
    } else {  // else what a rendezvous of 3 ranks leaves, without its cost
      for (int rank = 0; rank < 3; ++rank) {
        rendezvous.set("ft/q" + std::to_string(quorum.id) + "/reduce/p0/" + std::to_string(rank), std::vector<char>(1000, 'a'));
      }
    }
    quorum = client.vote(quorum, 0, /*ok=*/false);
    most = std::max(most, coordinator.counters().store_bytes);
  }
  EXPECT_GE(coordinator.counters().quorum_changes, rounds);
  // One or two quorums' keys (3 kB each), the group's request, answer and heartbeat, whatever the
  // rounds; without the cleanup, 1000 rounds leave 3 MB.
  EXPECT_LE(most, 16 * 1024) << "the store grew over " << rounds << " quorum changes";
}

// A token holder fills the coordinator's store: the groups' requests (or the next quorum's
// rendezvous) no longer fit, and every group ends within a second with the error naming the bound
// (the store refusing its request, or the coordinator saying the store is full), never a loop of
// discarded quorums.
TEST(FaultTolerance, AFullStoreEndsEveryGroupNamingTheBound) {
  const testing::ScopedVariable limit("GRADSYNC_STORE_MAX_MB", "4");
  comm::Coordinator coordinator(coordinator_options(2));
  std::atomic<bool> at_three{false};
  std::atomic<bool> filled{false};
  std::vector<std::string> errors(2);
  std::vector<double> seconds(2);
  std::thread filler([&] {
    while (!at_three) std::this_thread::sleep_for(Ms(2));
    comm::TcpStore holder("127.0.0.1", coordinator.port(), false, Ms(5000), "test-token");
    // Mebibytes until one is refused, then kibibytes, then bytes: the store full to its last byte.
    for (const std::size_t size : {std::size_t{1} << 20, std::size_t{1} << 10, std::size_t{1}}) {
      try {
        for (int i = 0; i < 100000; ++i) holder.set("junk/" + std::to_string(size) + "/" + std::to_string(i), std::vector<char>(size, 'x'));
      } catch (const Error&) {  // refused: full
      }
    }
    filled = true;
  });
  run_groups(2, [&](int g) {
    Group group(g, coordinator.port(), 1.0f);
    std::optional<std::chrono::steady_clock::time_point> since;
    try {
      for (int step = 0; step < 3000; ++step) {
        group.step(1.0f);
        if (group.ft->step() >= 3) at_three = true;
        if (filled && !since) since = std::chrono::steady_clock::now();
      }
    } catch (const Error& error) {
      errors[static_cast<std::size_t>(g)] = error.what();
      if (since) seconds[static_cast<std::size_t>(g)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - *since).count();
    }
  });
  filler.join();
  for (int g = 0; g < 2; ++g) {
    EXPECT_NE(errors[static_cast<std::size_t>(g)].find("GRADSYNC_STORE_MAX_MB"), std::string::npos)
        << "group " << g << ": '" << errors[static_cast<std::size_t>(g)] << "'";
    EXPECT_LT(seconds[static_cast<std::size_t>(g)], 1.0);
  }
}

// A coordinator listening beyond loopback without a secret refuses to start, naming the variable:
// the token derived from its port is no secret. With GRADSYNC_STORE_TOKEN it serves.
TEST(FaultTolerance, BeyondLoopbackTheCoordinatorNeedsASecret) {
  if (std::getenv("GRADSYNC_STORE_TOKEN") != nullptr) GTEST_SKIP() << "GRADSYNC_STORE_TOKEN is set in this environment";
  comm::CoordinatorOptions options = coordinator_options(1);
  options.token.clear();
  options.bind_host = "";  // every interface
  EXPECT_GRADSYNC_ERROR(comm::Coordinator{options}, "has no secret token: set GRADSYNC_STORE_TOKEN");
  const testing::ScopedVariable secret("GRADSYNC_STORE_TOKEN", "a-shared-secret");
  comm::Coordinator coordinator(options);
  EXPECT_GT(coordinator.port(), 0);
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
