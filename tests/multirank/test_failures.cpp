// Correctness under any ready order and any failure, on Gloo ranks-as-threads:
//  * several Reducers and user collectives on one communicator, random per-rank ready orders;
//  * a failed launch, a failed wait, a failed synchronize, a failed end_backward: no crash, no
//    Work dropped while it can still write, and a defined state afterwards;
//  * an expired wait cancels its operation and breaks the communicator; a destroyed
//    communicator does not run what was queued;
//  * mismatched collectives end in our error on every rank; a rank that never arrives is named;
//  * ranks configured differently (optimizer, hyperparameters) refuse to train.
// docs/communication.md, "Failure semantics", says what each object is in afterwards.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <tuple>

#include <unistd.h>

#include "dist.h"
#include "expectations.h"
#include "gradsync/comm/gloo/gloo.h"
#include "gradsync/dist/horovod/distributed_optimizer.h"
#include "gradsync/dist/join/join.h"
#include "gradsync/dist/reducer/reducer.h"
#include "gradsync/dist/zero/zero.h"
#include "gradsync/optim/adam.h"
#include "gradsync/optim/sgd.h"
#include "join.h"
#include "models.h"
#include "optimizers.h"
#include "parameters.h"
#include "peer_death.h"
#include "ranks_on_device.h"
#include "test_util.h"
#include "zero.h"
#include "gradsync/kernels/ops.h"

namespace gradsync {
namespace {

using comm::Communicator;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

Tensor ones(std::int64_t numel) { return Tensor::from_vector(std::vector<float>(static_cast<std::size_t>(numel), 1.0f), {numel}); }

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Each rank's error message (empty: it did not throw), for "every rank raises" checks.
class PerRank {
 public:
  explicit PerRank(int size) : messages_(static_cast<std::size_t>(size)), threw_(static_cast<std::size_t>(size), false) {}
  template <typename Body>
  void run(int rank, Body&& body) {
    try {
      body();
    } catch (const std::exception& error) {
      std::lock_guard<std::mutex> lock(mutex_);
      messages_[static_cast<std::size_t>(rank)] = error.what();
      threw_[static_cast<std::size_t>(rank)] = true;
    }
  }
  void expect_every_rank_threw(const std::vector<std::string>& fragments) const {
    for (std::size_t rank = 0; rank < messages_.size(); ++rank) {
      EXPECT_TRUE(threw_[rank]) << "rank " << rank << " did not throw";
      for (const std::string& fragment : fragments) {
        EXPECT_NE(messages_[rank].find(fragment), std::string::npos)
            << "rank " << rank << ": \"" << messages_[rank] << "\" lacks \"" << fragment << "\"";
      }
    }
  }
  const std::string& message(int rank) const { return messages_[static_cast<std::size_t>(rank)]; }

