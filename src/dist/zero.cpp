// ZeroOptimizer (gradsync/dist/zero.h): the optimizer sharded over a Reducer's buckets
// (DataParallel's, or the DistributedOptimizer's with zero_stage).
#include "gradsync/dist/zero.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "consistency.h"
#include "gradsync/core/timeline.h"
#include "gradsync/io/safetensors.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/optim/clip.h"

namespace gradsync::dist {

struct ZeroOptimizer::Impl {
  optim::Optimizer& optimizer;
  const Reducer& reducer;     // whose buckets are sharded
  DataParallel* ddp;          // the DataParallel front end (Join takes part), or null
  ZeroOptions options;
  // The parameter gathers run on their own communicator: launched after the step, they may
  // still travel while the next backward's buckets go out on the Reducer's.
  std::unique_ptr<comm::Communicator> own_comm;
  comm::Communicator& comm;
  std::vector<std::vector<optim::Optimizer::ElementRange>> ranges;  // per arena
  // Every rank's ranges (the same computation for each rank): [rank][arena].
  std::vector<std::vector<std::vector<optim::Optimizer::ElementRange>>> all_ranges;

  // One bucket's gather: this rank's piece of the updated values, allgathered into the arena.
  struct Gather {
    std::size_t arena = 0;
    std::int64_t begin = 0;  // the bucket's first element in the arena
    BucketShard shard;
    Tensor staging;  // this rank's piece (the input must not alias the output)
    comm::WorkHandle work;
  };
  std::vector<Gather> gathers;  // by bucket index

  Impl(optim::Optimizer& optimizer_, const Reducer& reducer_, comm::Communicator& base, DataParallel* ddp_,
       ZeroOptions options_)
      : optimizer(optimizer_), reducer(reducer_), ddp(ddp_), options(options_),
        own_comm(base.size() > 1 ? base.duplicate() : nullptr), comm(own_comm ? *own_comm : base) {}

  bool inside_join() const { return ddp != nullptr && ddp->inside_join(); }
  ParameterRegistry& registry() const { return optimizer.registry(); }

  // Under dist::Join a joined rank must take part in every step: its pieces are its to update,
  // and the gathers need it. Each collective phase of a step on the active ranks therefore
  // starts with a control allreduce (max) of [kind, unscale, clip] that a joined rank answers
  // with zeros and reads: kind 1, the gradient statistics follow; kind 2, the step and the
  // gathers. See docs/zero.md.
  static constexpr double kStatistics = 1, kStep = 2;
  bool shadowing = false;  // this rank is a joined rank in a shadow step

  std::array<double, 3> control(double kind, double unscale, double clip) {
    Tensor words = Tensor::from_vector(std::vector<double>{kind, unscale, clip}, {3});
    comm.allreduce_host(words, comm::ReduceOp::max);
    const std::vector<double> v = words.to_double_vector();
    return {v[0], v[1], v[2]};
  }

  bool announces() const { return inside_join() && !shadowing; }

  void require_no_scaler_under_join() const {
    GRADSYNC_CHECK(!inside_join() || optimizer.pending_gradient_unscale() == 1.0, "ZeroOptimizer under dist::Join ",
                   "with a GradScaler is not supported: a skipped step would leave the joined ranks waiting for it");
  }

  // A joined rank's part in one optimizer step of the others (DataParallel's join loop calls
  // it after every synchronized step that does not carry).
  void shadow_step() {
    shadowing = true;
    struct Reset {
      bool& flag;
      ~Reset() { flag = false; }
    } reset{shadowing};
    for (;;) {
      const auto [kind, unscale, clip] = control(0, 0, 0);
      if (kind == kStatistics) {
        if (unscale != 1.0) optimizer.defer_gradient_unscale(unscale);
        (void)optimizer.gradient_statistics();  // combine() takes part in the sums
      } else if (kind == kStep) {
        if (unscale != 1.0) optimizer.defer_gradient_unscale(unscale);
        if (clip != 1.0) optimizer.defer_gradient_clip(clip);
        optimizer.step();
        launch_gathers();
        wait_all();
        return;
      } else {
        detail::throw_error("ZeroOptimizer: a joined rank expected the others' optimizer step, got control word ", kind);
      }
    }
  }

