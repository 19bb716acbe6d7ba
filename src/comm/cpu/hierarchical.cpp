// Hierarchical allreduce (hierarchical.h): a Backend around the flat one.
#include "hierarchical.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "comm/algorithms/ring_allgather.h"
#include "comm/algorithms/ring_reduce_scatter.h"
#include "core/environment.h"
#include "gradsync/io/checksum.h"

namespace gradsync::comm {

std::string node_name(const std::string& configured) {
  if (!configured.empty()) return configured;
  if (auto node = environment::node(); node && !node->empty()) return *node;
  // torchrun numbers its nodes (agents); elsewhere a node is a host.
  if (const auto group = environment::launcher("GROUP_RANK")) return "torchrun node " + *group;
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return host;
}

std::int64_t node_bytes_sent() {
  std::int64_t total = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/sys/class/net", error)) {
    if (entry.path().filename() == "lo") continue;
    std::ifstream counter(entry.path() / "statistics" / "tx_bytes");
    std::int64_t bytes = 0;
    if (counter >> bytes) total += bytes;
  }
  return total;
}

namespace {

// What a rank decides with; every rank must decide alike, so the first exchange compares them.
struct Settings {
  CommOptions::Hierarchy mode = CommOptions::Hierarchy::automatic;
  std::size_t min_bytes = 0;
  std::string node;
};

Settings resolve(const CommOptions& options) {
  Settings settings;
  settings.mode = options.hierarchical;
  if (settings.mode == CommOptions::Hierarchy::automatic) {
    if (const std::optional<bool> forced = environment::hierarchical()) {
      settings.mode = *forced ? CommOptions::Hierarchy::always : CommOptions::Hierarchy::never;
    }
  }
  settings.min_bytes = environment::hierarchical_min_bytes();
  settings.node = node_name(options.node);
  return settings;
}

const char* mode_name(CommOptions::Hierarchy mode) {
  switch (mode) {
    case CommOptions::Hierarchy::always: return "always";
    case CommOptions::Hierarchy::never: return "never";
    default: return "automatic";
  }
}

// Where every rank runs, learned once from every rank's node name.
struct Topology {
  int nodes = 1;
  int local_rank = 0;   // this rank's place among its node's ranks, in rank order
  int local_size = 1;
  bool uniform = true;  // every node runs local_size ranks
  std::vector<std::int64_t> node_of;  // by rank: the node's number, in order of first appearance
};

class HierarchicalBackend final : public Backend {
 public:
  HierarchicalBackend(std::unique_ptr<Backend> flat, CommOptions requested)
      : flat_(std::move(flat)), requested_(std::move(requested)), settings_(resolve(requested_)) {}

  const char* name() const override { return flat_->name(); }
  int rank() const override { return flat_->rank(); }
  int size() const override { return flat_->size(); }
  void set_timeout(std::chrono::milliseconds timeout) override {
    std::lock_guard<std::mutex> lock(groups_mutex_);
    timeout_ = timeout;
    flat_->set_timeout(timeout);
    if (intra_) intra_->set_timeout(timeout);
    if (inter_) inter_->set_timeout(timeout);
  }

  void allreduce(void* data, std::int64_t count, DType dtype, ReduceOp op) override {
    if (!hierarchical_for(static_cast<std::size_t>(count) * dtype_size(dtype))) {
      return flat_->allreduce(data, count, dtype, op);
    }
    const int local_size = topology_->local_size;
    const int local_rank = topology_->local_rank;
    const std::size_t element = dtype_size(dtype);
    // Slice l: elements [l * count / L, (l + 1) * count / L), as the ring cuts its chunks.
    std::vector<std::size_t> offsets;
    for (int slice = 0; slice <= local_size; ++slice) {
      offsets.push_back(static_cast<std::size_t>(count * slice / local_size) * element);
    }
    auto* bytes = static_cast<std::byte*>(data);
    const std::size_t mine = offsets[static_cast<std::size_t>(local_rank)];
    const std::size_t mine_bytes = offsets[static_cast<std::size_t>(local_rank) + 1] - mine;
    phase("the reduce-scatter inside the node", *intra_, [&] {
      // In place, shift 0: local rank l ends holding slice l of the node's sum, at its place.
      algorithms::ring_reduce_scatter(intra_->begin_algorithm(), bytes, nullptr, offsets, /*shift=*/0, dtype, op);
    });
    phase("the allreduce across nodes", *inter_, [&] {
      inter_->allreduce(bytes + mine, static_cast<std::int64_t>(mine_bytes / element), dtype, op);
    });
    phase("the allgather inside the node", *intra_, [&] {
      algorithms::ring_allgather(intra_->begin_algorithm(), bytes, offsets, element, /*first_owned=*/0);
    });
  }

