// Sub-communicators on Gloo ranks-as-threads (tests/scenarios/split.h; MPI runs the same in
// test_mpi.cpp): worlds 2 to 6, and 4 and 6 ranks as grids with two axes in flight at once.
#include <gtest/gtest.h>

#include "gradsync/comm/gloo/gloo.h"
#include "split.h"

namespace gradsync {
namespace {

class Split : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Worlds, Split, ::testing::Values(2, 3, 4, 5, 6),
                         [](const auto& info) { return std::to_string(info.param) + "_ranks"; });

TEST_P(Split, GroupsOrdersAndEveryCollective) {
  comm::run_gloo_thread_group(GetParam(), [](comm::Communicator& world) { testing::split_groups(world); });
}

TEST(Split, TwoAxesInFlightAtOnce) {
  for (const int world : {4, 6}) {
    comm::run_gloo_thread_group(world, [](comm::Communicator& comm) { testing::two_axes(comm); });
  }
}

TEST(ProcessSets, MembersReduceAloneAndEveryMistakeIsNamed) {
  for (const int world : {3, 4}) {
    comm::run_gloo_thread_group(world, [](comm::Communicator& comm) { testing::process_sets(comm); });
  }
}

}  // namespace
}  // namespace gradsync
