// ZeRO's checkpoints (checkpoint.h).
#include "checkpoint.h"

#include <algorithm>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <tuple>

#include <nlohmann/json.hpp>

#include "gradsync/comm/agreement.h"
#include "gradsync/dist/replicas/replicas.h"
#include "gradsync/io/checksum.h"
#include "gradsync/io/safetensors.h"
#include "pieces.h"
#include "set.h"

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
  const std::string what = "ZeroOptimizer::save_sharded to " + folder.string() + " (the previous set, if any, is still in force)";
  // The set's folder, created by rank 0 under a name no earlier set has: the number after the
  // highest existing set-<n>, and create_directory (which fails on an existing folder) makes
  // sure of it. A name taken from the clock could repeat, and the cleanup of a failed save
  // would then delete the previous set it is meant to keep. The id adds a random nonce, so that
  // even a set number reused after the folder was emptied names another save.
  Tensor identity = Tensor::zeros({2}, DType::i64);  // number, nonce
  comm::agree(comm, what, [&] {
    if (comm.rank() != 0) return;
    identity.data_as<std::int64_t>()[0] = create_set_folder(folder);
    std::random_device entropy;
    identity.data_as<std::int64_t>()[1] = static_cast<std::int64_t>((std::uint64_t{entropy()} << 32) | entropy());
  });
  comm.broadcast_host(identity, 0);
  zero_set::Manifest manifest;
  manifest.set = set_name(identity.data_as<std::int64_t>()[0]);
  manifest.id = std::to_string(identity.data_as<std::int64_t>()[0]) + "-" +
                io::hex_digest(static_cast<std::uint64_t>(identity.data_as<std::int64_t>()[1]));
  manifest.world = comm.size();
  manifest.stage = layout.stage;
  const std::filesystem::path set_folder = folder / manifest.set;
  const auto cleaning_up = [&](const std::function<void()>& phase) {
    try {
      phase();
    } catch (...) {
      if (comm.rank() == 0) {
        std::error_code ignored;
        std::filesystem::remove_all(set_folder, ignored);  // the incomplete set; the manifest still names the old one
      }
      throw;
    }
  };

  // Every rank writes its piece and measures what it wrote.
  Tensor written = Tensor::zeros({2}, DType::i64);  // bytes, xxh64
  cleaning_up([&] {
    comm::agree(comm, what, [&] {
      std::vector<io::NamedTensor> tensors;
      const std::size_t buffers = optimizer.state_buffer_names().size();
      for (std::size_t a = 0; a < layout.ranges.size(); ++a) {
        for (std::size_t b = 0; b < buffers; ++b) {
          const Tensor mine = optimizer.shard_state(a, b);
          if (mine.defined() && mine.numel() > 0) tensors.push_back({zero_set::shard_key(a, b), mine});
        }
        // Stage 3: no rank holds the values whole, so the set holds each rank's pieces of them.
        if (layout.stage == 3 && !layout.ranges[a].empty()) tensors.push_back({zero_set::values_key(a), owned_values(optimizer, layout, a)});
      }
      io::Metadata metadata = optimizer.state_metadata();
      zero_set::describe_piece(metadata, manifest.id, comm.rank(), comm.size(), layout.stage, layout.ranges,
                               presence_of(optimizer));
      const std::filesystem::path path = set_folder / zero_set::piece_file(comm.rank());
      io::save_safetensors(path, tensors, metadata);
      const io::FileChecksum checksum = io::checksum_file(path);  // what is on disk, read back
      written.data_as<std::int64_t>()[0] = static_cast<std::int64_t>(checksum.bytes);
      written.data_as<std::int64_t>()[1] = static_cast<std::int64_t>(checksum.xxh64);
    });
  });

  // Every piece is on disk: rank 0 records them in the manifest and points it at the new set,
  // atomically.
  Tensor all_written = Tensor::empty({2 * comm.size()}, DType::i64);
  comm.allgather_host(written, all_written);
  cleaning_up([&] {
    comm::agree(comm, what, [&] {
      if (comm.rank() != 0) return;
      for (int rank = 0; rank < comm.size(); ++rank) {
        const std::int64_t* entry = all_written.data_as<std::int64_t>() + 2 * rank;
        manifest.pieces.push_back({zero_set::piece_file(rank), static_cast<std::uint64_t>(entry[0]),
                                   static_cast<std::uint64_t>(entry[1])});
      }
      const std::filesystem::path temporary = folder / "manifest.json.tmp";
      {
        std::ofstream out(temporary, std::ios::trunc);
        out << zero_set::manifest_text(manifest);
        out.flush();
        GRADSYNC_CHECK(out.good(), "cannot write ", temporary.string());
      }
      std::filesystem::rename(temporary, folder / "manifest.json");
    });
  });
  if (comm.rank() == 0) {  // the old sets are no longer named: remove them
    for (const auto& entry : std::filesystem::directory_iterator(folder)) {
      const std::string name = entry.path().filename().string();
      std::error_code ignored;
      if (entry.is_directory() && name.starts_with("set-") && name != manifest.set) {
        std::filesystem::remove_all(entry.path(), ignored);
      }
    }
  }
  comm.barrier();
}