 private:
  std::mutex mutex_;
  std::vector<std::string> messages_;
  std::vector<bool> threw_;
};

// ---- item 1: one communicator, many users, any order ----------------------------------------

class RandomReadyOrders : public ::testing::TestWithParam<std::tuple<int, int>> {};
INSTANTIATE_TEST_SUITE_P(Cases, RandomReadyOrders,
                         ::testing::Combine(::testing::Values(2, 3, 4), ::testing::Values(2, 3)), [](const auto& info) {
                           return testing::name(testing::ranks_name(std::get<0>(info.param)),
                                                std::to_string(std::get<1>(info.param)) + "_reducers");
                         });

TEST_P(RandomReadyOrders, AcrossReducersOnOneCommunicatorGiveExactSums) {
  const auto& [world, reducers] = GetParam();
  comm::run_gloo_thread_group(world, [&](Communicator& comm) {
    testing::random_ready_orders_across_reducers(comm, reducers, world == 4 ? 100 : 150);
  });
}

TEST(SharedCommunicator, TwoDistributedOptimizersReadyInOppositeOrders) {
  // A GAN: generator and discriminator, one optimizer each, on one communicator;
  // rank 0 finishes the generator's gradient first, rank 1 the discriminator's.
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    ParameterRegistry registry;
    Parameter& a = registry.add("generator.w", {8});
    Parameter& b = registry.add("discriminator.w", {8});
    registry.finalize();
    optim::SGD generator(registry, std::vector<optim::SGD::Group>{{{&a}, optim::SGD::Options{.lr = 1.0}}});
    optim::SGD discriminator(registry, std::vector<optim::SGD::Group>{{{&b}, optim::SGD::Options{.lr = 1.0}}});
    dist::DistributedOptimizer g(generator, comm, {.op = dist::Op::sum});
    dist::DistributedOptimizer d(discriminator, comm, {.op = dist::Op::sum});
    for (int step = 0; step < 50; ++step) {
      a.set_grad(Tensor::from_vector(std::vector<float>(8, 1.0f), {8}));
      b.set_grad(Tensor::from_vector(std::vector<float>(8, 100.0f), {8}));
      if (comm.rank() == 0) {
        registry.mark_ready(a);
        registry.mark_ready(b);
      } else {
        registry.mark_ready(b);
        registry.mark_ready(a);
      }
      g.synchronize();
      d.synchronize();
      ASSERT_EQ(a.grad().to_double_vector()[0], 2.0) << "step " << step;
      ASSERT_EQ(b.grad().to_double_vector()[0], 200.0) << "step " << step;
      g.zero_grad();
      d.zero_grad();
    }
  });
}

// ---- items 2-3: the Reducer after a failure ---------------------------------------------------

// A Work that fails when waited for.
class FailingWork final : public comm::Work {
 public:
  bool is_completed() const override { return true; }
  void wait(std::chrono::milliseconds) override { throw Error("the test's reduction failed"); }
  const std::string& description() const override { return name_; }

 private:
  std::string name_ = "failing work";
};

// A Work still "writing" for a while: wait() blocks until then and records that it was waited for.
class SlowWork final : public comm::Work {
 public:
  explicit SlowWork(std::atomic<bool>& waited) : waited_(waited), until_(Clock::now() + 300ms) {}
  bool is_completed() const override { return Clock::now() >= until_; }
  void wait(std::chrono::milliseconds) override {
    std::this_thread::sleep_until(until_);
    waited_ = true;
  }
  const std::string& description() const override { return name_; }

 private:
  std::atomic<bool>& waited_;
  Clock::time_point until_;
  std::string name_ = "slow work";
};

struct TwoBuckets {
  ParameterRegistry registry;
  Parameter* first;
  Parameter* second;
  TwoBuckets() {
    first = &registry.add("first", {4});
    second = &registry.add("second", {4});
    registry.finalize();
    first->set_grad(Tensor::zeros({4}, DType::f32));
    second->set_grad(Tensor::zeros({4}, DType::f32));
  }
  dist::ReducerOptions options(dist::ReduceHook hook) const {
    return {.bucket_limits = {16}, .hook = std::move(hook)};
  }
};

