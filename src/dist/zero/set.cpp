// The files of a ZeRO sharded set and their validation (set.h).
#include "set.h"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "gradsync/io/checksum.h"
#include "io/json_brief.h"

namespace gradsync::dist::zero_set {

namespace {

using json = nlohmann::json;

constexpr std::string_view kFormat = "gradsync-zero-set/2";
constexpr std::uintmax_t kMaxManifestBytes = std::uintmax_t{64} << 20;

// A JSON integer in [low, high], read as what it is: no wrap-around, no fractions, no strings.
std::int64_t integer_in(const json& value, std::int64_t low, std::int64_t high, const std::string& what) {
  const bool in_range = value.is_number_unsigned()   ? value.get<std::uint64_t>() <= static_cast<std::uint64_t>(high) &&
                                                           static_cast<std::int64_t>(value.get<std::uint64_t>()) >= low
                        : value.is_number_integer() ? value.get<std::int64_t>() >= low && value.get<std::int64_t>() <= high
                                                    : false;
  GRADSYNC_CHECK(in_range, what, " is ", io::brief(value), ", not an integer from ", low, " to ", high);
  return value.get<std::int64_t>();
}

// A metadata string holding an integer in [low, high], all of it.
std::int64_t integer_text(const io::Metadata& metadata, const std::string& key, std::int64_t low, std::int64_t high,
                          const std::string& where) {
  const auto found = metadata.find(key);
  GRADSYNC_CHECK(found != metadata.end(), where, ": no '", key, "' metadata (not a piece of a ZeRO set)");
  const std::string& text = found->second;
  std::int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  GRADSYNC_CHECK(error == std::errc() && end == text.data() + text.size() && value >= low && value <= high, where,
                 ": '", key, "' is '", text.substr(0, 40), "', not an integer from ", low, " to ", high);
  return value;
}

bool is_hex_digest(const std::string& text) {
  return text.size() == 16 && text.find_first_not_of("0123456789abcdef") == std::string::npos;
}

std::uint64_t parse_hex_digest(const std::string& text) {
  std::uint64_t value = 0;
  std::from_chars(text.data(), text.data() + text.size(), value, 16);
  return value;
}

const json& field(const json& object, const char* name, const std::string& where) {
  GRADSYNC_CHECK(object.contains(name), where, " has no \"", name, "\"");
  return object[name];
}

}  // namespace

std::string piece_file(int rank) { return "rank" + std::to_string(rank) + ".safetensors"; }

std::string shard_key(std::size_t arena, std::size_t buffer) {
  return "zero.shard." + std::to_string(arena) + "." + std::to_string(buffer);
}

std::string values_key(std::size_t arena) { return "zero.values." + std::to_string(arena); }

std::string manifest_text(const Manifest& manifest) {
  json pieces = json::array();
  for (std::size_t rank = 0; rank < manifest.pieces.size(); ++rank) {
    const PieceRecord& piece = manifest.pieces[rank];
    pieces.push_back({{"rank", rank}, {"file", piece.file}, {"bytes", piece.bytes}, {"xxh64", io::hex_digest(piece.xxh64)}});
  }
  const json text = {{"format", kFormat},        {"set", manifest.set},     {"id", manifest.id},
                     {"world", manifest.world},  {"stage", manifest.stage}, {"checksum", "xxh64"},
                     {"pieces", std::move(pieces)}};
  return text.dump(2) + "\n";
}

Manifest read_manifest(const std::filesystem::path& folder) {
  const std::filesystem::path path = folder / "manifest.json";
  const std::string where = path.string();
  std::error_code error;
  const std::uintmax_t size = std::filesystem::file_size(path, error);
  GRADSYNC_CHECK(!error, "no manifest.json in ", folder.string(),
                 " (not a sharded checkpoint, or its first save never completed)");
  GRADSYNC_CHECK(size <= kMaxManifestBytes, where, " is ", size, " bytes, more than a manifest can be");
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const json root = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  GRADSYNC_CHECK(!root.is_discarded() && root.is_object(), where, " is not a JSON object");

  GRADSYNC_CHECK(root.contains("format"), where,
                 " has no \"format\": a set saved before sets carried checksums; load it with the gradsync that "
                 "saved it and save it again");
  const json& format = root["format"];
  GRADSYNC_CHECK(format.is_string() && format.get<std::string>() == kFormat, where, ": format ", io::brief(format),
                 ", expected \"", kFormat, "\" (a set saved before checksums: load it with the gradsync that saved it "
                 "and save it again)");
  Manifest manifest;
  const json& set = field(root, "set", where);
  manifest.set = set.is_string() ? set.get<std::string>() : "";
  GRADSYNC_CHECK(manifest.set.size() > 4 && manifest.set.size() <= 24 && manifest.set.starts_with("set-") &&
                     manifest.set.find_first_not_of("0123456789", 4) == std::string::npos,
                 where, ": set ", io::brief(set), " is not a set folder's name (set-<n>)");
  const json& id = field(root, "id", where);
  manifest.id = id.is_string() ? id.get<std::string>() : "";
  GRADSYNC_CHECK(!manifest.id.empty() && manifest.id.size() <= 64, where, ": id ", io::brief(id),
                 " is not a set id");
  manifest.world = static_cast<int>(integer_in(field(root, "world", where), 1, kMaxWorld, where + ": world"));
  manifest.stage = static_cast<int>(integer_in(field(root, "stage", where), 1, 3, where + ": stage"));
  const json& checksum = field(root, "checksum", where);
  GRADSYNC_CHECK(checksum == "xxh64", where, ": checksum ", io::brief(checksum), ", expected \"xxh64\"");

  const json& pieces = field(root, "pieces", where);
  GRADSYNC_CHECK(pieces.is_array() && pieces.size() == static_cast<std::size_t>(manifest.world), where, ": ",
                 pieces.is_array() ? std::to_string(pieces.size()) : std::string("no list of"),
                 " pieces for a world of ", manifest.world, " (one per rank that saved)");
  manifest.pieces.resize(pieces.size());
  std::vector<bool> seen(pieces.size(), false);
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    const std::string entry = where + ": pieces[" + std::to_string(k) + "]";
    GRADSYNC_CHECK(pieces[k].is_object(), entry, " is not an object");
    const auto rank = static_cast<std::size_t>(integer_in(field(pieces[k], "rank", entry), 0, manifest.world - 1, entry + ".rank"));
    GRADSYNC_CHECK(!seen[rank], entry, ": rank ", rank, " has a piece already");
    seen[rank] = true;
    PieceRecord& record = manifest.pieces[rank];
    const json& file = field(pieces[k], "file", entry);
    GRADSYNC_CHECK(file == piece_file(static_cast<int>(rank)), entry, ": file ", io::brief(file), ", expected \"",
                   piece_file(static_cast<int>(rank)), "\"");
    record.file = piece_file(static_cast<int>(rank));
    record.bytes = static_cast<std::uint64_t>(
        integer_in(field(pieces[k], "bytes", entry), 8, std::numeric_limits<std::int64_t>::max(), entry + ".bytes"));
    const json& digest = field(pieces[k], "xxh64", entry);
    GRADSYNC_CHECK(digest.is_string() && is_hex_digest(digest.get<std::string>()), entry, ": xxh64 ",
                   io::brief(digest), " is not 16 lowercase hex digits");
    record.xxh64 = parse_hex_digest(digest.get<std::string>());
  }
  return manifest;
}

