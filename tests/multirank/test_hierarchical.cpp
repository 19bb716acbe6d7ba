// Hierarchical allreduce on Gloo ranks-as-threads that say they run on several nodes
// (tests/scenarios/hierarchical.h; MPI runs the same in test_mpi.cpp): the values of every form
// against exact results, the order only the hierarchy takes, layouts that cannot be
// hierarchical, the front ends, and settings that differ across ranks.
#include <gtest/gtest.h>

#include "gradsync/comm/gloo/gloo.h"
#include "hierarchical.h"

namespace gradsync {
namespace {

using comm::CommOptions;
using testing::Expect;

// `size` ranks on `nodes` nodes, hierarchy `mode`.
std::function<CommOptions(int)> on_nodes(int size, int nodes, bool round_robin, CommOptions::Hierarchy mode) {
  return [=](int rank) {
    CommOptions options;
    options.hierarchical = mode;
    options.node = testing::simulated_node(rank, size, nodes, round_robin);
    return options;
  };
}

TEST(Hierarchical, TwoNodesOfTwoAddInTheHierarchysOrder) {
  comm::run_gloo_thread_group(4, [](comm::Communicator& world) { testing::hierarchical_values(world, Expect::pairwise_order); },
                              on_nodes(4, 2, true, CommOptions::Hierarchy::always));
}

TEST(Hierarchical, FlatAddsInAnotherOrderSoTheCheckCanTell) {
  comm::run_gloo_thread_group(4, [](comm::Communicator& world) { testing::hierarchical_values(world, Expect::not_pairwise); },
                              on_nodes(4, 2, true, CommOptions::Hierarchy::never));
}

// Layouts: 2 x 3 and 3 x 2 (hierarchical), in blocks and round robin; 3 ranks on 2 nodes and
// 4 on 1 (flat: the hierarchy needs the same number of ranks, more than one, on every node).
TEST(Hierarchical, EveryLayoutReducesCorrectly) {
  struct Layout { int size, nodes; bool round_robin; };
  for (const Layout layout : {Layout{6, 2, false}, Layout{6, 3, true}, Layout{3, 2, false}, Layout{4, 1, false}}) {
    SCOPED_TRACE(std::to_string(layout.size) + " ranks on " + std::to_string(layout.nodes) + " nodes");
    comm::run_gloo_thread_group(layout.size, [](comm::Communicator& world) { testing::hierarchical_values(world, Expect::any_order); },
                                on_nodes(layout.size, layout.nodes, layout.round_robin, CommOptions::Hierarchy::always));
  }
}

TEST(Hierarchical, AutomaticModeAboveItsThreshold) {
  comm::run_gloo_thread_group(4, [](comm::Communicator& world) { testing::hierarchical_values(world, Expect::any_order, 1 << 20); },
                              on_nodes(4, 2, false, CommOptions::Hierarchy::automatic));
}

TEST(Hierarchical, FrontEndsDuplicatesAndSplits) {
  comm::run_gloo_thread_group(4, [](comm::Communicator& world) { testing::hierarchical_front_ends(world); },
                              on_nodes(4, 2, false, CommOptions::Hierarchy::always));
}

TEST(Hierarchical, SettingsThatDifferAcrossRanksFailOnEveryRank) {
  comm::run_gloo_thread_group(3, [](comm::Communicator& world) { testing::hierarchical_settings_must_agree(world); },
                              [](int rank) {
                                CommOptions options;
                                options.hierarchical = rank == 1 ? CommOptions::Hierarchy::never : CommOptions::Hierarchy::always;
                                return options;
                              });
}

}  // namespace
}  // namespace gradsync
