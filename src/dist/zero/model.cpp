// ZeRO's model without a gather (model.h).
#include "model.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gradsync/comm/agreement.h"
#include "gradsync/dist/replicas/replicas.h"
#include "gradsync/io/checksum.h"
#include "gradsync/io/safetensors_piece_writer.h"
#include "gradsync/io/safetensors_set.h"

namespace gradsync::dist::zero_model {

namespace {

using json = nlohmann::json;

// Elements [first, first + count) of a parameter's value.
struct Piece {
  const Parameter* parameter;
  std::int64_t first;
  std::int64_t count;
};

// A parameter's intersections with this rank's ranges of its arena (trainable parameters only).
void add_owned(const Parameter& parameter, const ShardLayout& layout, std::vector<Piece>& pieces) {
  const auto begin = static_cast<std::int64_t>(parameter.arena_offset());
  const std::int64_t end = begin + parameter.numel();
  for (const auto& range : layout.ranges.at(parameter.arena_index())) {
    const std::int64_t lo = std::max(range.begin, begin), hi = std::min(range.end, end);
    if (lo < hi) pieces.push_back({&parameter, lo - begin, hi - lo});
  }
}

// What this rank holds (the contract above).
std::vector<Piece> held_pieces(const ParameterRegistry& registry, const ShardLayout& layout) {
  std::vector<Piece> pieces;
  for (const Parameter& parameter : registry) {
    if (layout.stage == 3 && parameter.requires_grad()) {
      add_owned(parameter, layout, pieces);
    } else {
      pieces.push_back({&parameter, 0, parameter.numel()});
    }
  }
  return pieces;
}

// What this rank writes to a file: every element by exactly one rank.
std::vector<Piece> written_pieces(const ParameterRegistry& registry, const ShardLayout& layout, int rank) {
  std::vector<Piece> pieces;
  for (const Parameter& parameter : registry) {
    if (parameter.requires_grad()) {
      add_owned(parameter, layout, pieces);
    } else if (rank == 0) {
      pieces.push_back({&parameter, 0, parameter.numel()});
    }
  }
  return pieces;
}

// The piece's elements in the value arena (a released unit's members have no value()).
Tensor arena_view(const ParameterRegistry& registry, const Piece& piece) {
  const Arena& arena = registry.arenas()[piece.parameter->arena_index()];
  return arena.values.view(piece.parameter->arena_offset() + static_cast<std::size_t>(piece.first), {piece.count});
}

// Per-parameter sums of piece checksums (the data given by `data_of`), added over the ranks: the
// whole tensors' checksums (io::piece_checksum), the same on every rank. Sums mod 2^64 travel as
// two 32-bit halves in i64 words, which no number of ranks overflows.
std::vector<std::uint64_t> tensor_checksums(const ParameterRegistry& registry, comm::Communicator& comm,
                                            const std::vector<Piece>& pieces,
                                            const std::function<Tensor(std::size_t)>& data_of) {
  std::vector<std::uint64_t> mine(registry.size(), 0);
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    mine[pieces[k].parameter->index()] += io::piece_checksum(pieces[k].parameter->name(), pieces[k].first, data_of(k));
  }
  Tensor halves = Tensor::zeros({static_cast<std::int64_t>(2 * mine.size())}, DType::i64);
  auto* words = halves.data_as<std::int64_t>();
  for (std::size_t i = 0; i < mine.size(); ++i) {
    words[2 * i] = static_cast<std::int64_t>(mine[i] & 0xFFFFFFFFu);
    words[2 * i + 1] = static_cast<std::int64_t>(mine[i] >> 32);
  }
  if (comm.size() > 1) comm.allreduce_host(halves, comm::ReduceOp::sum);
  std::vector<std::uint64_t> total(mine.size());
  for (std::size_t i = 0; i < total.size(); ++i) {
    total[i] = static_cast<std::uint64_t>(words[2 * i]) + (static_cast<std::uint64_t>(words[2 * i + 1]) << 32);
  }
  return total;
}

std::string rule_line(const Parameter& parameter, const init::Rule& rule) {
  char line[512];
  std::snprintf(line, sizeof line, "%s: kind %d, %.17g, %.17g", parameter.name().c_str(), static_cast<int>(rule.kind),
                rule.a, rule.b);
  std::string text = line;
  if (rule.kind == init::Rule::Kind::function && rule.function) {
    // A function cannot be compared; its values at three indices can.
    for (const std::int64_t i : {std::int64_t{0}, parameter.numel() / 2, parameter.numel() - 1}) {
      std::snprintf(line, sizeof line, ", f(%lld) = %.17g", static_cast<long long>(i), rule.function(i));
      text += line;
    }
  }
  return text;
}

}  // namespace

