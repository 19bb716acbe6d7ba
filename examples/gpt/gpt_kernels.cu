// The GPT's arithmetic on a CUDA device (gpt_kernels.h): the products through cuBLAS (f32 or
// f64, cuBLAS's default math: no TF32, so the results stay within rounding of the host's), the
// rest as small kernels, one thread per element or one warp per row. Everything is queued on the
// calling thread's current stream (gradsync/core/stream.h), where gradsync's communicators
// order their work after it: a gradient marked ready is complete before it goes on the wire.
// Every reduction runs in a fixed order (no atomics), so a step is bit-reproducible.
//
// Row-major [rows, cols] buffers are column-major [cols, rows] to cuBLAS, so each product is
// written transposed; the comment beside each call gives the row-major meaning.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>

#include "gpt_kernels.h"
#include "gradsync/core/error.h"
#include "gradsync/core/stream.h"

namespace gradsync::examples {

namespace {

using i64 = std::int64_t;

void check(cudaError_t status, const char* what) {
  GRADSYNC_CHECK(status == cudaSuccess, "gpt (CUDA): ", what, ": ", cudaGetErrorString(status));
}
void check(cublasStatus_t status, const char* what) {
  GRADSYNC_CHECK(status == CUBLAS_STATUS_SUCCESS, "gpt (cuBLAS): ", what, ": ", cublasGetStatusString(status));
}

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
unsigned element_blocks(i64 n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }
unsigned row_blocks(i64 rows) { return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }

// ---- Kernels: one thread per element --------------------------------------------------------

template <typename T>
__global__ void add_kernel(T* out, const T* a, const T* b, i64 n) {
  const i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}

template <typename T>
__global__ void embed_kernel(T* x, const std::int32_t* tokens, const T* wte, const T* wpe, i64 N, i64 L, i64 C) {
  const i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (i >= N * C) return;
  const i64 n = i / C, j = i % C;
  x[i] = wte[tokens[n] * C + j] + wpe[(n % L) * C + j];
}

template <typename T>
__global__ void add_bias_kernel(T* y, const T* b, i64 rows, i64 cols) {
  const i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (i < rows * cols) y[i] += b[i % cols];
}

template <typename T>
__device__ T gelu_tanh_inner(T x) {
  const T k = static_cast<T>(0.7978845608028654);  // sqrt(2 / pi)
  return tanh(k * (x + static_cast<T>(0.044715) * x * x * x));
}

template <typename T>
__global__ void gelu_kernel(T* out, const T* in, i64 n, bool tanh_form) {
  const i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const T x = in[i];
  out[i] = tanh_form ? static_cast<T>(0.5) * x * (1 + gelu_tanh_inner(x))
                     : static_cast<T>(0.5) * x * (1 + erf(x * static_cast<T>(0.7071067811865476)));
}

template <typename T>
__global__ void gelu_backward_kernel(T* g, const T* in, i64 n, bool tanh_form) {
  const i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const T x = in[i];
  if (tanh_form) {
    const T k = static_cast<T>(0.7978845608028654);
    const T t = gelu_tanh_inner(x);
    g[i] *= static_cast<T>(0.5) * (1 + t) + static_cast<T>(0.5) * x * (1 - t * t) * k * (1 + 3 * static_cast<T>(0.044715) * x * x);
  } else {
    const T cdf = static_cast<T>(0.5) * (1 + erf(x * static_cast<T>(0.7071067811865476)));
    const T pdf = exp(-x * x / 2) * static_cast<T>(0.3989422804014327);  // 1 / sqrt(2 pi)
    g[i] *= cdf + x * pdf;
  }
}

template <typename T>
__global__ void cross_entropy_backward_kernel(T* dlogits, const T* probs, const std::int32_t* targets, T scale, i64 N, i64 V) {
  const i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (i >= N * V) return;
  dlogits[i] = (probs[i] - (i % V == targets[i / V] ? T(1) : T(0))) * scale;
}

// ---- Kernels: one thread per column, summing down the rows in order --------------------------

template <typename T>
__global__ void column_sums_kernel(T* sums, const T* x, i64 rows, i64 cols) {  // sums[j] += sum_r x[r, j]
  const i64 j = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (j >= cols) return;
  T sum = 0;
  for (i64 r = 0; r < rows; ++r) sum += x[r * cols + j];
  sums[j] += sum;
}

// Each token's and each position's row gathers its gradient; rows sharing a token are added in
// the order of n, as on the host.
template <typename T>
__global__ void embed_backward_kernel(T* dwte, T* dwpe, const T* dx, const std::int32_t* tokens, i64 N, i64 L, i64 C) {
  const i64 j = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (j >= C) return;
  for (i64 n = 0; n < N; ++n) {
    dwte[tokens[n] * C + j] += dx[n * C + j];
    dwpe[(n % L) * C + j] += dx[n * C + j];
  }
}

template <typename T>
__global__ void layernorm_parameter_grads_kernel(T* dw, T* db, const T* dout, const T* x, const T* mean, const T* rstd,
                                                 i64 N, i64 C) {
  const i64 j = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (j >= C) return;
  T sum_w = 0, sum_b = 0;
  for (i64 r = 0; r < N; ++r) {
    const T g = dout[r * C + j];
    sum_w += g * (x[r * C + j] - mean[r]) * rstd[r];
    sum_b += g;
  }
  dw[j] += sum_w;
  db[j] += sum_b;
}

// ---- Kernels: one warp per row -----------------------------------------------------------------

template <typename T>
__device__ T warp_sum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
template <typename T>
__device__ T warp_max(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}
// The row of this thread's warp (every lane of a warp gets the same row, so a warp returns whole).
__device__ i64 warp_row() { return blockIdx.x * static_cast<i64>(kWarpsPerBlock) + threadIdx.x / 32; }
__device__ int lane() { return static_cast<int>(threadIdx.x % 32); }

// row[0, valid) replaced by its softmax, row[valid, length) by 0; by the warp.
template <typename T>
__device__ void softmax_row(T* row, i64 valid, i64 length) {
  T largest = -INFINITY;
  for (i64 u = lane(); u < valid; u += 32) largest = max(largest, row[u]);
  largest = warp_max(largest);
  T sum = 0;
  for (i64 u = lane(); u < valid; u += 32) sum += (row[u] = exp(row[u] - largest));
  sum = warp_sum(sum);
  for (i64 u = lane(); u < length; u += 32) row[u] = u < valid ? row[u] / sum : T(0);
}

template <typename T>
__global__ void layernorm_kernel(T* out, T* mean, T* rstd, const T* x, const T* w, const T* b, i64 N, i64 C) {
  const i64 r = warp_row();
  if (r >= N) return;
  const T* row = x + r * C;
  T m = 0;
  for (i64 j = lane(); j < C; j += 32) m += row[j];
  m = warp_sum(m) / static_cast<T>(C);
  T v = 0;
  for (i64 j = lane(); j < C; j += 32) v += (row[j] - m) * (row[j] - m);
  v = warp_sum(v) / static_cast<T>(C);
  const T s = 1 / sqrt(v + static_cast<T>(1e-5));
  for (i64 j = lane(); j < C; j += 32) out[r * C + j] = (row[j] - m) * s * w[j] + b[j];
  if (lane() == 0) {
    mean[r] = m;
    rstd[r] = s;
  }
}

template <typename T>
__global__ void layernorm_input_grad_kernel(T* dx, const T* dout, const T* x, const T* w, const T* mean, const T* rstd,
                                            i64 N, i64 C) {
  const i64 r = warp_row();
  if (r >= N) return;
  const T* g = dout + r * C;
  const T* row = x + r * C;
  T dnorm_mean = 0, dnorm_norm_mean = 0;
  for (i64 j = lane(); j < C; j += 32) {
    const T norm = (row[j] - mean[r]) * rstd[r];
    dnorm_mean += g[j] * w[j];
    dnorm_norm_mean += g[j] * w[j] * norm;
  }
  dnorm_mean = warp_sum(dnorm_mean) / static_cast<T>(C);
  dnorm_norm_mean = warp_sum(dnorm_norm_mean) / static_cast<T>(C);
  for (i64 j = lane(); j < C; j += 32) {
    const T norm = (row[j] - mean[r]) * rstd[r];
    dx[r * C + j] += (g[j] * w[j] - dnorm_mean - norm * dnorm_norm_mean) * rstd[r];
  }
}

// Rows of [B, NH, L, L]: row t keeps u <= t.
template <typename T>
__global__ void causal_softmax_kernel(T* att, i64 rows, i64 L) {
  const i64 r = warp_row();
  if (r >= rows) return;
  softmax_row(att + r * L, r % L + 1, L);
}

template <typename T>
__global__ void causal_softmax_backward_kernel(T* dscores, const T* att, i64 rows, i64 L, T scale) {
  const i64 r = warp_row();
  if (r >= rows) return;
  const i64 t = r % L;
  const T* a = att + r * L;
  T* d = dscores + r * L;
  T weighted = 0;
  for (i64 u = lane(); u <= t; u += 32) weighted += a[u] * d[u];
  weighted = warp_sum(weighted);
  for (i64 u = lane(); u < L; u += 32) d[u] = u <= t ? a[u] * (d[u] - weighted) * scale : T(0);
}

template <typename T>
__global__ void softmax_kernel(T* logits, T* target_probs, const std::int32_t* targets, i64 N, i64 V) {
  const i64 r = warp_row();
  if (r >= N) return;
  softmax_row(logits + r * V, V, V);
  __syncwarp();
  if (lane() == 0) target_probs[r] = logits[r * V + targets[r]];
}

// ---- cuBLAS ----------------------------------------------------------------------------------

// Column-major C = alpha op(A) op(B) + beta C (C m x n, inner dimension k), `count` times, the
// i-th with A + i strideA, B + i strideB, C + i strideC.
template <typename T>
void gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, i64 m, i64 n, i64 k, T alpha, const T* a, i64 lda,
          i64 stride_a, const T* b, i64 ldb, i64 stride_b, T beta, T* c, i64 ldc, i64 stride_c, i64 count = 1) {
  const int M = static_cast<int>(m), Nn = static_cast<int>(n), K = static_cast<int>(k);
  if constexpr (sizeof(T) == 4) {
    check(cublasSgemmStridedBatched(h, ta, tb, M, Nn, K, &alpha, a, static_cast<int>(lda), stride_a, b, static_cast<int>(ldb),
                                    stride_b, &beta, c, static_cast<int>(ldc), stride_c, static_cast<int>(count)),
          "cublasSgemmStridedBatched");
  } else {
    check(cublasDgemmStridedBatched(h, ta, tb, M, Nn, K, &alpha, a, static_cast<int>(lda), stride_a, b, static_cast<int>(ldb),
                                    stride_b, &beta, c, static_cast<int>(ldc), stride_c, static_cast<int>(count)),
          "cublasDgemmStridedBatched");
  }
}

template <typename T>
class CudaGptKernels final : public GptKernels<T> {
 public:
  explicit CudaGptKernels(Device device) : device_(device) {
    check(cudaSetDevice(device.index), "cudaSetDevice");
    check(cublasCreate(&blas_), "cublasCreate");
  }
  ~CudaGptKernels() override {
    cudaSetDevice(device_.index);
    cublasDestroy(blas_);
  }
  CudaGptKernels(const CudaGptKernels&) = delete;
  CudaGptKernels& operator=(const CudaGptKernels&) = delete;

