// Internal: ZeRO's fourth room, the model without a gather (gradsync/dist/zero/zero.h).
//
// Contract. Which elements of each parameter's value this rank holds: at stage 3 a trainable
// parameter's intersections with this rank's ranges (its pieces), below stage 3 all of it (the
// values are whole there); a frozen parameter, never sharded, all of it everywhere. Which it
// writes to a file: a trainable parameter's intersections with its ranges at every stage (a
// partition of every trainable element over the ranks), a frozen one on rank 0 only. On them:
//  * initialize: the ranks' seed and rules compared first (a line each, with a function rule's
//    values at three indices), then init::fill over the held pieces;
//  * load_model: the file or set opened and its entries compared across ranks, this rank's
//    pieces read into buffers of their own and checked (names, shapes, dtypes, the file's
//    per-tensor checksums when it has them), agreed, and only then copied in: all or nothing;
//  * save_model: per-tensor checksums (each rank's written pieces, one allreduce), rank 0
//    creates the file's temporary, every rank writes its pieces at their offsets and flushes,
//    rank 0 renames it; each phase agreed, so a failure anywhere is an error on every rank and
//    the previous file stays.
// It reads and writes the arenas directly: a released unit's members have no value() to give.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

#include "gradsync/dist/zero/zero.h"
#include "checkpoint.h"

namespace gradsync::dist::zero_model {

// The metadata key of the per-tensor checksums (a JSON object: name -> 16 hex digits).
inline constexpr const char* kChecksumsKey = "gradsync.checksums";

// Each is collective over `comm` (the ZeroOptimizer's own); the gathers must have landed and, at
// stage 3 for initialize and load, every unit be released (the ZeroOptimizer sees to both).
void initialize(ParameterRegistry& registry, comm::Communicator& comm, const ShardLayout& layout,
                const std::function<init::Rule(const Parameter&)>& rule_of, std::uint64_t seed);
void load(ParameterRegistry& registry, comm::Communicator& comm, const ShardLayout& layout,
          const std::filesystem::path& model);
void save(const ParameterRegistry& registry, comm::Communicator& comm, const ShardLayout& layout,
          const std::filesystem::path& path, const io::Metadata& metadata);
std::uint64_t checksum(const ParameterRegistry& registry, comm::Communicator& comm, const ShardLayout& layout);
// HSDP: the ranks of `replicas` hold the same pieces; this compares each parameter's checksum of
// them (the replicas' check without moving a value), an error on every rank naming the first
// parameter that differs. Collective over `replicas`.
void require_same_pieces(const ParameterRegistry& registry, comm::Communicator& replicas, const ShardLayout& layout,
                         const std::string& who);

}  // namespace gradsync::dist::zero_model