void initialize(ParameterRegistry& registry, comm::Communicator& comm, const ShardLayout& layout,
                const std::function<init::Rule(const Parameter&)>& rule_of, std::uint64_t seed) {
  std::vector<init::Rule> rules;
  std::vector<std::string> lines{"seed " + std::to_string(seed)};
  for (const Parameter& parameter : registry) {
    rules.push_back(rule_of(parameter));
    lines.push_back(rule_line(parameter, rules.back()));
  }
  require_same_lines(comm, lines, "ZeroOptimizer::initialize", "initialization rules", "Rule");
  for (const Piece& piece : held_pieces(registry, layout)) {
    Tensor target = arena_view(registry, piece);
    init::fill(target, piece.parameter->name(), piece.first, rules[piece.parameter->index()], seed);
  }
}

std::uint64_t checksum(const ParameterRegistry& registry, comm::Communicator& comm, const ShardLayout& layout) {
  const std::vector<Piece> pieces = written_pieces(registry, layout, comm.rank());
  std::uint64_t total = 0;
  for (const std::uint64_t sum : tensor_checksums(registry, comm, pieces, [&](std::size_t k) { return arena_view(registry, pieces[k]); })) {
    total += sum;
  }
  return total;
}

void require_same_pieces(const ParameterRegistry& registry, comm::Communicator& replicas, const ShardLayout& layout,
                         const std::string& who) {
  std::vector<std::uint64_t> sums(registry.size(), 0);
  for (const Piece& piece : held_pieces(registry, layout)) {
    sums[piece.parameter->index()] += io::piece_checksum(piece.parameter->name(), piece.first, arena_view(registry, piece));
  }
  std::vector<std::string> lines;
  for (const Parameter& parameter : registry) {
    lines.push_back("'" + parameter.name() + "': pieces' checksum " + io::hex_digest(sums[parameter.index()]));
  }
  require_same_lines(replicas, lines, who, "pieces across the shard groups", "Parameter");
}

void save(const ParameterRegistry& registry, comm::Communicator& comm, const ShardLayout& layout,
          const std::filesystem::path& path, const io::Metadata& metadata) {
  const std::string who = "ZeroOptimizer::save_model('" + path.string() + "')";
  GRADSYNC_CHECK(!metadata.contains(kChecksumsKey), who, ": the metadata key '", kChecksumsKey, "' is gradsync's own");
  const std::vector<Piece> pieces = written_pieces(registry, layout, comm.rank());
  // Every element written by exactly one rank, or the file would hold zeros: the counts agree.
  Tensor counts = Tensor::zeros({static_cast<std::int64_t>(registry.size())}, DType::i64);
  for (const Piece& piece : pieces) counts.data_as<std::int64_t>()[piece.parameter->index()] += piece.count;
  if (comm.size() > 1) comm.allreduce_host(counts, comm::ReduceOp::sum);
  for (const Parameter& parameter : registry) {
    GRADSYNC_CHECK(counts.data_as<std::int64_t>()[parameter.index()] == parameter.numel(), who, ": the ranks' pieces of '",
                   parameter.name(), "' cover ", counts.data_as<std::int64_t>()[parameter.index()], " of its ",
                   parameter.numel(), " elements");
  }
  const std::vector<std::uint64_t> sums =
      tensor_checksums(registry, comm, pieces, [&](std::size_t k) { return arena_view(registry, pieces[k]); });
  json checksums = json::object();
  std::vector<io::TensorSpec> specs;
  for (const Parameter& parameter : registry) {
    checksums[parameter.name()] = io::hex_digest(sums[parameter.index()]);
    specs.push_back({parameter.name(), parameter.dtype(), parameter.shape()});
  }
  io::Metadata with_checksums = metadata;
  with_checksums[kChecksumsKey] = checksums.dump();
  io::SafetensorsPieceWriter file(path, std::move(specs), std::move(with_checksums));
  // Each rank computes the offsets it writes at from its own header: they must be rank 0's (the
  // same metadata everywhere), or pieces would land in the wrong places.
  require_same_lines(comm, {"header of " + std::to_string(file.layout().head.size()) + " bytes, XXH64 " +
                            io::hex_digest(io::xxh64(file.layout().head.data(), file.layout().head.size()))},
                     who, "file headers (is the metadata the same on every rank?)", "Header");

  std::string temporary;
  comm::agree(comm, who + ", creating the file", [&] {
    if (comm.rank() == 0) temporary = file.create().string();
  });
  if (comm.size() > 1) temporary = broadcast_bytes(comm, temporary, 0);
  comm::agree(comm, who + ", writing the pieces", [&] {
    if (comm.rank() != 0) file.open(temporary);
    for (const Piece& piece : pieces) file.write(piece.parameter->name(), piece.first, arena_view(registry, piece));
    file.flush();
  });
  comm::agree(comm, who + ", renaming the file into place", [&] {
    if (comm.rank() == 0) file.commit();
  });
}

