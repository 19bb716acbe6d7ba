// CUDA optimizer updates: one kernel launch per arena (per 32 segments, in the rare case of
// more), hyperparameters passed by value in the launch, a grid-stride loop per segment.
// blockIdx.y selects the segment, so segments of different sizes share one launch. The
// arithmetic is src/kernels/optimizer_math.h, the same code the CPU runs.
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "../../core/cuda_check.h"
#include "device_scope.h"
#include "../optimizer_kernels.h"
#include "../optimizer_math.h"

namespace gradsync::kernels::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxSegmentsPerLaunch = 32;  // keeps the by-value launch argument under 4 KiB

template <typename Scalars>
struct SegmentBatch {
  int count;
  std::int64_t begin[kMaxSegmentsPerLaunch];
  std::int64_t length[kMaxSegmentsPerLaunch];
  Scalars scalars[kMaxSegmentsPerLaunch];
};

// The elements of the launch's segment blockIdx.y, grid-stride over the blocks along x.
#define SEGMENT_STRIDE_LOOP(i, batch)                                                     \
  for (std::int64_t i = (batch).begin[blockIdx.y] +                                       \
                        blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x, \
                    end_ = (batch).begin[blockIdx.y] + (batch).length[blockIdx.y];        \
       i < end_; i += static_cast<std::int64_t>(blockDim.x) * gridDim.x)

// T: param/state type; G: gradient storage; M: model copy storage (void: none). See
// src/kernels/optimizer_kernels.h for the mixed-precision pass.
template <typename M, typename T>
__device__ inline void write_model(M* model, std::int64_t i, T value) {
  if constexpr (!std::is_void_v<M>) model[i] = store<M>(value);
}

template <typename T, typename G, typename M>
__global__ void sgd_kernel(SegmentBatch<SgdScalars<T>> batch, T* params, const G* grads, T* momentum, M* model) {
  const SgdScalars<T> s = batch.scalars[blockIdx.y];
  SEGMENT_STRIDE_LOOP(i, batch) {
    sgd_element(s, params[i], static_cast<T>(load(grads[i])), s.use_momentum ? &momentum[i] : nullptr);
    write_model(model, i, params[i]);
  }
}

template <typename T, typename G, typename M>
__global__ void adam_kernel(SegmentBatch<AdamScalars<T>> batch, T* params, const G* grads, T* exp_avg, T* exp_avg_sq,
                            T* max_exp_avg_sq, M* model) {
  const AdamScalars<T> s = batch.scalars[blockIdx.y];
  SEGMENT_STRIDE_LOOP(i, batch) {
    adam_element(s, params[i], static_cast<T>(load(grads[i])), exp_avg[i], exp_avg_sq[i],
                 s.amsgrad ? &max_exp_avg_sq[i] : nullptr);
    write_model(model, i, params[i]);
  }
}

// Packs segments into batches and launches `launch(batch, grid)` for each: enough x-blocks
// for the largest segment in the batch (a few waves), one y-row per segment.
template <typename T, typename Segment, typename ScalarsOf, typename Launch>
void launch_batches(std::span<const Segment> segments, ScalarsOf scalars_of, Launch launch) {
  for (std::size_t first = 0; first < segments.size(); first += kMaxSegmentsPerLaunch) {
    using Scalars = decltype(scalars_of(segments[0]));
    SegmentBatch<Scalars> batch{};
    batch.count = static_cast<int>(std::min<std::size_t>(kMaxSegmentsPerLaunch, segments.size() - first));
    std::int64_t longest = 0;
    for (int k = 0; k < batch.count; ++k) {
      const Segment& segment = segments[first + static_cast<std::size_t>(k)];
      batch.begin[k] = segment.begin;
      batch.length[k] = segment.count;
      batch.scalars[k] = scalars_of(segment);
      longest = std::max(longest, segment.count);
    }
    if (longest == 0) continue;
    const int blocks_x = static_cast<int>(std::clamp<std::int64_t>((longest + kThreads - 1) / kThreads, 1, 4096));
    launch(batch, dim3(static_cast<unsigned>(blocks_x), static_cast<unsigned>(batch.count)));
    const cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) detail::throw_error("optimizer kernel failed to launch: ", cudaGetErrorString(status));
  }
}

}  // namespace

void sgd_update(Device device, const UpdateBuffers& b, void* momentum, std::span<const SgdSegment> segments) {
  DeviceScope scope(device);
  visit_update_types(b, "SGD", [&]<typename T, typename G, typename M>(T, G, M*) {
    launch_batches<T>(segments, [](const SgdSegment& s) { return sgd_scalars<T>(s); },
                      [&](const SegmentBatch<SgdScalars<T>>& batch, dim3 grid) {
                        sgd_kernel<T, G, M><<<grid, kThreads, 0, scope.stream()>>>(batch, static_cast<T*>(b.params),
                                                                static_cast<const G*>(b.grads),
                                                                static_cast<T*>(momentum), static_cast<M*>(b.model));
                      });
  });
}

void adam_update(Device device, const UpdateBuffers& b, void* exp_avg, void* exp_avg_sq, void* max_exp_avg_sq,
                 std::span<const AdamSegment> segments) {
  DeviceScope scope(device);
  visit_update_types(b, "Adam", [&]<typename T, typename G, typename M>(T, G, M*) {
    launch_batches<T>(segments, [](const AdamSegment& s) { return adam_scalars<T>(s); },
                      [&](const SegmentBatch<AdamScalars<T>>& batch, dim3 grid) {
                        adam_kernel<T, G, M><<<grid, kThreads, 0, scope.stream()>>>(
                            batch, static_cast<T*>(b.params), static_cast<const G*>(b.grads), static_cast<T*>(exp_avg),
                            static_cast<T*>(exp_avg_sq), static_cast<T*>(max_exp_avg_sq), static_cast<M*>(b.model));
                      });
  });
}

}  // namespace gradsync::kernels::cuda
