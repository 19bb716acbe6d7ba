// CPU optimizer updates: one pass per segment, each element's parameter, gradient and state
// read once and written once (src/kernels/optimizer_math.h holds the arithmetic).
//
// The loops are written so GCC vectorizes them: restrict-qualified pointers (the buffers are
// distinct arenas), the per-segment flags hoisted into template parameters so that the loop
// body has no branches left, and -fno-math-errno (meson.build) so that sqrt becomes a SIMD
// instruction. The segments are cut into pieces that run on all cores (core/parallel.h).
// bench_optimizers shows the result against memory bandwidth.
#include "../optimizer_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "../optimizer_math.h"
#include "../../core/parallel.h"
#include "../../core/isa.h"
#include <cstdlib>
#include <string_view>
#include <algorithm>
#include <type_traits>

#include "gradsync/core/error.h"
#include "gradsync/core/threads.h"
#include <vector>

namespace gradsync::kernels::cpu {

// The loops, twice: for the baseline ISA (where std::fma is an exact library call) and for
// AVX2+FMA (where it is one instruction and eight floats go per vector). Both round exactly
// alike, so results do not depend on the machine.
#define GRADSYNC_ISA_LOOPS "kernels/cpu/optimizer_loops.inc"
#include "core/isa_variants.inc"

namespace {

// All cores: every segment is cut into pieces (multiples of the 2048-element block the mixed
// precision loops use, at least 64 Ki elements) and the pieces run on the thread pool. Each
// element is still updated once by the same arithmetic, so the result is the single-thread
// result bit for bit, whatever the number of threads.
template <typename Segment>
std::vector<Segment> pieces_of(std::span<const Segment> segments) {
  std::int64_t total = 0;
  for (const Segment& segment : segments) total += segment.count;
  const std::int64_t threads = num_threads();
  constexpr std::int64_t kAlign = 2048, kMinimum = std::int64_t{1} << 16;
  std::int64_t piece = std::max<std::int64_t>(kMinimum, (total + threads - 1) / threads);
  piece = (piece + kAlign - 1) / kAlign * kAlign;
  std::vector<Segment> pieces;
  for (const Segment& segment : segments) {
    for (std::int64_t offset = 0; offset < segment.count; offset += piece) {
      Segment part = segment;
      part.begin = segment.begin + offset;
      part.count = std::min(piece, segment.count - offset);
      pieces.push_back(part);
    }
  }
  return pieces;
}

template <typename Segment, typename Run>
void run_pieces(std::span<const Segment> segments, Run run) {
  const std::vector<Segment> pieces = pieces_of(segments);
  parallel::for_each_task(static_cast<std::int64_t>(pieces.size()),
                          [&](std::int64_t i) { run(std::span<const Segment>(&pieces[static_cast<std::size_t>(i)], 1)); });
}

}  // namespace

void sgd_update(const UpdateBuffers& buffers, void* momentum, std::span<const SgdSegment> segments) {
  visit_update_types(buffers, "SGD", [&]<typename T, typename G, typename M>(T, G, M*) {
    run_pieces(segments, [&](std::span<const SgdSegment> piece) {
      GRADSYNC_ISA_DISPATCH(sgd_segments<T, G, M>)(buffers, momentum, piece);
    });
  });
}

void adam_update(const UpdateBuffers& buffers, void* exp_avg, void* exp_avg_sq, void* max_exp_avg_sq,
                 std::span<const AdamSegment> segments) {
  visit_update_types(buffers, "Adam", [&]<typename T, typename G, typename M>(T, G, M*) {
    run_pieces(segments, [&](std::span<const AdamSegment> piece) {
      GRADSYNC_ISA_DISPATCH(adam_segments<T, G, M>)(buffers, exp_avg, exp_avg_sq, max_exp_avg_sq, piece);
    });
  });
}

}  // namespace gradsync::kernels::cpu