TEST(ReducerFailure, AThrowingLaunchBreaksTheReducerInsteadOfCrashingTheNextWait) {
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    TwoBuckets model;
    dist::Reducer reducer(model.registry, comm, {model.first, model.second}, {},
                          model.options([](Communicator& c, Tensor& flat, const dist::BucketInfo& info) -> comm::WorkHandle {
                            if (info.index == 1) throw Error("hook refuses bucket 1");
                            return c.allreduce_async(flat, comm::ReduceOp::sum);
                          }));
    reducer.ready(*model.first);  // bucket 0 launches
    EXPECT_GRADSYNC_ERROR(reducer.ready(*model.second), "hook refuses bucket 1");
    EXPECT_TRUE(reducer.broken());
    // Before the fix: wait() dereferenced bucket 1's missing Work (SIGSEGV).
    EXPECT_GRADSYNC_ERROR(reducer.wait(), "Reducer::wait", "broken by an earlier failure", "hook refuses bucket 1");
    EXPECT_GRADSYNC_ERROR(reducer.finish(), "broken by an earlier failure", "hook refuses bucket 1");
    EXPECT_GRADSYNC_ERROR(reducer.ready(*model.first), "broken by an earlier failure");
    // Every refusal names the failure, not a consequence of it ("during a round").
    EXPECT_GRADSYNC_ERROR(reducer.set_hook({}), "Reducer::set_hook", "broken by an earlier failure", "hook refuses bucket 1");
    EXPECT_GRADSYNC_ERROR(reducer.set_scales(1.0, 1.0), "Reducer::set_scales", "hook refuses bucket 1");
  });
  comm::run_gloo_thread_group(1, [](Communicator& comm) {
    TwoBuckets model;
    dist::Reducer reducer(model.registry, comm, {model.first, model.second}, {},
                          model.options([](Communicator&, Tensor&, const dist::BucketInfo&) { return comm::WorkHandle{}; }));
    EXPECT_GRADSYNC_ERROR(reducer.synchronize(), "returned no Work for bucket 0");
    EXPECT_GRADSYNC_ERROR(reducer.synchronize(), "broken by an earlier failure", "returned no Work");
  });
}

TEST(ReducerFailure, AFailedBucketWaitsForTheLaterBucketsStillInFlight) {
  comm::run_gloo_thread_group(1, [](Communicator& comm) {
    TwoBuckets model;
    std::atomic<bool> second_waited{false};
    dist::Reducer reducer(model.registry, comm, {model.first, model.second}, {},
                          model.options([&](Communicator&, Tensor&, const dist::BucketInfo& info) -> comm::WorkHandle {
                            if (info.index == 0) return std::make_shared<FailingWork>();
                            return std::make_shared<SlowWork>(second_waited);
                          }));
    reducer.ready(*model.first);
    reducer.ready(*model.second);
    EXPECT_GRADSYNC_ERROR(reducer.wait(), "the test's reduction failed");
    // Before the fix the second Work was dropped while it could still write the arena.
    EXPECT_TRUE(second_waited.load());
    EXPECT_GRADSYNC_ERROR(reducer.wait(), "broken by an earlier failure", "the test's reduction failed");
  });
}

// ---- item 4: the DistributedOptimizer after a failure ----------------------------------------

TEST(DistributedOptimizerFailure, AFailedSynchronizeLeavesNothingPending) {
  const auto folder = std::filesystem::temp_directory_path() / ("gradsync-failure-" + std::to_string(::getpid()));
  std::filesystem::create_directories(folder);
  comm::run_gloo_thread_group(
      2,
      [&](Communicator& comm) {
        ParameterRegistry registry;
        Parameter& w = registry.add("w", {4});
        registry.finalize();
        optim::SGD sgd(registry, optim::SGD::Options{.lr = 0.1});
        dist::DistributedOptimizer optimizer(sgd, comm);
        const auto state = folder / "state.safetensors";
        if (comm.rank() == 0) sgd.save_state(state);
        comm.barrier();
        if (comm.rank() == 1) return;  // leaves: its sockets close
        w.set_grad(ones(4));
        registry.mark_ready(w);
        const auto start = Clock::now();
        EXPECT_GRADSYNC_ERROR(optimizer.step(), "rank 1");  // the lost peer, by rank
        EXPECT_LT(seconds_since(start), 10.0);
        // Local calls work again: nothing is pending.
        optimizer.zero_grad();
        optimizer.load_state(state);
        // Distributed ones refuse, quoting the failure.
        w.set_grad(ones(4));
        EXPECT_GRADSYNC_ERROR(optimizer.synchronize(), "earlier failure ended distributed steps");
        EXPECT_GRADSYNC_ERROR(optimizer.step(), "earlier failure ended distributed steps");
      },
      {.timeout = 5000ms});
  std::filesystem::remove_all(folder);
}