  void zero(T* x, i64 n) const override {
    if (n > 0) check(cudaMemsetAsync(x, 0, static_cast<std::size_t>(n) * sizeof(T), stream()), "cudaMemsetAsync");
  }
  void copy(T* out, const T* in, i64 n) const override {
    if (n > 0) {
      check(cudaMemcpyAsync(out, in, static_cast<std::size_t>(n) * sizeof(T), cudaMemcpyDeviceToDevice, stream()),
            "cudaMemcpyAsync");
    }
  }
  void add(T* out, const T* a, const T* b, i64 n) const override {
    if (n > 0) add_kernel<<<element_blocks(n), kThreads, 0, stream()>>>(out, a, b, n);
    launched("add");
  }

  void embed(T* x, const std::int32_t* tokens, const T* wte, const T* wpe, i64 N, i64 L, i64 C) const override {
    if (N * C > 0) embed_kernel<<<element_blocks(N * C), kThreads, 0, stream()>>>(x, tokens, wte, wpe, N, L, C);
    launched("embed");
  }
  void embed_backward(T* dwte, T* dwpe, const T* dx, const std::int32_t* tokens, i64 N, i64 L, i64 C) const override {
    if (C > 0) embed_backward_kernel<<<element_blocks(C), kThreads, 0, stream()>>>(dwte, dwpe, dx, tokens, N, L, C);
    launched("embed_backward");
  }

