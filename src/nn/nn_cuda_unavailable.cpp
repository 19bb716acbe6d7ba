// The nn layers' CUDA entry points in a build without CUDA: a tensor on a CUDA device cannot
// exist there, so reaching these is a clear error rather than a link failure.
#include "gradsync/config.h"
#include "nn_kernels.h"

#if !GRADSYNC_WITH_CUDA
namespace gradsync::nn::cuda {
namespace {
[[noreturn]] void unavailable() { detail::throw_error("nn layers on CUDA: gradsync was built without CUDA"); }
}  // namespace
void linear_forward(const Tensor&, const Tensor&, const Tensor&, Tensor&) { unavailable(); }
void linear_backward(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor&) { unavailable(); }
void relu_forward(const Tensor&, Tensor&) { unavailable(); }
void relu_backward(const Tensor&, const Tensor&, Tensor&) { unavailable(); }
}  // namespace gradsync::nn::cuda
#endif