TEST(DistributedOptimizerFailure, ChangingBackwardPassesMidWindowAppliesFromTheNextWindow) {
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    ParameterRegistry registry;
    Parameter& w = registry.add("w", {2});
    registry.finalize();
    optim::SGD sgd(registry, optim::SGD::Options{.lr = 1.0});
    dist::DistributedOptimizer optimizer(sgd, comm, {.backward_passes_per_step = 2, .op = dist::Op::sum});
    const auto pass = [&](float value) {
      const Tensor g = Tensor::from_vector(std::vector<float>{value, value}, {2});
      if (w.grad_defined()) {
        ops::axpy(1.0, g, w.grad_for_accumulate());
      } else {
        w.set_grad(g);
      }
      registry.mark_ready(w);
    };
    pass(1.0f);
    optimizer.set_backward_passes_per_step(1);  // mid-window: the second pass still belongs to this window
    EXPECT_EQ(optimizer.backward_passes_per_step(), 1);
    pass(2.0f);  // before the fix: "marked ready twice"
    optimizer.synchronize();
    EXPECT_EQ(w.grad().to_double_vector()[0], 6.0);  // (1 + 2) on each of 2 ranks
    optimizer.zero_grad();
    pass(5.0f);  // one pass is a window now
    optimizer.synchronize();
    EXPECT_EQ(w.grad().to_double_vector()[0], 10.0);
  });
}

// ---- item 5: DataParallel after a failure, and AUTO under exceptions -------------------------

TEST(DataParallelFailure, AFailedReductionWaitsForTheStatusAllreduceAndBreaks) {
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    ParameterRegistry registry;
    Parameter& w = registry.add("w", {4});
    registry.finalize();
    dist::DataParallel ddp(registry, comm);
    ddp.register_comm_hook([](Communicator&, Tensor&, const dist::BucketInfo&) -> comm::WorkHandle {
      return std::make_shared<FailingWork>();
    });
    ddp.begin_backward();
    w.set_grad(ones(4));
    registry.mark_ready(w);
    EXPECT_GRADSYNC_ERROR(ddp.end_backward(), "the test's reduction failed");
    ddp.begin_backward();
    EXPECT_GRADSYNC_ERROR(registry.mark_ready(w), "broken by an earlier failure", "the test's reduction failed");
    EXPECT_GRADSYNC_ERROR(ddp.end_backward(), "broken by an earlier failure", "the test's reduction failed");
    EXPECT_GRADSYNC_ERROR(ddp.synchronize_all(), "DataParallel::synchronize_all", "the test's reduction failed");
    EXPECT_GRADSYNC_ERROR(ddp.register_comm_hook([](Communicator&, Tensor&, const dist::BucketInfo&) { return comm::WorkHandle{}; }),
                          "DataParallel::register_comm_hook", "the test's reduction failed");
    EXPECT_GRADSYNC_ERROR(dist::Join({&ddp}), "Join::join", "the test's reduction failed");
  });
}

TEST(DataParallelFailure, AutoCountsAWindowThatARankLeftByAnException) {
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    ParameterRegistry registry;
    Parameter& w = registry.add("w", {4});
    registry.finalize();
    dist::DataParallel ddp(registry, comm);
    dist::DDPSyncStrategy last = dist::DDPSyncStrategy::auto_select;
    for (int window = 0; window < 10; ++window) {
      for (int micro = 0; micro < 2; ++micro) {
        try {
          dist::DDPSyncContext context(ddp, /*is_final_microbatch=*/micro == 1, dist::DDPSyncStrategy::auto_select);
          last = context.strategy();
          ddp.begin_backward();
          w.set_grad(ones(4));
          registry.mark_ready(w);
          ddp.end_backward();
          // Rank 0's own code fails after the window's synchronization (a logging error, say)
          // and the trainer catches it: the window still counts.
          if (comm.rank() == 0 && window == 2 && micro == 1) throw std::runtime_error("user code failed");
          context.close();
        } catch (const std::runtime_error& error) {
          EXPECT_STREQ(error.what(), "user code failed");
        }
      }
    }
    // Both ranks chose the same strategy at the same window (before the fix rank 0 decided one
    // window later: a mismatched collective).
    Tensor mine = Tensor::from_vector(std::vector<double>{static_cast<double>(last)}, {1});
    Tensor all = Tensor::zeros({2}, DType::f64);
    comm.allgather(mine, all);
    EXPECT_EQ(all.to_double_vector()[0], all.to_double_vector()[1]);
    EXPECT_NE(last, dist::DDPSyncStrategy::auto_select);
  });
}