  void linear(T* out, const T* in, const T* w, const T* b, i64 N, i64 I, i64 O) const override {
    if (N == 0 || O == 0) return;
    // out[N, O] = in[N, I] W[O, I]^T   <=>   out^T = W in^T: gemm(T, N, O, N, I)
    gemm<T>(blas(), CUBLAS_OP_T, CUBLAS_OP_N, O, N, I, T(1), w, I, 0, in, I, 0, T(0), out, O, 0);
    if (b != nullptr) add_bias_kernel<<<element_blocks(N * O), kThreads, 0, stream()>>>(out, b, N, O);
    launched("linear");
  }
  void linear_backward(T* din, T* dw, T* db, const T* dout, const T* in, const T* w, i64 N, i64 I, i64 O) const override {
    if (N == 0) return;
    // din[N, I] += dout[N, O] W[O, I]   <=>   din^T += W^T dout^T: gemm(N, N, I, N, O), beta 1
    if (din != nullptr) gemm<T>(blas(), CUBLAS_OP_N, CUBLAS_OP_N, I, N, O, T(1), w, I, 0, dout, O, 0, T(1), din, I, 0);
    // dW[O, I] += dout^T in   <=>   dW^T += in^T dout: gemm(N, T, I, O, N), beta 1
    gemm<T>(blas(), CUBLAS_OP_N, CUBLAS_OP_T, I, O, N, T(1), in, I, 0, dout, O, 0, T(1), dw, I, 0);
    if (db != nullptr && O > 0) column_sums_kernel<<<element_blocks(O), kThreads, 0, stream()>>>(db, dout, N, O);
    launched("linear_backward");
  }

