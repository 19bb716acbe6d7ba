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

namespace baseline {
#include "conversion_loops.inc"
}  // namespace baseline

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define GRADSYNC_F16C 1
namespace avx2 {
#include "conversion_loops.inc"

// f32 -> bf16 over large arrays: the same rounding as float_to_bf16_bits, eight at a time,
// written with non-temporal stores so that the destination's cache lines are not read first
// (a cast of a buffer larger than the caches moves 6 bytes per element instead of 8).
void narrow_bf16_streaming(const float* source, std::uint16_t* destination, std::int64_t n) {
  std::int64_t i = 0;
  for (; i < n && (reinterpret_cast<std::uintptr_t>(destination + i) % 32) != 0; ++i) {
    destination[i] = float_to_bf16_bits(source[i]);
  }
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), nan_bits = _mm256_set1_epi32(0x7FC0);
  const auto narrow8 = [&](const float* from) {
    const __m256 x = _mm256_loadu_ps(from);
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, bias), odd), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, nan_bits, nan);  // 32-bit lanes holding 16-bit results
  };
  for (; i + 16 <= n; i += 16) {
    const __m256i a = narrow8(source + i), b = narrow8(source + i + 8);
    // Pack the two sets of eight 32-bit lanes into sixteen 16-bit values, in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(destination + i), packed);
  }
  for (; i < n; ++i) destination[i] = float_to_bf16_bits(source[i]);
  _mm_sfence();
}
}  // namespace avx2
#undef GRADSYNC_F16C
#pragma GCC pop_options
#endif

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
