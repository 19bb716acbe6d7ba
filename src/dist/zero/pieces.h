// Internal: a rank's pieces of a ZeRO state, put back into the optimizer. The same assembly
// serves a sharded set's files (checkpoint.cpp's load_sharded) and a peer's memory (fault
// tolerance's recovery by pieces: the rank at place p of a live replica group sends its pieces
// to the rank at place p of a newcomer group, whose layout is the same).
//
// A piece is the packed state of its element ranges ("zero.shard.<arena>.<buffer>"), its pieces
// of the values ("zero.values.<arena>"), and metadata: the optimizer's own (type, groups, steps),
// "zero.ranges" and "zero.present" (set.h).
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint.h"
#include "set.h"

namespace gradsync::dist {

// One piece as the assembly reads it: from a file of a set, or from a peer's tensors.
struct PieceView {
  const io::Metadata* metadata = nullptr;
  std::string where;  // for errors: the file, or the peer
  std::vector<zero_set::PieceRange> ranges;
  std::function<Tensor(const std::string& key)> read;
};
std::vector<PieceView> views_of(const std::vector<zero_set::Piece>& pieces);

// The state load_state takes from verified pieces: per parameter touching this rank's ranges, a
// full-shape tensor with the pieces' elements filled in (Optimizer::load_state keeps only the
// owned elements), and the presence of the others' state as metadata.
void assemble(const optim::Optimizer& optimizer, const ShardLayout& layout, const std::vector<PieceView>& pieces,
              std::vector<io::NamedTensor>& tensors, io::Metadata& metadata);

// This rank's pieces of an arena's values, packed in the order of its ranges (as
// Optimizer::shard_state packs the optimizer's buffers).
Tensor owned_values(const optim::Optimizer& optimizer, const ShardLayout& layout, std::size_t arena);

// The values pieces hold, for the arenas: at stage 3 this rank's ranges, below it every range of
// the pieces (the values are whole there). Read before anything is loaded (a read that fails
// leaves the model as it was); copied in by apply_values once the state is in.
struct ValuesRun {
  std::size_t arena;
  std::int64_t begin;
  Tensor data;
};
std::vector<ValuesRun> read_values(const ShardLayout& layout, const std::vector<PieceView>& pieces);
void apply_values(optim::Optimizer& optimizer, const std::vector<ValuesRun>& runs);

// "zero.present": which state buffers each trainable parameter has (a JSON object of bit sets).
std::string presence_of(const optim::Optimizer& optimizer);

// This rank's pieces for a peer at the same place of another replica: the packed state of its
// ranges, its pieces of the values (every stage), the frozen parameters whole ("zero.frozen.
// <name>": never sharded), and the metadata that says what they are.
// About 1/S of the group's state for S ranks. The state buffers are the live ones, not copies
// (a recovery reads them before the next step; a copy would double the rank's state for it).
ZeroOptimizer::State own_pieces(const optim::Optimizer& optimizer, const ShardLayout& layout);
// Checks `pieces` (from own_pieces on a peer) against this rank's layout (the same stage and
// ranges, every tensor of its size and dtype, nothing else, the optimizer's check_state) and
// prepares what loading them takes, changing nothing; adopt_pieces then loads the state and
// writes this rank's pieces of the values. Not collective: the caller agrees on the checks
// before any rank adopts and, below stage 3, gathers the values after.
struct CheckedPieces {
  std::vector<io::NamedTensor> tensors;  // for Optimizer::load_state
  io::Metadata metadata;
  std::vector<ValuesRun> values;
  std::vector<std::pair<std::string, Tensor>> frozen;  // frozen parameters' whole values, by name
};
CheckedPieces check_pieces(const optim::Optimizer& optimizer, const ShardLayout& layout, const ZeroOptimizer::State& pieces,
                           const std::string& origin);
void adopt_pieces(optim::Optimizer& optimizer, const CheckedPieces& pieces, const std::string& origin);

}  // namespace gradsync::dist