  void layernorm(T* out, T* mean, T* rstd, const T* x, const T* w, const T* b, i64 N, i64 C) const override {
    if (N > 0) layernorm_kernel<<<row_blocks(N), kThreads, 0, stream()>>>(out, mean, rstd, x, w, b, N, C);
    launched("layernorm");
  }
  void layernorm_backward(T* dx, T* dw, T* db, const T* dout, const T* x, const T* w, const T* mean, const T* rstd, i64 N,
                          i64 C) const override {
    if (N == 0 || C == 0) return;
    layernorm_input_grad_kernel<<<row_blocks(N), kThreads, 0, stream()>>>(dx, dout, x, w, mean, rstd, N, C);
    layernorm_parameter_grads_kernel<<<element_blocks(C), kThreads, 0, stream()>>>(dw, db, dout, x, mean, rstd, N, C);
    launched("layernorm_backward");
  }

  void gelu(T* out, const T* in, i64 n, bool tanh_form) const override {
    if (n > 0) gelu_kernel<<<element_blocks(n), kThreads, 0, stream()>>>(out, in, n, tanh_form);
    launched("gelu");
  }
  void gelu_backward(T* g, const T* in, i64 n, bool tanh_form) const override {
    if (n > 0) gelu_backward_kernel<<<element_blocks(n), kThreads, 0, stream()>>>(g, in, n, tanh_form);
    launched("gelu_backward");
  }