  void build() {
    GRADSYNC_CHECK(options.stage == 1 || options.stage == 2, "ZeroOptimizer: stage ", options.stage,
                   " (expected 1: optimizer state sharded, or 2: gradients too)");
    GRADSYNC_CHECK(ddp == nullptr || &optimizer.registry() == &ddp->registry(), "ZeroOptimizer: the optimizer and the ",
                   "DataParallel are over different registries");
    const bool sharded_gradients = reducer.options().reduce_scatter;
    GRADSYNC_CHECK(sharded_gradients == (options.stage == 2), "ZeroOptimizer: stage ", options.stage, " needs a ",
                   "DataParallel ", options.stage == 2 ? "with" : "without", " shard_gradients (DataParallelOptions), ",
                   "which decides whether buckets are reduce-scattered (stage 2) or allreduced (stage 1)");
    // Every rank the same stage and the same buckets (a rank with another bucket_cap_mb, say,
    // would cut other pieces): an error on every rank naming the first difference.
    std::vector<std::string> layout{"stage " + std::to_string(options.stage)};
    for (std::size_t b = 0; b < reducer.bucket_count(); ++b) {
      const BucketInfo& info = reducer.bucket(b);
      layout.push_back("bucket " + std::to_string(b) + ": arena " + std::to_string(info.members[0]->arena_index()) +
                       ", " + std::to_string(info.numel) + " elements from '" + info.members[0]->name() + "'");
    }
    require_same_lines(comm, layout, "ZeroOptimizer", "shard layout");

    all_ranges.assign(static_cast<std::size_t>(comm.size()),
                      std::vector<std::vector<optim::Optimizer::ElementRange>>(registry().arenas().size()));
    for (std::size_t b = 0; b < reducer.bucket_count(); ++b) {
      const BucketInfo& info = reducer.bucket(b);
      const std::int64_t begin = static_cast<std::int64_t>(info.members[0]->arena_offset()) - info.member_offset[0];
      for (int r = 0; r < comm.size(); ++r) {
        const BucketShard piece = shard_bucket(info.numel, comm.size(), r);
        if (piece.count == 0) continue;
        all_ranges[static_cast<std::size_t>(r)][info.members[0]->arena_index()].push_back(
            {begin + piece.begin, begin + piece.begin + piece.count});
      }
    }
    for (auto& per_rank : all_ranges) {
      for (auto& list : per_rank) {
        std::sort(list.begin(), list.end(), [](const auto& x, const auto& y) { return x.begin < y.begin; });
      }
    }
    ranges.assign(registry().arenas().size(), {});
    for (std::size_t b = 0; b < reducer.bucket_count(); ++b) {
      const BucketInfo& info = reducer.bucket(b);
      GRADSYNC_CHECK(info.arena_view, "ZeroOptimizer: bucket ", b, " (", info.members[0]->name(), ", ...) is not a view ",
                     "of the gradient arena (its members are not neighbours: frozen parameters between them?); ",
                     "ZeRO shards arena runs");
      Gather gather;
      gather.arena = info.members[0]->arena_index();
      gather.begin = static_cast<std::int64_t>(info.members[0]->arena_offset()) - info.member_offset[0];
      gather.shard = shard_bucket(info.numel, comm.size(), comm.rank());
      if (gather.shard.count > 0) {
        ranges[gather.arena].push_back({gather.begin + gather.shard.begin, gather.begin + gather.shard.begin + gather.shard.count});
      }
      const Arena& arena = registry().arenas()[gather.arena];
      gather.staging = Tensor::empty({gather.shard.count}, arena.dtype, arena.device);
      gathers.push_back(std::move(gather));
    }
    for (auto& list : ranges) {
      std::sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
    }
    optimizer.shard(ranges, [this](optim::GradientStatistics& statistics) { combine(statistics); });
    if (ddp != nullptr) ddp->set_shadow_optimizer_step([this] { shadow_step(); });
  }