// ---- a peer that dies in ZeRO's reduce-scatters and gathers, or in a Join's shadow steps ------
// (the same loops run with processes that really die in tests/multirank/peer_death.cpp)

// A rank that dies (its thread unwinds: its DataParallel, ZeroOptimizer and communicators go,
// closing their connections) in the backward of stage 2 (the others in its reduce-scatters) or
// before the step (the others in its gathers): every other rank fails with an error naming a
// lost peer, well before the timeout, instead of waiting on a collective that never completes.
TEST(PeerDeath, DuringZeroReduceScattersAndGathersIsAnErrorOnEveryOtherRankNotAHang) {
  for (const auto& [stage, in_backward] :
       {std::pair{1, false}, std::pair{2, true}, std::pair{2, false}, std::pair{3, true}, std::pair{3, false}}) {
    const std::string where = "stage " + std::to_string(stage) + (in_backward ? ", in the backward" : ", in the step");
    PerRank survivors(3);
    const auto start = Clock::now();
    try {
      comm::run_gloo_thread_group(
          3,
          [&](Communicator& comm) {
            survivors.run(comm.rank(), [&] {
              testing::zero_training_with_a_death(comm, stage, in_backward, 2,
                                                  [] { throw std::runtime_error("rank 2 died"); });
            });
            if (comm.rank() == 2) throw std::runtime_error(survivors.message(2));
          },
          {.timeout = 20000ms});
      ADD_FAILURE() << where << ": the dying rank's exception did not surface";
    } catch (const std::runtime_error& error) {
      EXPECT_STREQ(error.what(), "rank 2 died") << where;
    }
    EXPECT_LT(seconds_since(start), 15.0) << where << ": the survivors waited for the timeout";
    for (const int rank : {0, 1}) {
      EXPECT_FALSE(survivors.message(rank).empty()) << where << ": rank " << rank << " did not fail";
      EXPECT_NE(survivors.message(rank).find("rank "), std::string::npos) << survivors.message(rank);
    }
  }
}

// Stage 3's gathers name their unit: a survivor's error says which gather it was in.
TEST(PeerDeath, DuringAStageThreeGatherTheErrorNamesTheUnit) {
  PerRank survivors(3);
  try {
    comm::run_gloo_thread_group(
        3,
        [&](Communicator& comm) {
          survivors.run(comm.rank(), [&] {
            testing::zero_training_with_a_death(comm, 3, false, 2, [] { throw std::runtime_error("rank 2 died"); });
          });
          if (comm.rank() == 2) throw std::runtime_error(survivors.message(2));
        },
        {.timeout = 20000ms});
  } catch (const std::runtime_error& error) {
    EXPECT_STREQ(error.what(), "rank 2 died");
  }
  for (const int rank : {0, 1}) {
    EXPECT_NE(survivors.message(rank).find("ZeRO-3 gather of unit 0"), std::string::npos) << survivors.message(rank);
  }
}

// Rank 0 runs out of batches and shadows the others' steps inside a Join; rank 2 then dies.
// The shadowing rank and the other active rank fail naming the lost peer; nobody hangs.
TEST(PeerDeath, WhileARankShadowsInsideAJoinIsAnErrorNotAHang) {
  PerRank survivors(3);
  const auto start = Clock::now();
  try {
    comm::run_gloo_thread_group(
        3,
        [&](Communicator& comm) {
          survivors.run(comm.rank(), [&] {
            testing::join_training_with_a_death(comm, 2, [] { throw std::runtime_error("rank 2 died"); });
          });
          if (comm.rank() == 2) throw std::runtime_error(survivors.message(2));
        },
        {.timeout = 20000ms});
    ADD_FAILURE() << "the dying rank's exception did not surface";
  } catch (const std::runtime_error& error) {
    EXPECT_STREQ(error.what(), "rank 2 died");
  }
  EXPECT_LT(seconds_since(start), 15.0) << "the survivors waited for the timeout";
  for (const int rank : {0, 1}) {
    EXPECT_FALSE(survivors.message(rank).empty()) << "rank " << rank << " did not fail";
  }
  EXPECT_NE(survivors.message(0).find("joined"), std::string::npos) << survivors.message(0);
}