  // Per sequence b, the NH heads as one batched product (head h's q, k, v start h hs columns
  // in; its scores L L apart).
  void attention(T* att, T* y, const T* qkv, i64 B, i64 L, i64 NH, i64 hs) const override {
    if (B * L == 0) return;
    const i64 C = NH * hs;
    const T scale = static_cast<T>(1) / std::sqrt(static_cast<T>(hs));
    for (i64 b = 0; b < B; ++b) {
      const T* q = qkv + b * L * 3 * C;
      // scores[L, L] = q[L, hs] k^T scale   <=>   scores^T = k q^T: gemm(T, N, L, L, hs)
      gemm<T>(blas(), CUBLAS_OP_T, CUBLAS_OP_N, L, L, hs, scale, q + C, 3 * C, hs, q, 3 * C, hs, T(0), att + b * NH * L * L,
              L, L * L, NH);
    }
    causal_softmax_kernel<<<row_blocks(B * NH * L), kThreads, 0, stream()>>>(att, B * NH * L, L);
    launched("causal_softmax");
    for (i64 b = 0; b < B; ++b) {
      const T* v = qkv + b * L * 3 * C + 2 * C;
      // y[L, hs] = att[L, L] v[L, hs]   <=>   y^T = v^T att^T: gemm(N, N, hs, L, L)
      gemm<T>(blas(), CUBLAS_OP_N, CUBLAS_OP_N, hs, L, L, T(1), v, 3 * C, hs, att + b * NH * L * L, L, L * L, T(0),
              y + b * L * C, C, hs, NH);
    }
  }
  void attention_backward(T* dqkv, T* dscores, const T* dy, const T* qkv, const T* att, i64 B, i64 L, i64 NH,
                          i64 hs) const override {
    if (B * L == 0) return;
    const i64 C = NH * hs;
    const T scale = static_cast<T>(1) / std::sqrt(static_cast<T>(hs));
    for (i64 b = 0; b < B; ++b) {
      const T* v = qkv + b * L * 3 * C + 2 * C;
      const T* g = dy + b * L * C;
      const T* a = att + b * NH * L * L;
      // dv[L, hs] += att^T g   <=>   dv^T += g^T att: gemm(N, T, hs, L, L), beta 1
      gemm<T>(blas(), CUBLAS_OP_N, CUBLAS_OP_T, hs, L, L, T(1), g, C, hs, a, L, L * L, T(1), dqkv + b * L * 3 * C + 2 * C,
              3 * C, hs, NH);
      // dscores[L, L] = g v^T   <=>   dscores^T = v g^T: gemm(T, N, L, L, hs)
      gemm<T>(blas(), CUBLAS_OP_T, CUBLAS_OP_N, L, L, hs, T(1), v, 3 * C, hs, g, C, hs, T(0), dscores + b * NH * L * L, L,
              L * L, NH);
    }
    causal_softmax_backward_kernel<<<row_blocks(B * NH * L), kThreads, 0, stream()>>>(dscores, att, B * NH * L, L, scale);
    launched("causal_softmax_backward");
    for (i64 b = 0; b < B; ++b) {
      const T* q = qkv + b * L * 3 * C;
      const T* d = dscores + b * NH * L * L;
      // dq[L, hs] += dscores k   <=>   dq^T += k^T dscores^T: gemm(N, N, hs, L, L), beta 1
      gemm<T>(blas(), CUBLAS_OP_N, CUBLAS_OP_N, hs, L, L, T(1), q + C, 3 * C, hs, d, L, L * L, T(1), dqkv + b * L * 3 * C,
              3 * C, hs, NH);
      // dk[L, hs] += dscores^T q   <=>   dk^T += q^T dscores: gemm(N, T, hs, L, L), beta 1
      gemm<T>(blas(), CUBLAS_OP_N, CUBLAS_OP_T, hs, L, L, T(1), q, 3 * C, hs, d, L, L * L, T(1), dqkv + b * L * 3 * C + C,
              3 * C, hs, NH);
    }
  }

  void softmax(T* logits, T* target_probs, const std::int32_t* targets, i64 N, i64 V) const override {
    if (N > 0) softmax_kernel<<<row_blocks(N), kThreads, 0, stream()>>>(logits, target_probs, targets, N, V);
    launched("softmax");
  }
  void cross_entropy_backward(T* dlogits, const T* probs, const std::int32_t* targets, T scale, i64 N,
                              i64 V) const override {
    if (N * V > 0) {
      cross_entropy_backward_kernel<<<element_blocks(N * V), kThreads, 0, stream()>>>(dlogits, probs, targets, scale, N, V);
    }
    launched("cross_entropy_backward");
  }

 private:
  // The thread's current stream on the device, made current (cheap when it already is).
  cudaStream_t stream() const {
    check(cudaSetDevice(device_.index), "cudaSetDevice");
    return static_cast<cudaStream_t>(current_cuda_stream(device_));
  }
  cublasHandle_t blas() const {
    check(cublasSetStream(blas_, stream()), "cublasSetStream");
    return blas_;
  }
  static void launched(const char* kernel) { check(cudaGetLastError(), kernel); }

  Device device_;
  cublasHandle_t blas_ = nullptr;
};

}  // namespace

namespace detail {
template <typename T>
std::unique_ptr<GptKernels<T>> make_cuda_gpt_kernels(Device device) {
  int count = 0;
  GRADSYNC_CHECK(cudaGetDeviceCount(&count) == cudaSuccess && device.index >= 0 && device.index < count, "gpt: ",
                 device.str(), " is not a usable CUDA device (", count, " visible)");
  return std::make_unique<CudaGptKernels<T>>(device);
}
template std::unique_ptr<GptKernels<float>> make_cuda_gpt_kernels<float>(Device);
template std::unique_ptr<GptKernels<double>> make_cuda_gpt_kernels<double>(Device);
}  // namespace detail

}  // namespace gradsync::examples