  // Every rank's statistics of its owned pieces, made the world's: sums, and the largest.
  void combine(optim::GradientStatistics& statistics) {
    if (announces()) {
      require_no_scaler_under_join();
      control(kStatistics, optimizer.pending_gradient_unscale(), 1.0);
    }
    Tensor sums = Tensor::from_vector(
        std::vector<double>{statistics.sum_of_squares, static_cast<double>(statistics.nonfinite)}, {2});
    comm.allreduce_host(sums, comm::ReduceOp::sum);
    Tensor largest = Tensor::from_vector(std::vector<double>{statistics.max_abs}, {1});
    comm.allreduce_host(largest, comm::ReduceOp::max);
    statistics.sum_of_squares = sums.to_double_vector()[0];
    statistics.nonfinite = static_cast<std::int64_t>(sums.to_double_vector()[1]);
    statistics.max_abs = largest.to_double_vector()[0];
  }

  void launch_gathers() {
    for (Gather& gather : gathers) {
      Tensor values = registry().arenas()[gather.arena].values;  // shares the arena's storage
      if (gather.shard.count > 0) {
        gather.staging.copy_from(values.view(static_cast<std::size_t>(gather.begin + gather.shard.begin), {gather.shard.count}));
      }
      std::int64_t numel = 0;
      for (const std::int64_t count : gather.shard.counts) numel += count;
      Tensor target = values.view(static_cast<std::size_t>(gather.begin), {numel});
      timeline::instant("zero", "gather parameters");
      gather.work = comm.allgatherv_async(gather.staging, target, gather.shard.counts);
    }
  }

  void wait(Gather& gather) {
    if (!gather.work) return;
    comm::WorkHandle work = std::move(gather.work);
    work->wait();
  }

  void wait_all() {
    comm::FirstError errors;
    for (Gather& gather : gathers) errors.wait(gather.work);
    errors.rethrow();
  }