// Nothing is loaded until every rank has proven its files whole and agreed: first the manifest
// and this rank's own piece; when the layout changed, every piece (each rank checksums its
// share of them); then the assembled state is checked against the optimizer on every rank.
// Each phase ends with comm::agree, so a damaged set is the same error on every rank, at once.
void load_sharded(optim::Optimizer& optimizer, comm::Communicator& comm, const ShardLayout& layout,
                  const std::filesystem::path& folder, bool reshard) {
  const std::string what = "ZeroOptimizer::load_sharded from " + folder.string();
  zero_set::Manifest manifest;
  std::vector<zero_set::Piece> pieces;  // the files this rank reads its state from
  bool same_layout = false;
  comm::agree(comm, what, [&] {
    manifest = zero_set::read_manifest(folder);
    if (comm.rank() >= manifest.world) return;  // no piece of its own: a reshard
    pieces.push_back(zero_set::open_piece(folder, manifest, comm.rank(), optimizer, /*verify_bytes=*/true));
    std::vector<std::tuple<std::size_t, std::int64_t, std::int64_t>> saved, mine;
    for (const zero_set::PieceRange& range : pieces.front().ranges) saved.emplace_back(range.arena, range.begin, range.end);
    for (std::size_t a = 0; a < layout.ranges.size(); ++a) {
      for (const auto& range : layout.ranges[a]) mine.emplace_back(a, range.begin, range.end);
    }
    same_layout = manifest.world == comm.size() && saved == mine;
  });
  // Every rank decides alike: resharding needed anywhere is resharding needed. A stage-3 set's
  // values loaded below stage 3 are needed whole: every piece is read then too.
  const bool values_whole = manifest.stage == 3 && layout.stage < 3;
  const bool other_layout = any_rank(comm, !same_layout);
  if (other_layout || values_whole) {
    GRADSYNC_CHECK(reshard || !other_layout, what, ": the set ", manifest.set, " was saved by ", manifest.world, " rank(s)",
                   manifest.world == comm.size() ? " with other buckets" : "", ", this run has ", comm.size(),
                   "; load_sharded(folder, /*reshard=*/true) reads each rank's pieces from every file");
    pieces.clear();
    comm::agree(comm, what, [&] {
      for (int r = 0; r < manifest.world; ++r) {
        pieces.push_back(zero_set::open_piece(folder, manifest, r, optimizer, /*verify_bytes=*/r % comm.size() == comm.rank()));
      }
      zero_set::check_consistent(pieces);
    });
  } else {
    // Each rank read its own piece only: the pieces must still record one optimizer state (its
    // type, groups, every parameter's step count, which state exists), as the resharding path
    // checks across every piece, or a forged or mixed-up piece would step its rank differently
    // from the others. Each rank compares its piece's with rank 0's: one error on every rank,
    // naming the piece and the entry.
    constexpr const char* kShared[] = {"optimizer.type", "optimizer.groups", "optimizer.steps", "zero.present"};
    const io::Metadata& mine = pieces.front().file->metadata();
    std::string record;  // the four entries, each followed by a zero byte
    for (const char* key : kShared) {
      const auto found = mine.find(key);
      record += (found == mine.end() ? std::string("(absent)") : found->second) + '\0';
    }
    const std::string reference = broadcast_bytes(comm, record, 0);
    comm::agree(comm, what, [&] {
      if (record == reference) return;
      const auto entries = [](const std::string& text) {
        std::vector<std::string> parts;
        for (std::size_t at = 0, end; (end = text.find('\0', at)) != std::string::npos; at = end + 1) {
          parts.push_back(text.substr(at, end - at));
        }
        return parts;
      };
      const std::vector<std::string> ours = entries(record), theirs = entries(reference);
      std::size_t entry = 0;
      while (entry + 1 < std::size(kShared) && entry < theirs.size() && ours[entry] == theirs[entry]) ++entry;
      detail::throw_error(pieces.front().file->path().string(), ": '", kShared[entry],
                          "' differs from rank 0's piece (pieces of one set record the same optimizer state: every ",
                          "parameter's step count, the groups, which state exists)");
    });
  }

  std::vector<io::NamedTensor> tensors;
  io::Metadata metadata;
  std::vector<ValuesRun> values;
  const std::string origin = "the sharded checkpoint " + (folder / manifest.set).string();
  comm::agree(comm, what, [&] {
    const std::vector<PieceView> views = views_of(pieces);
    assemble(optimizer, layout, views, tensors, metadata);
    optimizer.check_state(tensors, metadata, origin);
    // Sets of stages 1 and 2 hold no values: the model comes from its own file, loaded before.
    if (manifest.stage == 3) values = read_values(layout, views);
  });
  optimizer.load_state(tensors, metadata, origin);
  apply_values(optimizer, values);
}

}  // namespace gradsync::dist