void describe_piece(io::Metadata& metadata, const std::string& id, int rank, int world, int stage,
                    const std::vector<std::vector<optim::Optimizer::ElementRange>>& ranges, const std::string& present) {
  json list = json::array();
  for (std::size_t a = 0; a < ranges.size(); ++a) {
    for (const auto& range : ranges[a]) list.push_back({a, range.begin, range.end});
  }
  metadata["zero.set"] = id;
  metadata["zero.rank"] = std::to_string(rank);
  metadata["zero.world"] = std::to_string(world);
  metadata["zero.stage"] = std::to_string(stage);
  metadata["zero.ranges"] = list.dump();
  metadata["zero.present"] = present;
}

Piece open_piece(const std::filesystem::path& folder, const Manifest& manifest, int rank,
                 const optim::Optimizer& optimizer, bool verify_bytes) {
  const std::filesystem::path path = folder / manifest.set / manifest.pieces.at(static_cast<std::size_t>(rank)).file;
  const PieceRecord& record = manifest.pieces[static_cast<std::size_t>(rank)];
  const std::string where = path.string();
  Piece piece;
  piece.file = std::make_unique<io::SafetensorsReader>(path);  // a damaged header is refused here
  const io::Metadata& metadata = piece.file->metadata();

  // Identity first: a piece of another save is the likeliest mix-up, and the clearest to name.
  const auto set = metadata.find("zero.set");
  GRADSYNC_CHECK(set != metadata.end(), where, ": no 'zero.set' metadata (not a piece of a ZeRO set)");
  GRADSYNC_CHECK(set->second == manifest.id, where, " belongs to set ", set->second.substr(0, 64), ", not to ",
                 manifest.id, ", the set the manifest names (a piece of another save)");
  const std::int64_t saved_rank = integer_text(metadata, "zero.rank", 0, kMaxWorld - 1, where);
  GRADSYNC_CHECK(saved_rank == rank, where, " is rank ", saved_rank, "'s piece, not rank ", rank, "'s");
  const std::int64_t saved_world = integer_text(metadata, "zero.world", 1, kMaxWorld, where);
  GRADSYNC_CHECK(saved_world == manifest.world, where, " was saved by ", saved_world, " rank(s), the manifest says ",
                 manifest.world);
  GRADSYNC_CHECK(integer_text(metadata, "zero.stage", 1, 3, where) == manifest.stage, where,
                 ": another ZeRO stage than the manifest's ", manifest.stage);
  for (const char* key : {"optimizer.type", "optimizer.groups", "optimizer.steps", "zero.present"}) {
    GRADSYNC_CHECK(metadata.contains(key), where, ": no '", key, "' metadata");
  }

  // The bytes: the size the manifest recorded, then the checksum.
  if (verify_bytes) {
    const io::FileChecksum found = io::checksum_file(path);
    GRADSYNC_CHECK(found.bytes == record.bytes, where, " has ", found.bytes, " bytes, the manifest recorded ",
                   record.bytes, " (truncated or replaced after the save)");
    GRADSYNC_CHECK(found.xxh64 == record.xxh64, where, ": XXH64 ", io::hex_digest(found.xxh64),
                   ", the manifest recorded ", io::hex_digest(record.xxh64), " (the file is damaged)");
  }

  // Its ranges: inside this optimizer's arenas, ascending and apart within each arena.
  const auto& arenas = optimizer.registry().arenas();
  const json ranges = json::parse(metadata.at("zero.ranges"), nullptr, /*allow_exceptions=*/false);
  GRADSYNC_CHECK(ranges.is_array(), where, ": 'zero.ranges' is not a JSON list");
  std::map<std::size_t, std::int64_t> packed;  // per arena: elements so far
  for (const json& range : ranges) {
    GRADSYNC_CHECK(range.is_array() && range.size() == 3, where, ": 'zero.ranges' entry ", io::brief(range),
                   " is not [arena, begin, end]");
    const std::string entry = where + ": range " + io::brief(range);
    const auto arena = static_cast<std::size_t>(
        integer_in(range[0], 0, static_cast<std::int64_t>(arenas.size()) - 1, entry + ": arena"));
    const std::int64_t elements = arenas[arena].values.numel();
    const std::int64_t begin = integer_in(range[1], 0, elements, entry + ": begin");
    const std::int64_t end = integer_in(range[2], begin + 1, elements, entry + ": end");
    GRADSYNC_CHECK(piece.ranges.empty() || piece.ranges.back().arena < arena || piece.ranges.back().end <= begin,
                   entry, " overlaps or precedes the range before it");
    piece.ranges.push_back({arena, begin, end, packed[arena]});
    packed[arena] += end - begin;
  }

  // Its tensors: state buffers of the arenas it has ranges in, each holding those ranges; at
  // stage 3 also the values of those ranges (no rank holds them whole).
  const std::size_t buffers = optimizer.state_buffer_names().size();
  std::size_t expected = 0;
  for (const auto& [arena, count] : packed) {
    if (manifest.stage == 3) {
      const io::TensorInfo* values = piece.file->find(values_key(arena));
      GRADSYNC_CHECK(values != nullptr, where, ": no '", values_key(arena), "' (a stage-3 piece holds the values of its ranges)");
      GRADSYNC_CHECK(values->dtype == arenas[arena].dtype && values->shape == Shape{count}, where, ": '", values->name,
                     "' is ", values->dtype_label(), shape_str(values->shape), ", its ranges need ",
                     dtype_name(arenas[arena].dtype), shape_str(Shape{count}));
      ++expected;
    }
    for (std::size_t b = 0; b < buffers; ++b) {
      const io::TensorInfo* tensor = piece.file->find(shard_key(arena, b));
      if (tensor == nullptr) continue;  // a buffer no parameter of this arena has yet
      ++expected;
      GRADSYNC_CHECK(tensor->dtype == optimizer.state_dtype(arena) && tensor->shape == Shape{count}, where, ": '",
                     tensor->name, "' is ", tensor->dtype_label(), shape_str(tensor->shape), ", its ranges need ",
                     dtype_name(optimizer.state_dtype(arena)), shape_str(Shape{count}));
    }
  }
  GRADSYNC_CHECK(piece.file->tensors().size() == expected, where, " holds ", piece.file->tensors().size() - expected,
                 " tensor(s) that are not state buffers (or values) of its ranges");
  return piece;
}

void check_consistent(const std::vector<Piece>& pieces) {
  std::vector<std::pair<const PieceRange*, std::size_t>> all;  // range, its piece
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    for (const PieceRange& range : pieces[k].ranges) all.emplace_back(&range, k);
    for (const char* key : {"optimizer.type", "optimizer.groups", "optimizer.steps", "zero.present"}) {
      GRADSYNC_CHECK(pieces[k].file->metadata().at(key) == pieces[0].file->metadata().at(key),
                     pieces[k].file->path().string(), ": '", key, "' differs from ", pieces[0].file->path().string(),
                     "'s (pieces of one set record the same optimizer state)");
    }
  }
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
    return std::tie(a.first->arena, a.first->begin) < std::tie(b.first->arena, b.first->begin);
  });
  for (std::size_t k = 1; k < all.size(); ++k) {
    const PieceRange& before = *all[k - 1].first;
    const PieceRange& range = *all[k].first;
    GRADSYNC_CHECK(before.arena != range.arena || before.end <= range.begin, pieces[all[k].second].file->path().string(),
                   ": elements ", range.begin, "..", range.end, " of arena ", range.arena, " are also in ",
                   pieces[all[k - 1].second].file->path().string());
  }
}

}  // namespace gradsync::dist::zero_set
