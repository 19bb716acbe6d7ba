// ZeRO's checkpoints (zero_checkpoint.h).
#include "zero_checkpoint.h"

#include <algorithm>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "gradsync/io/safetensors.h"

namespace gradsync::dist {

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

ZeroOptimizer::State consolidated_state(optim::Optimizer& optimizer, comm::Communicator& comm, const ShardLayout& layout) {
  const auto& arenas = optimizer.registry().arenas();
  const std::size_t buffers = optimizer.state_buffer_names().size();
  std::vector<std::vector<Tensor>> full(arenas.size(), std::vector<Tensor>(buffers));
  for (std::size_t a = 0; a < arenas.size(); ++a) {
    // Each rank contributes its packed pieces (zeros where its buffer does not exist yet; the
    // presence bits, the same everywhere, decide what is exported).
    std::vector<std::int64_t> counts;
    std::int64_t total = 0;
    for (const auto& per_rank : layout.all_ranges) {
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
      comm.allreduce_host(flag, comm::ReduceOp::max);
      if (flag.to_double_vector()[0] == 0.0) continue;  // no rank has this buffer
      if (!mine.defined()) mine = Tensor::zeros({counts[static_cast<std::size_t>(comm.rank())]}, dtype, arenas[a].device);
      Tensor packed = Tensor::empty({total}, dtype, arenas[a].device);
      comm.allgatherv(mine, packed, counts);
      Tensor whole = Tensor::zeros({arenas[a].values.numel()}, dtype, arenas[a].device);
      std::int64_t at = 0;
      for (const auto& per_rank : layout.all_ranges) {
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


void save_consolidated(optim::Optimizer& optimizer, comm::Communicator& comm, const ShardLayout& layout,
                       const std::filesystem::path& path) {
  const ZeroOptimizer::State state = consolidated_state(optimizer, comm, layout);
  // Rank 0 writes; every rank learns whether it could, so a failed save is an error everywhere
  // (and, the save being atomic, the previous file is intact).
  std::string failure;
  if (comm.rank() == 0) {
    try {
      io::save_safetensors(path, state.tensors, state.metadata);
    } catch (const std::exception& error) {
      failure = error.what();
    }
  }
  if (any_rank(comm, !failure.empty())) {
    detail::throw_error("ZeroOptimizer::save_consolidated: ",
                        failure.empty() ? "rank 0 could not write " + path.string() + " (see its error)" : failure);
  }
}


void save_sharded(optim::Optimizer& optimizer, comm::Communicator& comm, const ShardLayout& layout,
                  const std::filesystem::path& folder) {
  // The set's folder, created by rank 0 under a name no earlier set has: the number after the
  // highest existing set-<n>, and create_directory (which fails on an existing folder) makes
  // sure of it. A name taken from the clock could repeat, and the cleanup of a failed save
  // would then delete the previous set it is meant to keep.
  Tensor id = Tensor::zeros({1}, DType::f64);
  std::string failure;
  if (comm.rank() == 0) {
    try {
      id.data_as<double>()[0] = static_cast<double>(create_set_folder(folder));
    } catch (const std::exception& error) {
      failure = error.what();
      id.data_as<double>()[0] = -1;
    }
  }
  comm.broadcast_host(id, 0);
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
    for (std::size_t a = 0; a < layout.ranges.size(); ++a) {
      for (std::size_t b = 0; b < buffers; ++b) {
        const Tensor mine = optimizer.shard_state(a, b);
        if (mine.defined() && mine.numel() > 0) tensors.push_back({shard_key(a, b), mine});
      }
    }
    io::Metadata metadata = optimizer.state_metadata();
    json ranges = json::array(), present = json::object();
    for (std::size_t a = 0; a < layout.ranges.size(); ++a) {
      for (const auto& range : layout.ranges[a]) ranges.push_back({a, range.begin, range.end});
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
    metadata["zero.rank"] = std::to_string(comm.rank());
    metadata["zero.world"] = std::to_string(comm.size());
    metadata["zero.stage"] = std::to_string(layout.stage);
    io::save_safetensors(set_folder / ("rank" + std::to_string(comm.rank()) + ".safetensors"), tensors, metadata);
  } catch (const std::exception& error) {
    failure = error.what();
  }
  const auto give_up = [&](const std::string& what) {
    if (comm.rank() == 0) {
      std::error_code ignored;
      std::filesystem::remove_all(set_folder, ignored);  // the incomplete set; the manifest still names the old one
    }
    detail::throw_error("ZeroOptimizer::save_sharded to ", folder.string(), ": ",
                        failure.empty() ? what : failure, " (the previous set, if any, is still in force)");
  };
  if (any_rank(comm, !failure.empty())) give_up("another rank could not write its piece (see its error)");

  // Every piece is on disk: point the manifest at the new set, atomically.
  if (comm.rank() == 0) {
    try {
      const json manifest = {{"set", set}, {"world", comm.size()}, {"stage", layout.stage}};
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
  if (any_rank(comm, !failure.empty())) give_up("rank 0 could not write the manifest (see its error)");
  if (comm.rank() == 0) {  // the old sets are no longer named: remove them
    for (const auto& entry : std::filesystem::directory_iterator(folder)) {
      const std::string name = entry.path().filename().string();
      std::error_code ignored;
      if (entry.is_directory() && name.starts_with("set-") && name != set) std::filesystem::remove_all(entry.path(), ignored);
    }
  }
  comm.barrier();
}

void load_sharded(optim::Optimizer& optimizer, comm::Communicator& comm, const ShardLayout& layout,
                  const std::filesystem::path& folder, bool reshard) {
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
  bool same_layout = saved_world == comm.size();
  if (same_layout) {
    read_ranges(comm.rank());
    std::vector<std::tuple<std::size_t, std::int64_t, std::int64_t>> saved, mine;
    for (const Piece& piece : pieces) saved.emplace_back(piece.arena, piece.begin, piece.end);
    for (std::size_t a = 0; a < layout.ranges.size(); ++a) {
      for (const auto& range : layout.ranges[a]) mine.emplace_back(a, range.begin, range.end);
    }
    same_layout = saved == mine;
  }
  // Every rank decides alike: resharding needed anywhere is resharding needed.
  const bool needs_reshard = any_rank(comm, !same_layout);
  if (needs_reshard) {
    GRADSYNC_CHECK(reshard, "ZeroOptimizer::load_sharded: ", set_folder.string(), " was saved by ", saved_world,
                   " rank(s)", saved_world == comm.size() ? " with other buckets" : "", ", this run has ",
                   comm.size(), "; load_sharded(folder, /*reshard=*/true) reads each rank's pieces from every file");
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
    for (const auto& range : layout.ranges.at(parameter.arena_index())) mine = mine || (range.begin < p_end && p_begin < range.end);
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

}  // namespace gradsync::dist