  void drain() noexcept {
    comm::FirstError ignored;  // destruction: nothing left to report to
    for (Gather& gather : gathers) ignored.wait(gather.work);
  }
};

ZeroOptimizer::ZeroOptimizer(optim::Optimizer& optimizer, DataParallel& ddp, ZeroOptions options)
    : impl_(std::make_unique<Impl>(optimizer, ddp.reducer(), ddp.communicator(), &ddp, options)) {
  impl_->build();
}

ZeroOptimizer::ZeroOptimizer(optim::Optimizer& optimizer, const Reducer& reducer, comm::Communicator& comm,
                             ZeroOptions options)
    : impl_(std::make_unique<Impl>(optimizer, reducer, comm, nullptr, options)) {
  impl_->build();
}

ZeroOptimizer::~ZeroOptimizer() {
  if (impl_->ddp != nullptr) impl_->ddp->set_shadow_optimizer_step(nullptr);
  impl_->drain();
}

void ZeroOptimizer::step_async() {
  impl_->wait_all();
  if (impl_->announces()) {  // joined ranks step their pieces with us (Impl::shadow_step)
    impl_->require_no_scaler_under_join();
    impl_->control(Impl::kStep, impl_->optimizer.pending_gradient_unscale(), impl_->optimizer.pending_gradient_clip());
  }
  impl_->optimizer.step();
  impl_->launch_gathers();
}

void ZeroOptimizer::step() {
  step_async();
  impl_->wait_all();
}

void ZeroOptimizer::wait_for(const Parameter& parameter) {
  impl_->wait(impl_->gathers.at(impl_->reducer.bucket_of(parameter)));
}

void ZeroOptimizer::wait_all() { impl_->wait_all(); }

void ZeroOptimizer::zero_grad(bool set_to_undefined) { impl_->optimizer.zero_grad(set_to_undefined); }

double ZeroOptimizer::clip_grad_norm(double max_norm, double norm_type, bool error_if_nonfinite) {
  return optim::clip_grad_norm(impl_->optimizer, max_norm, norm_type, error_if_nonfinite);
}

optim::Optimizer& ZeroOptimizer::optimizer() const { return impl_->optimizer; }
int ZeroOptimizer::stage() const { return impl_->options.stage; }
const std::vector<std::vector<optim::Optimizer::ElementRange>>& ZeroOptimizer::shard_ranges() const {
  return impl_->ranges;
}
std::int64_t ZeroOptimizer::state_bytes() const { return impl_->optimizer.state_bytes(); }

ZeroOptimizer::State ZeroOptimizer::consolidated_state() {
  Impl& z = *impl_;
  z.wait_all();
  optim::Optimizer& optimizer = z.optimizer;
  const auto& arenas = z.registry().arenas();
  const std::size_t buffers = optimizer.state_buffer_names().size();
  std::vector<std::vector<Tensor>> full(arenas.size(), std::vector<Tensor>(buffers));
  for (std::size_t a = 0; a < arenas.size(); ++a) {
    // Each rank contributes its packed pieces (zeros where its buffer does not exist yet; the
    // presence bits, the same everywhere, decide what is exported).
    std::vector<std::int64_t> counts;
    std::int64_t total = 0;
    for (const auto& per_rank : z.all_ranges) {
      std::int64_t count = 0;
      for (const auto& range : per_rank[a]) count += range.end - range.begin;
      counts.push_back(count);
      total += count;
    }
    if (total == 0) continue;
    const DType dtype = optimizer.state_dtype(a);
    for (std::size_t b = 0; b < buffers; ++b) {
      Tensor mine = optimizer.shard_state(a, b);
      Tensor flag = Tensor::from_vector(std::vector<double>{mine.defined() ? 1.0 : 0.0}, {1});
      z.comm.allreduce_host(flag, comm::ReduceOp::max);
      if (flag.to_double_vector()[0] == 0.0) continue;  // no rank has this buffer
      if (!mine.defined()) mine = Tensor::zeros({counts[static_cast<std::size_t>(z.comm.rank())]}, dtype, arenas[a].device);
      Tensor packed = Tensor::empty({total}, dtype, arenas[a].device);
      z.comm.allgatherv(mine, packed, counts);
      Tensor whole = Tensor::zeros({arenas[a].values.numel()}, dtype, arenas[a].device);
      std::int64_t at = 0;
      for (const auto& per_rank : z.all_ranges) {
        for (const auto& range : per_rank[a]) {
          Tensor target = whole.view(static_cast<std::size_t>(range.begin), {range.end - range.begin});
          target.copy_from(packed.view(static_cast<std::size_t>(at), {range.end - range.begin}));
          at += range.end - range.begin;
        }
      }
      full[a][b] = whole;
    }
  }
  return {optimizer.state_tensors_of(full), optimizer.state_metadata()};
}

namespace {

using json = nlohmann::json;

// One flag from every rank: true when any rank raises it. Sharded saves end every phase with
// one, so that a failure on one rank is an error on all of them, never a rank left waiting.
bool any_rank(comm::Communicator& comm, bool mine) {
  Tensor flag = Tensor::from_vector(std::vector<double>{mine ? 1.0 : 0.0}, {1});
  comm.allreduce_host(flag, comm::ReduceOp::max);
  return flag.to_double_vector()[0] != 0.0;
}

std::string set_name(std::int64_t number) { return "set-" + std::to_string(number); }

// Creates folder/set-<n> for the first n above every existing set's number; returns n.
std::int64_t create_set_folder(const std::filesystem::path& folder) {
  std::filesystem::create_directories(folder);
  std::int64_t next = 0;
  for (const auto& entry : std::filesystem::directory_iterator(folder)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with("set-")) continue;
    const std::string digits = name.substr(4);
    if (digits.empty() || digits.size() > 15 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    next = std::max<std::int64_t>(next, std::stoll(digits) + 1);
  }
  while (!std::filesystem::create_directory(folder / set_name(next))) ++next;  // taken meanwhile: the next one
  return next;
}

std::string shard_key(std::size_t arena, std::size_t buffer) {
  return "zero.shard." + std::to_string(arena) + "." + std::to_string(buffer);
}

}  // namespace

void ZeroOptimizer::save_consolidated(const std::filesystem::path& path) {
  const State state = consolidated_state();
  // Rank 0 writes; every rank learns whether it could, so a failed save is an error everywhere
  // (and, the save being atomic, the previous file is intact).
  std::string failure;
  if (impl_->comm.rank() == 0) {
    try {
      io::save_safetensors(path, state.tensors, state.metadata);
    } catch (const std::exception& error) {
      failure = error.what();
    }
  }
  if (any_rank(impl_->comm, !failure.empty())) {
    detail::throw_error("ZeroOptimizer::save_consolidated: ",
                        failure.empty() ? "rank 0 could not write " + path.string() + " (see its error)" : failure);
  }
}


void ZeroOptimizer::save_sharded(const std::filesystem::path& folder) {
  Impl& z = *impl_;
  z.wait_all();
  optim::Optimizer& optimizer = z.optimizer;
  // The set's folder, created by rank 0 under a name no earlier set has: the number after the
  // highest existing set-<n>, and create_directory (which fails on an existing folder) makes
  // sure of it. A name taken from the clock could repeat, and the cleanup of a failed save
  // would then delete the previous set it is meant to keep.
  Tensor id = Tensor::zeros({1}, DType::f64);
  std::string failure;
  if (z.comm.rank() == 0) {
    try {
      id.data_as<double>()[0] = static_cast<double>(create_set_folder(folder));
    } catch (const std::exception& error) {
      failure = error.what();
      id.data_as<double>()[0] = -1;
    }
  }
  z.comm.broadcast_host(id, 0);
  const auto number = static_cast<std::int64_t>(id.data_as<double>()[0]);
  if (number < 0) {
    detail::throw_error("ZeroOptimizer::save_sharded to ", folder.string(), ": ",
                        failure.empty() ? "rank 0 could not create the set's folder (see its error)" : failure,
                        " (the previous set, if any, is still in force)");
  }
  const std::string set = set_name(number);
  const std::filesystem::path set_folder = folder / set;

  try {
    std::vector<io::NamedTensor> tensors;
    const std::size_t buffers = optimizer.state_buffer_names().size();
    for (std::size_t a = 0; a < z.ranges.size(); ++a) {
      for (std::size_t b = 0; b < buffers; ++b) {
        const Tensor mine = optimizer.shard_state(a, b);
        if (mine.defined() && mine.numel() > 0) tensors.push_back({shard_key(a, b), mine});
      }
    }
    io::Metadata metadata = optimizer.state_metadata();
    json ranges = json::array(), present = json::object();
    for (std::size_t a = 0; a < z.ranges.size(); ++a) {
      for (const auto& range : z.ranges[a]) ranges.push_back({a, range.begin, range.end});
    }
    for (const Parameter& parameter : optimizer.registry()) {
      if (!parameter.requires_grad()) continue;
      try {
        if (const std::uint32_t bits = optimizer.state_presence(parameter)) present[parameter.name()] = bits;
      } catch (const Error&) {  // not optimized by this optimizer
      }
    }
    metadata["zero.ranges"] = ranges.dump();
    metadata["zero.present"] = present.dump();
    metadata["zero.rank"] = std::to_string(z.comm.rank());
    metadata["zero.world"] = std::to_string(z.comm.size());
    metadata["zero.stage"] = std::to_string(z.options.stage);
    io::save_safetensors(set_folder / ("rank" + std::to_string(z.comm.rank()) + ".safetensors"), tensors, metadata);
  } catch (const std::exception& error) {
    failure = error.what();
  }
  const auto give_up = [&](const std::string& what) {
    if (z.comm.rank() == 0) {
      std::error_code ignored;
      std::filesystem::remove_all(set_folder, ignored);  // the incomplete set; the manifest still names the old one
    }
    detail::throw_error("ZeroOptimizer::save_sharded to ", folder.string(), ": ",
                        failure.empty() ? what : failure, " (the previous set, if any, is still in force)");
  };
  if (any_rank(z.comm, !failure.empty())) give_up("another rank could not write its piece (see its error)");

  // Every piece is on disk: point the manifest at the new set, atomically.
  if (z.comm.rank() == 0) {
    try {
      const json manifest = {{"set", set}, {"world", z.comm.size()}, {"stage", z.options.stage}};
      const std::filesystem::path temporary = folder / "manifest.json.tmp";
      {
        std::ofstream out(temporary, std::ios::trunc);
        out << manifest.dump(2) << "\n";
        out.flush();
        GRADSYNC_CHECK(out.good(), "cannot write ", temporary.string());
      }
      std::filesystem::rename(temporary, folder / "manifest.json");
    } catch (const std::exception& error) {
      failure = error.what();
    }
  }
  if (any_rank(z.comm, !failure.empty())) give_up("rank 0 could not write the manifest (see its error)");
  if (z.comm.rank() == 0) {  // the old sets are no longer named: remove them
    for (const auto& entry : std::filesystem::directory_iterator(folder)) {
      const std::string name = entry.path().filename().string();
      std::error_code ignored;
      if (entry.is_directory() && name.starts_with("set-") && name != set) std::filesystem::remove_all(entry.path(), ignored);
    }
  }
  z.comm.barrier();
}

void ZeroOptimizer::load_sharded(const std::filesystem::path& folder, bool reshard) {
  Impl& z = *impl_;
  z.wait_all();
  optim::Optimizer& optimizer = z.optimizer;
  json manifest;
  {
    std::ifstream in(folder / "manifest.json");
    GRADSYNC_CHECK(in.good(), "ZeroOptimizer::load_sharded: no manifest.json in ", folder.string(),
                   " (not a sharded checkpoint, or its first save never completed)");
    manifest = json::parse(in, nullptr, false);
  }
  GRADSYNC_CHECK(manifest.is_object() && manifest.contains("set") && manifest["set"].is_string() &&
                     manifest.contains("world") && manifest["world"].is_number_integer(),
                 "ZeroOptimizer::load_sharded: malformed ", (folder / "manifest.json").string());
  const std::filesystem::path set_folder = folder / manifest["set"].get<std::string>();
  const int saved_world = manifest["world"].get<int>();
  const auto file_of = [&](int rank) { return set_folder / ("rank" + std::to_string(rank) + ".safetensors"); };

  // Each saved file: its ranges. Same world and the same ranges: this rank's own file only.
  struct Piece {
    std::size_t file;
    std::size_t arena;
    std::int64_t begin, end, packed;  // packed: its offset in that file's buffer
  };
  std::vector<std::unique_ptr<io::SafetensorsReader>> files;
  std::vector<Piece> pieces;
  const auto read_ranges = [&](int rank) {
    files.push_back(std::make_unique<io::SafetensorsReader>(file_of(rank)));
    const io::Metadata& metadata = files.back()->metadata();
    GRADSYNC_CHECK(metadata.contains("zero.ranges"), file_of(rank).string(), ": not a ZeRO shard (no zero.ranges)");
    const json ranges = json::parse(metadata.at("zero.ranges"), nullptr, false);
    GRADSYNC_CHECK(ranges.is_array(), file_of(rank).string(), ": malformed zero.ranges");
    std::map<std::size_t, std::int64_t> packed;
    for (const json& range : ranges) {
      GRADSYNC_CHECK(range.is_array() && range.size() == 3, file_of(rank).string(), ": malformed zero.ranges");
      const auto arena = range[0].get<std::size_t>();
      const auto begin = range[1].get<std::int64_t>(), end = range[2].get<std::int64_t>();
      pieces.push_back({files.size() - 1, arena, begin, end, packed[arena]});
      packed[arena] += end - begin;
    }
  };
  bool same_layout = saved_world == z.comm.size();
  if (same_layout) {
    read_ranges(z.comm.rank());
    std::vector<std::tuple<std::size_t, std::int64_t, std::int64_t>> saved, mine;
    for (const Piece& piece : pieces) saved.emplace_back(piece.arena, piece.begin, piece.end);
    for (std::size_t a = 0; a < z.ranges.size(); ++a) {
      for (const auto& range : z.ranges[a]) mine.emplace_back(a, range.begin, range.end);
    }
    same_layout = saved == mine;
  }
  // Every rank decides alike: resharding needed anywhere is resharding needed.
  const bool needs_reshard = any_rank(z.comm, !same_layout);
  if (needs_reshard) {
    GRADSYNC_CHECK(reshard, "ZeroOptimizer::load_sharded: ", set_folder.string(), " was saved by ", saved_world,
                   " rank(s)", saved_world == z.comm.size() ? " with other buckets" : "", ", this run has ",
                   z.comm.size(), "; load_sharded(folder, /*reshard=*/true) reads each rank's pieces from every file");
    files.clear();
    pieces.clear();
    for (int r = 0; r < saved_world; ++r) read_ranges(r);
  }

  // Per parameter touching this rank's pieces: a full-shape tensor with those pieces filled in
  // (Optimizer::load_state keeps only the owned elements); presence of the others' state from
  // the metadata.
  const io::Metadata& first = files.front()->metadata();
  io::Metadata metadata;
  for (const char* key : {"optimizer.type", "optimizer.groups", "optimizer.steps"}) {
    GRADSYNC_CHECK(first.contains(key), files.front()->path().string(), ": no '", key, "' metadata");
    metadata[key] = first.at(key);
  }
  const json present = json::parse(first.count("zero.present") ? first.at("zero.present") : "{}", nullptr, false);
  GRADSYNC_CHECK(present.is_object(), files.front()->path().string(), ": malformed zero.present");
  const auto& names = optimizer.state_buffer_names();
  std::map<std::pair<std::size_t, std::size_t>, std::map<std::size_t, Tensor>> buffers;  // (file, arena) -> buffer -> data
  std::vector<io::NamedTensor> tensors;
  json elsewhere = json::object();
  for (const Parameter& parameter : optimizer.registry()) {
    if (!parameter.requires_grad() || !present.contains(parameter.name())) continue;
    const auto bits = present[parameter.name()].get<std::uint32_t>();
    const auto p_begin = static_cast<std::int64_t>(parameter.arena_offset());
    const std::int64_t p_end = p_begin + parameter.numel();
    bool mine = false;
    for (const auto& range : z.ranges.at(parameter.arena_index())) mine = mine || (range.begin < p_end && p_begin < range.end);
    if (!mine) {
      elsewhere[parameter.name()] = bits;
      continue;
    }
    const DType dtype = optimizer.state_dtype(parameter.arena_index());
    for (std::size_t b = 0; b < names.size(); ++b) {
      if (!(bits & (1u << b))) continue;
      Tensor whole = Tensor::zeros({parameter.numel()}, dtype);
      for (const Piece& piece : pieces) {
        if (piece.arena != parameter.arena_index()) continue;
        const std::int64_t lo = std::max(piece.begin, p_begin), hi = std::min(piece.end, p_end);
        if (lo >= hi) continue;
        Tensor& data = buffers[{piece.file, piece.arena}][b];
        if (!data.defined()) data = files[piece.file]->read(shard_key(piece.arena, b));
        Tensor target = whole.view(static_cast<std::size_t>(lo - p_begin), {hi - lo});
        target.copy_from(data.view(static_cast<std::size_t>(piece.packed + (lo - piece.begin)), {hi - lo}));
      }
      tensors.push_back({"optimizer.state." + parameter.name() + "." + names[b], whole.view(0, parameter.shape())});
    }
  }
  metadata["optimizer.present_elsewhere"] = elsewhere.dump();
  optimizer.load_state(tensors, metadata, "the sharded checkpoint " + set_folder.string());
}

void ZeroOptimizer::load_state(const std::filesystem::path& path) {
  impl_->wait_all();
  impl_->optimizer.load_state(path);
}

}  // namespace gradsync::dist
