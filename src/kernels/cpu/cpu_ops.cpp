// CPU kernels behind gradsync::ops.
//
// Every operation runs on all cores (core/parallel.h): element-wise ones split the range into
// one chunk per thread; reductions cut it into fixed 1 Mi-element chunks whose partial sums
// are added in chunk order, so the result does not depend on the number of threads. Within a
// chunk: f32 and f64 element-wise arithmetic goes through Eigen array maps; the reductions are
// loops compiled for baseline x86-64 and for AVX2 (ops_loops.inc, core/isa.h); everything else
// is plain loops over load()/store(). Casts are core's (core/convert.h).
#include <Eigen/Core>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "../../core/parallel.h"
#include "../../core/element.h"
#include "../kernels.h"
#include "../../core/isa.h"

namespace gradsync::kernels::cpu {

#define GRADSYNC_ISA_LOOPS "kernels/cpu/ops_loops.inc"
#include "core/isa_variants.inc"

namespace {

template <typename T>
constexpr bool uses_eigen = std::is_same_v<T, float> || std::is_same_v<T, double>;

template <typename T>
using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>, Eigen::Aligned16>;
template <typename T>
using ConstArrayMap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

// Eigen's aligned map needs 16-byte alignment; views into arenas have it, but a user's
// wrapped buffer might not, so fall back to the unaligned map there.
template <typename T, typename Fn>
void with_map(void* data, std::int64_t n, Fn&& fn) {
  if (reinterpret_cast<std::uintptr_t>(data) % 16 == 0) {
    ArrayMap<T> map(static_cast<T*>(data), n);
    fn(map);
  } else {
    Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> map(static_cast<T*>(data), n);
    fn(map);
  }
}

// Element-wise work: one chunk per thread, at least 256 Ki elements each (smaller operations
// stay on the calling thread), boundaries on 64-element multiples.
constexpr std::int64_t kElementwiseGrain = std::int64_t{1} << 18;

template <typename Body>
void elementwise(std::int64_t n, Body body) {
  parallel::parallel_for(n, kElementwiseGrain, 64, [&](std::int64_t begin, std::int64_t end) { body(begin, end - begin); });
}

// Reductions: fixed chunks, partials combined in chunk order.
constexpr std::int64_t kReductionChunk = std::int64_t{1} << 20;

template <typename Result, typename Chunk, typename Combine>
Result reduce_chunks(std::int64_t n, Chunk chunk, Combine combine) {
  const std::int64_t chunks = std::max<std::int64_t>(1, (n + kReductionChunk - 1) / kReductionChunk);
  std::vector<Result> partials(static_cast<std::size_t>(chunks));
  parallel::for_each_task(chunks, [&](std::int64_t c) {
    const std::int64_t begin = c * kReductionChunk;
    partials[static_cast<std::size_t>(c)] = chunk(begin, std::min(n, begin + kReductionChunk) - begin);
  });
  Result total = partials[0];
  for (std::size_t c = 1; c < partials.size(); ++c) total = combine(total, partials[c]);
  return total;
}

template <typename T>
T* offset(void* base, std::int64_t elements) {
  return static_cast<T*>(base) + elements;
}
template <typename T>
const T* offset(const void* base, std::int64_t elements) {
  return static_cast<const T*>(base) + elements;
}

}  // namespace

void fill(void* x, DType dtype, std::int64_t n, double value) {
  visit_dtype(dtype, [&]<typename T>(T) {
    const T element = convert<T>(value);
    elementwise(n, [&](std::int64_t begin, std::int64_t count) {
      T* data = offset<T>(x, begin);
      std::fill(data, data + count, element);
    });
  });
}

void scale(void* x, DType dtype, std::int64_t n, double alpha) {
  visit_dtype(dtype, [&]<typename T>(T) {
    elementwise(n, [&](std::int64_t begin, std::int64_t count) {
      if constexpr (uses_eigen<T>) {
        with_map<T>(offset<T>(x, begin), count, [&](auto& map) { map *= static_cast<T>(alpha); });
      } else {
        using C = compute_t<T>;
        const C factor = static_cast<C>(alpha);
        T* data = offset<T>(x, begin);
        for (std::int64_t i = 0; i < count; ++i) data[i] = store<T>(load(data[i]) * factor);
      }
    });
  });
}

void axpy(double alpha, const void* x, void* y, DType dtype, std::int64_t n) {
  visit_dtype(dtype, [&]<typename T>(T) {
    elementwise(n, [&](std::int64_t begin, std::int64_t count) {
      if constexpr (uses_eigen<T>) {
        ConstArrayMap<T> source(offset<T>(x, begin), count);
        with_map<T>(offset<T>(y, begin), count, [&](auto& target) { target += static_cast<T>(alpha) * source; });
      } else {
        using C = compute_t<T>;
        const C factor = static_cast<C>(alpha);
        const T* source = offset<T>(x, begin);
        T* target = offset<T>(y, begin);
        for (std::int64_t i = 0; i < count; ++i) target[i] = store<T>(load(target[i]) + factor * load(source[i]));
      }
    });
  });
}

void add(const void* a, const void* b, void* out, DType dtype, std::int64_t n) {
  visit_dtype(dtype, [&]<typename T>(T) {
    elementwise(n, [&](std::int64_t begin, std::int64_t count) {
      if constexpr (uses_eigen<T>) {
        ConstArrayMap<T> left(offset<T>(a, begin), count);
        ConstArrayMap<T> right(offset<T>(b, begin), count);
        with_map<T>(offset<T>(out, begin), count, [&](auto& result) { result = left + right; });
      } else {
        const T* left = offset<T>(a, begin);
        const T* right = offset<T>(b, begin);
        T* result = offset<T>(out, begin);
        for (std::int64_t i = 0; i < count; ++i) result[i] = store<T>(load(left[i]) + load(right[i]));
      }
    });
  });
}

double dot(const void* a, const void* b, DType dtype, std::int64_t n) {
  return visit_dtype(dtype, [&]<typename T>(T) -> double {
    return reduce_chunks<double>(
        n,
        [&](std::int64_t begin, std::int64_t count) {
          return GRADSYNC_ISA_DISPATCH(dot_loop<T>)(offset<T>(a, begin), offset<T>(b, begin), count);
        },
        [](double x, double y) { return x + y; });
  });
}

double squared_norm(const void* x, DType dtype, std::int64_t n) {
  return visit_dtype(dtype, [&]<typename T>(T) -> double {
    return reduce_chunks<double>(
        n,
        [&](std::int64_t begin, std::int64_t count) {
          return GRADSYNC_ISA_DISPATCH(squares_loop<T>)(offset<T>(x, begin), count);
        },
        [](double a, double b) { return a + b; });
  });
}

ops::NormStatistics norm_statistics(const void* x, DType dtype, std::int64_t n, double factor) {
  return visit_dtype(dtype, [&]<typename T>(T) -> ops::NormStatistics {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      return reduce_chunks<ops::NormStatistics>(
          n,
          [&](std::int64_t begin, std::int64_t count) {
            return GRADSYNC_ISA_DISPATCH(norm_statistics_loop<T>)(offset<T>(x, begin), count, factor);
          },
          [](ops::NormStatistics s, const ops::NormStatistics& t) {
            s.sum_of_squares += t.sum_of_squares;
            s.max_abs = std::max(s.max_abs, t.max_abs);
            s.nonfinite += t.nonfinite;
            return s;
          });
    } else {
      detail::throw_error("norm_statistics: ", dtype_name(dtype), " is not floating");
    }
  });
}

}  // namespace gradsync::kernels::cpu
