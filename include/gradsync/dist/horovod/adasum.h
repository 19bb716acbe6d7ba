// gradsync/dist/horovod/adasum.h - Adasum: an adaptive sum of gradients (or of optimizer deltas).
//
//   Adasum(a, b) = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b
//
// Orthogonal vectors add (a + b), equal vectors stay (a), parallel ones average: it sums
// what is new and averages what is shared. A coefficient is 1 when its vector's squared norm
// is below sqrt(DBL_MIN), so zeros and denormals stay stable. Over 2^k ranks the pairs form a
// binary tree by rank bits: (0,1), (2,3), then ((0,1),(2,3)), ...
//
// adasum_allreduce runs it with Horovod's vector-halving, distance-doubling algorithm
// (docs/semantics/horovod.md section 4), built on the Communicator's send/recv:
//   reduce-scatter: for level = 1, 2, ..., p/2 the partner is rank ^ level; the pair splits
//     its current region in halves, the lower rank keeping the first. Each side sends the
//     half it gives up, and computes per tensor the partial dot product and squared norms on
//     the half it keeps, "a" always being the lower side's vector. The partials are summed
//     over the 2*level ranks that hold the other slices of the same pair of operands (by
//     recursive doubling, adding in rank order so every rank gets identical bits), and each
//     rank combines its slice with the resulting coefficients;
//   allgather: the levels in reverse, the partners exchanging their regions.
// It is per tensor even inside a fused bucket: `segments` lists (element offset, count) of
// each tensor in the flat buffer. Arithmetic is in f64 (dot products and norms as Horovod,
// and the combination too); f16/bf16/f32 buffers are converted once on the way in and out.
// Power-of-two world sizes only, as Horovod on CPUs.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "gradsync/comm/communicator.h"
#include "gradsync/dist/reducer/reducer.h"

namespace gradsync::dist {

using Segments = std::vector<std::pair<std::int64_t, std::int64_t>>;  // (offset, count) per tensor

// a <- Adasum(a, b), element-wise on one tensor pair (the formula above; the reference for tests).
void adasum_combine(Tensor& a, const Tensor& b);

// In place, on every rank's `flat`; blocking. An error names the world size when it is not a
// power of two, or the dtype when it is an integer.
void adasum_allreduce(comm::Communicator& comm, Tensor& flat, const Segments& segments);

// The Reducer hook that reduces each bucket with adasum_allreduce, per member tensor. It runs
// on the caller's thread (Adasum's many small exchanges do not overlap with the backward).
ReduceHook adasum_hook();

}  // namespace gradsync::dist
