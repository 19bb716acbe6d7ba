// Element conversions between dtypes (convert.h): the CPU loops, and the dispatch by device.
//
// The loops run on all cores (parallel.h), one chunk per thread. f32 <-> f16/bf16 go through the
// raw-bits loops of conversion_loops.inc, compiled for baseline x86-64 and for AVX2 (isa.h);
// every other pair element by element through element.h's convert(), the one rounding rule.
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <type_traits>

#include "convert.h"
#include "element.h"
#include "gradsync/config.h"
#include "gradsync/core/error.h"
#include "isa.h"
#include "parallel.h"

namespace gradsync::detail {

namespace {

#define GRADSYNC_ISA_LOOPS "core/conversion_loops.inc"
#include "isa_variants.inc"

// One chunk per thread, at least 256 Ki elements each (smaller conversions stay on the calling
// thread), boundaries on 64-element multiples: the kernels' element-wise rule.
constexpr std::int64_t kGrain = std::int64_t{1} << 18;
// Casts to bf16 of at least this many elements (per thread) bypass the cache on the way out.
constexpr std::int64_t kStreamingElements = std::int64_t{1} << 20;

void convert_on_cpu(const void* source, DType source_dtype, void* destination, DType destination_dtype, std::int64_t n) {
  visit_dtype(source_dtype, [&]<typename S>(S) {
    visit_dtype(destination_dtype, [&]<typename D>(D) {
      parallel::parallel_for(n, kGrain, 64, [&](std::int64_t begin, std::int64_t end) {
        const void* from = static_cast<const S*>(source) + begin;
        void* to = static_cast<D*>(destination) + begin;
#if defined(__x86_64__)
        if constexpr (std::is_same_v<S, float> && std::is_same_v<D, BFloat16>) {
          if (end - begin >= kStreamingElements && cpu_has_avx2_fma()) {
            return avx2::narrow_bf16_streaming(static_cast<const float*>(from), static_cast<std::uint16_t*>(to),
                                               end - begin);
          }
        }
#endif
        GRADSYNC_ISA_DISPATCH(cast_loop<S, D>)(from, to, end - begin);
      });
    });
  });
}

}  // namespace

void convert_elements(const void* source, DType source_dtype, void* destination, DType destination_dtype,
                      std::int64_t n, Device device) {
  if (n == 0) return;
  if (device.is_cpu()) return convert_on_cpu(source, source_dtype, destination, destination_dtype, n);
#if GRADSYNC_WITH_CUDA
  cuda::convert_elements(device, source, source_dtype, destination, destination_dtype, n);
#else
  throw_error("converting ", dtype_name(source_dtype), " to ", dtype_name(destination_dtype), " on ", device.str(),
              ": gradsync was built without CUDA");
#endif
}

}  // namespace gradsync::detail
