// Reproducible reductions on Gloo ranks-as-threads (tests/scenarios/reproducible.h; MPI runs
// the same scenario in test_mpi.cpp): every world from 2 to 5 ranks, both algorithms, sizes
// from empty to chunks of unequal length, every floating dtype; DataParallel's parameters the
// same bits whatever its buckets; ranks that disagree about the mode get an error, not garbage.
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "expectations.h"
#include "gradsync/comm/gloo/gloo.h"
#include "reproducible.h"
#include "test_util.h"

namespace gradsync {
namespace {

using comm::Communicator;
using namespace std::chrono_literals;

class Reproducible : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

INSTANTIATE_TEST_SUITE_P(WorldsAndAlgorithms, Reproducible,
                         ::testing::Combine(::testing::Values(2, 3, 4, 5), ::testing::Values("owner", "chain")),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "_ranks_" + std::get<1>(info.param);
                         });

// Each reduction is bitwise the ascending-rank fold.
TEST_P(Reproducible, EveryReductionIsTheAscendingFold) {
  const auto& [world, algorithm] = GetParam();
  const testing::ScopedVariable variable("GRADSYNC_REPRODUCIBLE_ALGORITHM", algorithm);
  comm::run_gloo_thread_group(
      world, [](Communicator& comm) { testing::reproducible_reductions(comm, {0, 1, 7, 1000, 100003}); },
      {.reproducible = true});
}

// The same inputs through Gloo's own ring do not give the fold: the inputs can tell one order
// of additions from another, so the test above is not passing by luck (two ranks add the same
// two numbers in any order, so from three).
TEST(Reproducible, TheOrdinaryRingGivesOtherBits) {
  for (const int world : {3, 4}) {
    std::vector<char> differs(static_cast<std::size_t>(world));
    comm::run_gloo_thread_group(world, [&](Communicator& comm) {
      differs[static_cast<std::size_t>(comm.rank())] = testing::ordinary_allreduce_differs(comm, 100003);
    });
    for (const char d : differs) EXPECT_TRUE(d) << world << " ranks";
  }
}

// DataParallel with three bucket caps (1 KB, 16 KB, the default): the same parameters, bit for
// bit, after three AdamW steps.
TEST(Reproducible, DataParallelIsTheSameWhateverItsBuckets) {
  for (const char* algorithm : {"owner", "chain"}) {
    const testing::ScopedVariable variable("GRADSYNC_REPRODUCIBLE_ALGORITHM", algorithm);
    comm::run_gloo_thread_group(
        3,
        [](Communicator& comm) {
          const auto runs = testing::train_with_three_bucket_caps(comm);
          EXPECT_TRUE(runs[0] == runs[1]) << "1 KB and 16 KB buckets differ on rank " << comm.rank();
          EXPECT_TRUE(runs[0] == runs[2]) << "1 KB and default buckets differ on rank " << comm.rank();
        },
        {.reproducible = true});
  }
}

// Rank 0 in reproducible mode, rank 1 not: they would exchange different messages. Both ranks
// say so, in the cheap check and in debug mode.
TEST(Reproducible, RanksThatDisagreeAboutTheModeGetAnError) {
  for (const bool debug : {false, true}) {
    testing::TempDir folder;
    std::vector<std::string> messages(2);
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < 2; ++rank) {
      ranks.emplace_back([&, rank] {
        try {
          auto comm = comm::gloo_file_store(folder.path(), rank, 2,
                                            {.timeout = 10000ms, .check_agreement = debug, .reproducible = rank == 0});
          Tensor t = testing::filled(1000, DType::f32, [](std::int64_t) { return 1.0; });
          comm->allreduce(t, comm::ReduceOp::sum);
        } catch (const Error& error) {
          messages[static_cast<std::size_t>(rank)] = error.what();
        }
      });
    }
    for (std::thread& rank : ranks) rank.join();
    EXPECT_NE(messages[0].find("not every rank is in reproducible mode (this rank 0 is)"), std::string::npos)
        << messages[0];
    EXPECT_NE(messages[1].find("not every rank is in reproducible mode (this rank 1 is not)"), std::string::npos)
        << messages[1];
  }
}

// Debug mode with ranks that agree: every collective goes through (each exchanges its whole
// descriptor first).
TEST(Reproducible, DebugModePassesCollectivesTheRanksAgreeOn) {
  for (const bool reproducible : {false, true}) {
    comm::run_gloo_thread_group(
        3,
        [](Communicator& comm) {
          for (int k = 0; k < 3; ++k) {
            Tensor t = testing::filled(100, DType::f32, [](std::int64_t) { return 1.0; });
            comm.allreduce(t, comm::ReduceOp::sum);
            EXPECT_EQ(t.to_double_vector()[99], 3.0);
          }
          comm.barrier();
        },
        {.timeout = 10000ms, .check_agreement = true, .reproducible = reproducible});
  }
}

}  // namespace
}  // namespace gradsync
