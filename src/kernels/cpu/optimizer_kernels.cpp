// CPU optimizer updates: one pass per segment, each element's parameter, gradient and state
// read once and written once (src/kernels/optimizer_math.h holds the arithmetic).
//
// The loops are written so GCC vectorizes them: restrict-qualified pointers (the buffers are
// distinct arenas), the per-segment flags hoisted into template parameters so that the loop
// body has no branches left, and -fno-math-errno (meson.build) so that sqrt becomes a SIMD
// instruction. bench_optimizers shows the result against memory bandwidth.
#include "../optimizer_kernels.h"

#include "../optimizer_math.h"
#include <cstdlib>
#include <string_view>
#include <algorithm>
#include <type_traits>

#include "gradsync/core/error.h"

namespace gradsync::kernels::cpu {

// The loops, twice: for the baseline ISA (where std::fma is an exact library call) and for
// AVX2+FMA (where it is one instruction and eight floats go per vector). Both round exactly
// alike, so results do not depend on the machine.
namespace baseline {
#include "optimizer_loops.inc"
}  // namespace baseline

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "optimizer_loops.inc"
}  // namespace avx2
#pragma GCC pop_options
#endif

namespace {

// GRADSYNC_CPU_ISA=baseline forces the baseline loops (the test suite runs the torch.optim
// trajectories both ways to prove they agree to the bit).
bool cpu_has_avx2_fma() {
#if defined(__x86_64__)
  static const bool supported = [] {
    const char* forced = std::getenv("GRADSYNC_CPU_ISA");
    if (forced != nullptr && std::string_view(forced) == "baseline") return false;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return supported;
#else
  return false;
#endif
}

}  // namespace

void sgd_update(const UpdateBuffers& buffers, void* momentum, std::span<const SgdSegment> segments) {
  visit_update_types(buffers, "SGD", [&]<typename T, typename G, typename M>(T, G, M*) {
#if defined(__x86_64__)
    if (cpu_has_avx2_fma()) return avx2::sgd_segments<T, G, M>(buffers, momentum, segments);
#endif
    baseline::sgd_segments<T, G, M>(buffers, momentum, segments);
  });
}

void adam_update(const UpdateBuffers& buffers, void* exp_avg, void* exp_avg_sq, void* max_exp_avg_sq,
                 std::span<const AdamSegment> segments) {
  visit_update_types(buffers, "Adam", [&]<typename T, typename G, typename M>(T, G, M*) {
#if defined(__x86_64__)
    if (cpu_has_avx2_fma()) return avx2::adam_segments<T, G, M>(buffers, exp_avg, exp_avg_sq, max_exp_avg_sq, segments);
#endif
    baseline::adam_segments<T, G, M>(buffers, exp_avg, exp_avg_sq, max_exp_avg_sq, segments);
  });
}

}  // namespace gradsync::kernels::cpu
