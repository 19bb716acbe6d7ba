// CPU kernels behind gradsync::ops.
//
// f32 and f64 go through Eigen array maps, which emit SIMD code for the target ISA. The
// 16-bit floats and integers use plain loops over load()/store(); they are branch-free
// enough for the compiler to vectorize the arithmetic, and they are not on hot paths that
// matter (gradients in f16/bf16 exist only inside compression, which is bandwidth-bound
// on the network, not on these loops).
#include <Eigen/Core>

#include "../element.h"
#include "../kernels.h"

namespace gradsync::kernels::cpu {

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

}  // namespace

void fill(void* x, DType dtype, std::int64_t n, double value) {
  visit_dtype(dtype, [&]<typename T>(T) {
    const T element = convert<T>(value);
    T* data = static_cast<T*>(x);
    std::fill(data, data + n, element);
  });
}

void scale(void* x, DType dtype, std::int64_t n, double alpha) {
  visit_dtype(dtype, [&]<typename T>(T) {
    if constexpr (uses_eigen<T>) {
      with_map<T>(x, n, [&](auto& map) { map *= static_cast<T>(alpha); });
    } else {
      using C = compute_t<T>;
      const C factor = static_cast<C>(alpha);
      T* data = static_cast<T*>(x);
      for (std::int64_t i = 0; i < n; ++i) data[i] = store<T>(load(data[i]) * factor);
    }
  });
}

void axpy(double alpha, const void* x, void* y, DType dtype, std::int64_t n) {
  visit_dtype(dtype, [&]<typename T>(T) {
    if constexpr (uses_eigen<T>) {
      ConstArrayMap<T> source(static_cast<const T*>(x), n);
      with_map<T>(y, n, [&](auto& target) { target += static_cast<T>(alpha) * source; });
    } else {
      using C = compute_t<T>;
      const C factor = static_cast<C>(alpha);
      const T* source = static_cast<const T*>(x);
      T* target = static_cast<T*>(y);
      for (std::int64_t i = 0; i < n; ++i) target[i] = store<T>(load(target[i]) + factor * load(source[i]));
    }
  });
}

void add(const void* a, const void* b, void* out, DType dtype, std::int64_t n) {
  visit_dtype(dtype, [&]<typename T>(T) {
    if constexpr (uses_eigen<T>) {
      ConstArrayMap<T> left(static_cast<const T*>(a), n);
      ConstArrayMap<T> right(static_cast<const T*>(b), n);
      with_map<T>(out, n, [&](auto& result) { result = left + right; });
    } else {
      const T* left = static_cast<const T*>(a);
      const T* right = static_cast<const T*>(b);
      T* result = static_cast<T*>(out);
      for (std::int64_t i = 0; i < n; ++i) result[i] = store<T>(load(left[i]) + load(right[i]));
    }
  });
}

void cast(const void* source, DType source_dtype, void* destination, DType destination_dtype, std::int64_t n) {
  visit_dtype(source_dtype, [&]<typename S>(S) {
    visit_dtype(destination_dtype, [&]<typename D>(D) {
      const S* from = static_cast<const S*>(source);
      D* to = static_cast<D*>(destination);
      for (std::int64_t i = 0; i < n; ++i) to[i] = convert<D>(from[i]);
    });
  });
}

// Reductions accumulate in double whatever the input type: a norm or dot product over
// millions of f32 gradients loses digits in f32, and the caller gets a double anyway.
// Eight independent accumulators break the dependency chain of one running sum (which
// would cost a full add latency per element) and let the compiler use SIMD lanes; the
// order of additions is fixed, so results are reproducible run to run.
double dot(const void* a, const void* b, DType dtype, std::int64_t n) {
  return visit_dtype(dtype, [&]<typename T>(T) -> double {
    constexpr int kLanes = 8;
    const T* left = static_cast<const T*>(a);
    const T* right = static_cast<const T*>(b);
    double lanes[kLanes] = {};
    std::int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      for (int lane = 0; lane < kLanes; ++lane) {
        lanes[lane] += static_cast<double>(load(left[i + lane])) * static_cast<double>(load(right[i + lane]));
      }
    }
    double sum = 0.0;
    for (; i < n; ++i) sum += static_cast<double>(load(left[i])) * static_cast<double>(load(right[i]));
    for (const double lane : lanes) sum += lane;
    return sum;
  });
}

double squared_norm(const void* x, DType dtype, std::int64_t n) { return dot(x, x, dtype, n); }

// Lanes as in dot(). A NaN fails `magnitude <= max`, so "not (|v| <= largest finite)" counts
// both infinities and NaNs without a branch, and the maximum only ever sees finite values.
ops::NormStatistics norm_statistics(const void* x, DType dtype, std::int64_t n, double factor) {
  return visit_dtype(dtype, [&]<typename T>(T) -> ops::NormStatistics {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      using C = compute_t<T>;
      constexpr int kLanes = 8;
      constexpr C kLargest = std::numeric_limits<C>::max();
      const C scale = static_cast<C>(factor);
      const T* values = static_cast<const T*>(x);
      double sums[kLanes] = {};
      C largest[kLanes] = {};
      std::int64_t bad[kLanes] = {};
      const auto visit = [&](int lane, std::int64_t i) {
        const C v = load(values[i]) * scale;
        const C magnitude = v < C(0) ? -v : v;
        const bool finite = magnitude <= kLargest;
        sums[lane] += static_cast<double>(v) * static_cast<double>(v);
        largest[lane] = finite && magnitude > largest[lane] ? magnitude : largest[lane];
        bad[lane] += finite ? 0 : 1;
      };
      std::int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        for (int lane = 0; lane < kLanes; ++lane) visit(lane, i + lane);
      }
      for (; i < n; ++i) visit(0, i);
      ops::NormStatistics result;
      for (int lane = 0; lane < kLanes; ++lane) {
        result.sum_of_squares += sums[lane];
        result.max_abs = std::max(result.max_abs, static_cast<double>(largest[lane]));
        result.nonfinite += bad[lane];
      }
      return result;
    } else {
      detail::throw_error("norm_statistics: ", dtype_name(dtype), " is not floating");
    }
  });
}

}  // namespace gradsync::kernels::cpu