void load(ParameterRegistry& registry, comm::Communicator& comm, const ShardLayout& layout,
          const std::filesystem::path& model) {
  const std::string who = "ZeroOptimizer::load_model('" + model.string() + "')";
  const std::vector<Piece> held = held_pieces(registry, layout);
  std::unique_ptr<io::SafetensorsSet> set;
  std::vector<std::string> entries;  // what this rank's file says of each parameter
  comm::agree(comm, who + ", opening", [&] {
    set = std::make_unique<io::SafetensorsSet>(model);
    for (const Parameter& parameter : registry) {
      const io::TensorInfo* info = set->find(parameter.name());
      GRADSYNC_CHECK(info != nullptr, model.string(), ": has no tensor '", parameter.name(), "'");
      const std::string where = set->file_of(parameter.name()).path().string();
      GRADSYNC_CHECK(info->shape == parameter.shape(), where, ": '", parameter.name(), "' is ",
                     shape_str(info->shape), ", the model's parameter ", shape_str(parameter.shape()));
      GRADSYNC_CHECK(info->dtype && is_floating(*info->dtype) == is_floating(parameter.dtype()), where, ": '",
                     parameter.name(), "' is ", info->dtype_label(), ", which does not load into a ",
                     dtype_name(parameter.dtype()), " parameter");
      entries.push_back(parameter.name() + " " + info->stored_dtype + " " + shape_str(info->shape) + " " +
                        std::to_string(info->data_begin) + " in " + set->file_of(parameter.name()).path().filename().string());
    }
  });
  // Every rank must read the same model: the entries (and so the files' layouts) compared.
  require_same_lines(comm, entries, who, "model file entries", "Entry");

  // This rank's pieces, read in the file's dtype (the checksums are of the stored bits).
  std::vector<Tensor> read(held.size());
  comm::agree(comm, who + ", reading", [&] {
    for (std::size_t k = 0; k < held.size(); ++k) read[k] = set->read_range(held[k].parameter->name(), held[k].first, held[k].count);
  });
  // The file's checksums, when it has them, against the pieces read: the written pieces (one
  // rank each) are views of the held ones.
  const auto stored = set->metadata().find(kChecksumsKey);
  if (stored != set->metadata().end()) {
    const json expected = json::parse(stored->second, nullptr, /*allow_exceptions=*/false);
    GRADSYNC_CHECK(expected.is_object(), who, ": its metadata '", kChecksumsKey, "' is not a JSON object");
    const std::vector<Piece> written = written_pieces(registry, layout, comm.rank());
    const auto data_of = [&](std::size_t k) {
      const Piece& piece = written[k];
      for (std::size_t h = 0; h < held.size(); ++h) {
        const Piece& outer = held[h];
        if (outer.parameter == piece.parameter && outer.first <= piece.first && piece.first + piece.count <= outer.first + outer.count) {
          return read[h].view(static_cast<std::size_t>(piece.first - outer.first), {piece.count});
        }
      }
      detail::throw_error(who, ": no piece read holds elements [", piece.first, ", ", piece.first + piece.count,
                          ") of '", piece.parameter->name(), "'");
    };
    const std::vector<std::uint64_t> sums = tensor_checksums(registry, comm, written, data_of);
    for (const Parameter& parameter : registry) {
      const std::string found = io::hex_digest(sums[parameter.index()]);
      const auto entry = expected.find(parameter.name());
      GRADSYNC_CHECK(entry != expected.end() && entry->is_string(), who, ": its metadata '", kChecksumsKey,
                     "' has no checksum of '", parameter.name(), "'");
      GRADSYNC_CHECK(entry->get<std::string>() == found, set->file_of(parameter.name()).path().string(), ": '",
                     parameter.name(), "' is damaged: its checksum is ", found, ", the file's metadata says ",
                     entry->get<std::string>(), " (nothing was loaded)");
    }
  }
  // Everything read and verified on every rank: now, and only now, the values change.
  for (std::size_t k = 0; k < held.size(); ++k) {
    Tensor target = arena_view(registry, held[k]);
    const Tensor converted = read[k].dtype() == target.dtype() ? read[k] : read[k].to(target.dtype());
    target.copy_from(converted.to(target.device()));
  }
}

}  // namespace gradsync::dist::zero_model