  void broadcast(void* data, std::int64_t count, DType dtype, int root) override {
    flat_->broadcast(data, count, dtype, root);
  }
  void allgather(const void* input, void* output, std::int64_t count, DType dtype) override {
    flat_->allgather(input, output, count, dtype);
  }
  void allgatherv(const void* input, void* output, const std::vector<std::int64_t>& counts, DType dtype) override {
    flat_->allgatherv(input, output, counts, dtype);
  }
  void reduce_scatter(const void* input, void* output, std::int64_t count, DType dtype, ReduceOp op) override {
    flat_->reduce_scatter(input, output, count, dtype, op);
  }
  void barrier() override { flat_->barrier(); }
  void send(const void* data, std::size_t nbytes, int peer, int tag) override { flat_->send(data, nbytes, peer, tag); }
  void recv(void* data, std::size_t nbytes, int peer, int tag) override { flat_->recv(data, nbytes, peer, tag); }
  algorithms::Transport& begin_algorithm() override { return flat_->begin_algorithm(); }

  void abort() override {
    std::lock_guard<std::mutex> lock(groups_mutex_);
    aborted_ = true;
    flat_->abort();
    if (intra_) intra_->abort();
    if (inter_) inter_->abort();
  }

  // The flat backend sees every connection of this rank (Gloo: the full mesh), so it can tell
  // which peer is gone whichever phase noticed.
  std::string explain(const std::string& message) const override { return flat_->explain(message); }

 protected:
  // A duplicate or a group reads the environment again (as reproducible mode does), and checks
  // and learns its settings and topology at its own first allreduce.
  std::unique_ptr<Backend> make_duplicate() override {
    return std::make_unique<HierarchicalBackend>(flat_->duplicate(), requested_);
  }
  std::unique_ptr<Backend> make_split(int color, int key, const SplitPlace& place) override {
    std::unique_ptr<Backend> child = flat_->split(color, key, place);
    if (child == nullptr) return nullptr;
    return std::make_unique<HierarchicalBackend>(std::move(child), requested_);
  }

 private:
  // The rule (docs/communication.md): several nodes, the same number of ranks on each, more
  // than one; then always, or in automatic mode from min_bytes up.
  bool hierarchical_for(std::size_t bytes) {
    if (size() == 1) return false;
    if (topology_ == nullptr) topology_ = learn_topology();
    const Topology& topology = *topology_;
    if (settings_.mode == CommOptions::Hierarchy::never || topology.nodes < 2 || topology.local_size < 2 ||
        !topology.uniform) {
      return false;
    }
    if (settings_.mode == CommOptions::Hierarchy::automatic && bytes < settings_.min_bytes) return false;
    if (inter_ == nullptr) make_groups();
    return true;
  }