// ---- item 7: expired waits, destroyed communicators -------------------------------------------

TEST(CommunicatorFailure, AnExpiredWaitCancelsBreaksAndLeavesTheBufferAlone) {
  std::atomic<int> phase{0};
  comm::run_gloo_thread_group(
      2,
      [&](Communicator& comm) {
        Tensor t = Tensor::from_vector(std::vector<float>{1.0f + static_cast<float>(comm.rank())}, {1});
        Tensor u = ones(1);
        if (comm.rank() == 0) {
          comm::WorkHandle running = comm.recv_async(t, 1);  // rank 1 sends nothing yet
          comm::WorkHandle queued = comm.allreduce_async(u, comm::ReduceOp::sum);
          const auto start = Clock::now();
          EXPECT_GRADSYNC_ERROR(queued->wait(300ms), "did not complete within 300 ms");
          EXPECT_LT(seconds_since(start), 3.0);  // the backend timeout is 30 s
          // The receive ahead of it was aborted: it ends at once, not at the 30 s timeout.
          EXPECT_GRADSYNC_ERROR(running->wait(), "recv p2p#0", "aborted");
          EXPECT_LT(seconds_since(start), 3.0);
          EXPECT_FALSE(comm.broken_reason().empty());
          EXPECT_GRADSYNC_ERROR(comm.allreduce(u, comm::ReduceOp::sum), "broken by an earlier failure",
                                "did not complete within 300 ms");
          phase = 1;
          while (phase != 2) std::this_thread::sleep_for(1ms);
          std::this_thread::sleep_for(100ms);
          EXPECT_EQ(t.to_double_vector()[0], 1.0);  // the late message did not land
        } else {
          while (phase != 1) std::this_thread::sleep_for(1ms);
          try {  // too late: rank 0 gave up
            comm.send_async(t, 0)->wait(200ms);
          } catch (const Error&) {
          }
          phase = 2;
        }
      },
      {.timeout = 30000ms});
}

TEST(CommunicatorFailure, ARunningGlooCollectiveIsWaitedForUntilItsTimeout) {
  // Gloo's own algorithms cannot be interrupted: the expired wait returns once the backend has
  // given up (its timeout), never while the operation can still write the buffer.
  comm::run_gloo_thread_group(
      2,
      [&](Communicator& comm) {
        Tensor t = ones(1);
        if (comm.rank() == 1) {
          std::this_thread::sleep_for(2500ms);
          return;
        }
        comm::WorkHandle work = comm.allreduce_async(t, comm::ReduceOp::sum);
        const auto start = Clock::now();
        EXPECT_GRADSYNC_ERROR(work->wait(200ms), "did not complete within 200 ms");
        EXPECT_TRUE(work->is_completed());
        EXPECT_LT(seconds_since(start), 5.0);
        EXPECT_EQ(t.to_double_vector()[0], 1.0);
      },
      {.timeout = 1500ms});
}

TEST(CommunicatorFailure, TheWaitDeadlineCountsFromIssue) {
  comm::run_gloo_thread_group(
      2,
      [&](Communicator& comm) {
        Tensor t = ones(1);
        if (comm.rank() == 1) {
          std::this_thread::sleep_for(3000ms);
          return;
        }
        // Issued 1.5 s before a wait of 1 s: that wait is over before it begins. Counted from the
        // call it would take a second; the cancellation itself takes milliseconds, so the margin
        // holds on a loaded machine under a sanitizer.
        comm::WorkHandle work = comm.recv_async(t, 1);
        std::this_thread::sleep_for(1500ms);
        const auto start = Clock::now();
        EXPECT_GRADSYNC_ERROR(work->wait(1000ms), "of being issued");
        EXPECT_LT(seconds_since(start), 0.9);
      },
      {.timeout = 30000ms});
}

