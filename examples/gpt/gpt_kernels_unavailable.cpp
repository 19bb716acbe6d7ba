// The GPT's CUDA kernels in a build without CUDA: asking for them is an error that says so.
#include "gpt_kernels.h"
#include "gradsync/core/error.h"

namespace gradsync::examples::detail {

template <typename T>
std::unique_ptr<GptKernels<T>> make_cuda_gpt_kernels(Device device) {
  ::gradsync::detail::throw_error("gpt: ", device.str(), " asked for, but gradsync was built without CUDA (configure with -Dcuda=enabled ",
                      "on a machine with the CUDA toolkit)");
}
template std::unique_ptr<GptKernels<float>> make_cuda_gpt_kernels<float>(Device);
template std::unique_ptr<GptKernels<double>> make_cuda_gpt_kernels<double>(Device);

}  // namespace gradsync::examples::detail