  // Once, at this communicator's first allreduce (the same one on every rank): every rank's
  // node name and settings. Ranks that would decide differently are an error on all of them.
  std::shared_ptr<const Topology> learn_topology() {
    const std::int64_t mine[3] = {static_cast<std::int64_t>(io::xxh64(settings_.node.data(), settings_.node.size())),
                                  static_cast<std::int64_t>(settings_.mode),
                                  static_cast<std::int64_t>(settings_.min_bytes)};
    const int n = size();
    std::vector<std::int64_t> all(3 * static_cast<std::size_t>(n));
    flat_->allgather(mine, all.data(), 3, DType::i64);
    auto topology = std::make_shared<Topology>();
    std::vector<std::int64_t> names;  // the nodes' hashes, in order of first appearance
    std::vector<int> ranks_on;        // by node
    const auto settings_of = [&](int r) {
      const std::int64_t* theirs = &all[3 * static_cast<std::size_t>(r)];
      return std::string("mode ") + mode_name(static_cast<CommOptions::Hierarchy>(theirs[1])) + " from " +
             std::to_string(theirs[2] / 1024) + " KiB";
    };
    for (int r = 0; r < n; ++r) {
      const std::int64_t* theirs = &all[3 * static_cast<std::size_t>(r)];
      if (theirs[1] != all[1] || theirs[2] != all[2]) {  // every rank names the first to differ from rank 0
        detail::throw_error("hierarchical allreduce: ", rank_name(r), " runs with ", settings_of(r), ", ",
                            rank_name(0), " with ", settings_of(0),
                            ": set CommOptions::hierarchical, GRADSYNC_HIERARCHICAL and GRADSYNC_HIERARCHICAL_MIN_KB "
                            "the same on every rank");
      }
      std::size_t node = 0;
      while (node < names.size() && names[node] != theirs[0]) ++node;
      if (node == names.size()) {
        names.push_back(theirs[0]);
        ranks_on.push_back(0);
      }
      if (r == rank()) topology->local_rank = ranks_on[node];
      ++ranks_on[node];
      topology->node_of.push_back(static_cast<std::int64_t>(node));
    }
    topology->nodes = static_cast<int>(names.size());
    topology->local_size = ranks_on[static_cast<std::size_t>(topology->node_of[static_cast<std::size_t>(rank())])];
    for (const int count : ranks_on) topology->uniform = topology->uniform && count == topology->local_size;
    return topology;
  }

  // The node's group (ordered by rank: its rank is the local rank) and the group of the same
  // local rank on every node. Both splits are computed here from the topology, which every
  // rank knows whole, so no (color, key) exchange is needed.
  void make_groups() {
    const int n = size();
    std::vector<std::int64_t> by_node;
    std::vector<std::int64_t> by_local_rank;
    std::vector<int> seen(static_cast<std::size_t>(topology_->nodes), 0);
    for (int r = 0; r < n; ++r) {
      const std::int64_t node = topology_->node_of[static_cast<std::size_t>(r)];
      by_node.insert(by_node.end(), {node, r});
      by_local_rank.insert(by_local_rank.end(), {seen[static_cast<std::size_t>(node)]++, r});
    }
    std::unique_ptr<Backend> intra = flat_->split(static_cast<int>(by_node[2 * static_cast<std::size_t>(rank())]),
                                                  rank(), split_place(by_node, rank()));
    std::unique_ptr<Backend> inter = flat_->split(topology_->local_rank, rank(), split_place(by_local_rank, rank()));
    std::lock_guard<std::mutex> lock(groups_mutex_);
    if (aborted_) detail::throw_error("hierarchical allreduce: the communicator broke while its node groups formed");
    intra->set_timeout(timeout_);
    inter->set_timeout(timeout_);
    intra_ = std::move(intra);
    inter_ = std::move(inter);
  }

  // A phase's failure says which phase, and which peer the group's backend can name.
  template <typename Body>
  static void phase(const char* what, const Backend& group, Body&& body) {
    try {
      body();
    } catch (const std::exception& error) {
      detail::throw_error("hierarchical allreduce, ", what, ": ", group.explain(error.what()));
    }
  }

  std::unique_ptr<Backend> flat_;
  CommOptions requested_;  // what the communicator was made with (the environment fills in the rest)
  Settings settings_;
  std::shared_ptr<const Topology> topology_;  // null until the first allreduce
  std::mutex groups_mutex_;                   // abort() comes from another thread
  bool aborted_ = false;
  std::chrono::milliseconds timeout_{0};
  std::unique_ptr<Backend> intra_;  // this node's ranks
  std::unique_ptr<Backend> inter_;  // this local rank on every node
};

}  // namespace

std::unique_ptr<Backend> with_hierarchy(std::unique_ptr<Backend> flat, const CommOptions& options) {
  return std::make_unique<HierarchicalBackend>(std::move(flat), options);
}

}  // namespace gradsync::comm
