// Internal: which instruction set the CPU loops use. The loops that matter are compiled twice,
// for baseline x86-64 and for AVX2+FMA (+F16C, which every AVX2 CPU has), each copy in its own namespace, and this picks one at
// run time. Both copies round exactly alike (no contraction; std::fma is exact either way), so
// results do not depend on the machine.
#pragma once

#include "environment.h"

namespace gradsync::detail {

// GRADSYNC_CPU_ISA=baseline forces the baseline loops (the test suite runs the optimizer
// trajectories both ways to prove they agree to the bit).
inline bool cpu_has_avx2_fma() {
#if defined(__x86_64__)
  static const bool supported = [] {
    if (environment::baseline_cpu_isa()) return false;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return supported;
#else
  return false;
#endif
}

// Calls the AVX2 or the baseline instantiation: GRADSYNC_ISA_DISPATCH(function<Args>)(arguments).
#if defined(__x86_64__)
#define GRADSYNC_ISA_DISPATCH(...) (::gradsync::detail::cpu_has_avx2_fma() ? avx2::__VA_ARGS__ : baseline::__VA_ARGS__)
#else
#define GRADSYNC_ISA_DISPATCH(...) (baseline::__VA_ARGS__)
#endif

}  // namespace gradsync::detail