TEST(CommunicatorFailure, DestroyingACommunicatorRunsNothingQueued) {
  comm::run_gloo_thread_group(
      2,
      [&](Communicator& comm) {
        std::unique_ptr<Communicator> own = comm.duplicate();
        std::vector<comm::WorkHandle> works;
        std::vector<Tensor> buffers;
        if (comm.rank() == 0) {
          for (int i = 0; i < 3; ++i) buffers.push_back(ones(1));
          works.push_back(own->recv_async(buffers[0], 1));  // running: interrupted
          works.push_back(own->allreduce_async(buffers[1], comm::ReduceOp::sum));  // queued: never run
          works.push_back(own->allreduce_async(buffers[2], comm::ReduceOp::sum));
        }
        comm.barrier();
        const auto start = Clock::now();
        own.reset();
        EXPECT_LT(seconds_since(start), 2.0);  // the timeout is 60 s
        if (comm.rank() == 0) {
          EXPECT_GRADSYNC_ERROR(works[0]->wait(), "recv p2p#0");
          EXPECT_GRADSYNC_ERROR(works[1]->wait(), "allreduce #0", "destroyed");
          EXPECT_GRADSYNC_ERROR(works[2]->wait(), "allreduce #1", "destroyed");
        }
      },
      {.timeout = 60000ms});
}

// ---- item 8: a rank that never arrives ---------------------------------------------------------

TEST(Rendezvous, NamesTheRanksItWaitsForAndHasItsOwnTimeout) {
  ::setenv("GRADSYNC_RENDEZVOUS_REPORT_MS", "200", 1);
  const int port = 20000 + static_cast<int>(::getpid() % 20000);
  ::testing::internal::CaptureStderr();
  const auto start = Clock::now();
  EXPECT_GRADSYNC_ERROR(comm::gloo_tcp_store("127.0.0.1", port, 0, 3, {.timeout = 60000ms, .rendezvous_timeout = 1200ms}),
                        "rank(s) 1, 2", "the TCP store at 127.0.0.1:" + std::to_string(port), "after 1200 ms");
  const std::string reports = ::testing::internal::GetCapturedStderr();
  ::unsetenv("GRADSYNC_RENDEZVOUS_REPORT_MS");
  EXPECT_LT(seconds_since(start), 10.0);
  EXPECT_NE(reports.find("rank 0 waiting"), std::string::npos) << reports;
  EXPECT_NE(reports.find("rank(s) 1, 2"), std::string::npos) << reports;
}

// ---- item 11: mismatched collectives ------------------------------------------------------------

class MismatchWorld : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Sizes, MismatchWorld, ::testing::Values(2, 3),
                         [](const auto& info) { return testing::ranks_name(info.param); });

TEST_P(MismatchWorld, DifferentSizesAreOurErrorOnEveryRank) {
  PerRank outcome(GetParam());
  comm::run_gloo_thread_group(GetParam(), [&](Communicator& comm) {
    outcome.run(comm.rank(), [&] {
      Tensor t = ones(comm.rank() == 0 ? 100 : 50);
      comm.allreduce(t, comm::ReduceOp::sum);
    });
  });
  outcome.expect_every_rank_threw({"collective mismatch", "allreduce #0"});
  EXPECT_NE(outcome.message(0).find("f32 x 50"), std::string::npos) << outcome.message(0);
}

