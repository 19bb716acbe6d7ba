// Internal: the files of a ZeRO sharded checkpoint set, and how a load proves them whole
// (docs/zero.md, "Sharded sets").
//
//   folder/manifest.json                  which set is in force, and what it must contain:
//     {"format": "gradsync-zero-set/2", "set": "set-7", "id": "7-<16 hex digits>",
//      "world": 2, "stage": 1, "checksum": "xxh64",
//      "pieces": [{"rank": 0, "file": "rank0.safetensors", "bytes": 5208, "xxh64": "<16 hex>"}, ...]}
//   folder/set-7/rank<R>.safetensors      rank R's pieces: tensors "zero.shard.<arena>.<buffer>"
//                                         (the packed state of its element ranges), and metadata
//                                         naming the set id, rank, world, stage and ranges, beside
//                                         the optimizer's own (type, groups, steps).
//
// The id (the set's number and a random nonce) ties every piece to the save that wrote it, so a
// piece copied in from another save is refused even where its size happens to match; the size
// and XXH64 (io/checksum.h) in the manifest find damaged bytes anywhere in a piece.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/io/safetensors.h"
#include "gradsync/optim/optimizer.h"

namespace gradsync::dist::zero_set {

// What the manifest says of one piece.
struct PieceRecord {
  std::string file;
  std::uint64_t bytes = 0;
  std::uint64_t xxh64 = 0;
};

struct Manifest {
  std::string set;  // the set's folder, "set-<n>"
  std::string id;   // "<n>-<nonce>", in every piece's metadata too
  int world = 0;    // ranks that saved it: one piece each
  int stage = 0;
  std::vector<PieceRecord> pieces;  // by rank
};

// The largest world a manifest may name.
inline constexpr std::int64_t kMaxWorld = std::int64_t{1} << 20;

std::string piece_file(int rank);                                  // "rank<R>.safetensors"
std::string shard_key(std::size_t arena, std::size_t buffer);      // "zero.shard.<arena>.<buffer>"
std::string values_key(std::size_t arena);                          // "zero.values.<arena>": stage 3's values
std::string manifest_text(const Manifest& manifest);               // the JSON rank 0 writes

// Reads folder/manifest.json: every field present, of its type and in range (a world of
// 4294967298 is not 2), one piece per rank. Errors name the file and the field.
Manifest read_manifest(const std::filesystem::path& folder);

// The metadata that makes a piece say what it is: the set id, rank, world, stage, its element
// ranges per arena, and the presence bits of every parameter's state.
void describe_piece(io::Metadata& metadata, const std::string& id, int rank, int world, int stage,
                    const std::vector<std::vector<optim::Optimizer::ElementRange>>& ranges, const std::string& present);

// One element range of a piece: [begin, end) of an arena, at `packed` in the piece's buffers.
struct PieceRange {
  std::size_t arena;
  std::int64_t begin, end, packed;
};

struct Piece {
  std::unique_ptr<io::SafetensorsReader> file;
  std::vector<PieceRange> ranges;
};

// Opens piece `rank` of the set the manifest names and checks it against the manifest and
// `optimizer`: that it is that set's piece for that rank and world, its ranges lie inside the
// optimizer's arenas without overlapping, its tensors are the state buffers of those ranges in
// the state dtype (and, saved at stage 3, the values of those ranges in the arena's dtype); with `verify_bytes`, also its size and checksum (a read of the whole file).
// Every error names the file and what is wrong.
Piece open_piece(const std::filesystem::path& folder, const Manifest& manifest, int rank,
                 const optim::Optimizer& optimizer, bool verify_bytes);

// The pieces of one set read together (a reshard): their ranges of an arena do not overlap,
// and they agree on the optimizer's metadata (type, groups, steps, state presence).
void check_consistent(const std::vector<Piece>& pieces);

}  // namespace gradsync::dist::zero_set