TEST(Mismatch, CompressionOnOneRankOnlyIsOurErrorOnEveryRank) {
  PerRank outcome(2);
  comm::run_gloo_thread_group(2, [&](Communicator& comm) {
    ParameterRegistry registry;
    Parameter& w = registry.add("w", {64});
    registry.finalize();
    dist::DataParallel ddp(registry, comm,
                           {.compression = comm.rank() == 0 ? dist::Compression::fp16 : dist::Compression::none});
    outcome.run(comm.rank(), [&] {
      ddp.begin_backward();
      w.set_grad(ones(64));
      registry.mark_ready(w);
      ddp.end_backward();
    });
  });
  outcome.expect_every_rank_threw({"collective mismatch", "f16 x 64", "f32 x 64"});
}

TEST(Mismatch, DifferentStepCountsNameTheRankThatLeft) {
  PerRank outcome(2);
  comm::run_gloo_thread_group(
      2,
      [&](Communicator& comm) {
        ParameterRegistry registry;
        Parameter& w = registry.add("w", {8});
        registry.finalize();
        optim::SGD sgd(registry, optim::SGD::Options{.lr = 0.1});
        dist::DistributedOptimizer optimizer(sgd, comm);
        outcome.run(comm.rank(), [&] {
          for (int step = 0; step < (comm.rank() == 0 ? 3 : 2); ++step) {
            w.set_grad(ones(8));
            registry.mark_ready(w);
            optimizer.step();
            optimizer.zero_grad();
          }
        });
      },
      {.timeout = 20000ms});
  EXPECT_NE(outcome.message(0).find("rank 1"), std::string::npos) << outcome.message(0);
  EXPECT_EQ(outcome.message(1), "");
}

// ---- item 12: ranks configured differently ------------------------------------------------------

TEST(Configuration, DifferentOptimizersOrHyperparametersAreAnErrorOnEveryRank) {
  PerRank kinds(2);
  comm::run_gloo_thread_group(2, [&](Communicator& comm) {
    ParameterRegistry registry;
    registry.add("w", {4});
    registry.finalize();
    optim::SGD sgd(registry, optim::SGD::Options{.lr = 0.1});
    optim::Adam adam(registry, optim::Adam::Options{.lr = 0.1});
    optim::Optimizer& mine = comm.rank() == 0 ? static_cast<optim::Optimizer&>(sgd) : adam;
    kinds.run(comm.rank(), [&] { dist::DistributedOptimizer optimizer(mine, comm); });
  });
  kinds.expect_every_rank_threw({"optimizer configuration", "optimizer SGD", "optimizer Adam"});

  PerRank rates(2);
  comm::run_gloo_thread_group(2, [&](Communicator& comm) {
    ParameterRegistry registry;
    registry.add("w", {4});
    registry.finalize();
    optim::SGD sgd(registry, optim::SGD::Options{.lr = comm.rank() == 0 ? 0.1 : 0.2});
    rates.run(comm.rank(), [&] { dist::require_same_optimizer(sgd, comm); });
  });
  rates.expect_every_rank_threw({"group 0", "lr=0.1", "lr=0.2"});
}

TEST(Configuration, TimeoutVariablesAcceptOnlyPlainPositiveIntegers) {
  const char* before = std::getenv("GRADSYNC_TIMEOUT_MS");
  const std::string saved = before != nullptr ? before : "";
  for (const char* bad : {"5s", "", "-1", "0", "1e3", " 5", "99999999999999999"}) {
    ::setenv("GRADSYNC_TIMEOUT_MS", bad, 1);
    EXPECT_GRADSYNC_ERROR(comm::resolve_timeout(0ms), "GRADSYNC_TIMEOUT_MS", std::string("'") + bad + "'");
  }
  ::setenv("GRADSYNC_TIMEOUT_MS", "5000", 1);
  EXPECT_EQ(comm::resolve_timeout(0ms), 5000ms);
  ::unsetenv("GRADSYNC_TIMEOUT_MS");
  EXPECT_EQ(comm::resolve_timeout(0ms), 300000ms);
  if (before != nullptr) ::setenv("GRADSYNC_TIMEOUT_MS", saved.c_str(), 1);
}

}  // namespace
}  // namespace gradsync
