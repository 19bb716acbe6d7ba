// gradsync/core/stream.h - the CUDA stream an engine computes on.
//
// An engine that runs its forward and backward on its own CUDA stream says so with a
// CudaStreamScope, as PyTorch code does with `with torch.cuda.stream(s):`. Inside the scope,
// on that thread and device:
//  * gradsync's kernels (ops, optimizers, nn layers) are queued on that stream;
//  * tensor copies wait for it (so a copy sees what the engine's kernels wrote);
//  * every communicator orders an operation after the work queued on it so far (NCCL's own
//    stream, and the staging copies of Gloo and MPI, wait for an event recorded there), so a
//    gradient written by the engine's kernel is complete before it goes on the wire.
// Outside any scope the current stream is CUDA's legacy default stream (nullptr), which
// synchronises with every blocking stream: correct for engines that use no streams of their own.
#pragma once

#include "gradsync/core/device.h"

namespace gradsync {

// Makes `stream` the calling thread's current stream on a device, for as long as it lives: the
// stream gradsync orders its collectives after (above).
class CudaStreamScope {
 public:
  // `stream` is a cudaStream_t (void* here, so that this header needs no CUDA); nullptr is
  // the legacy default stream. Scopes nest; the destructor restores the previous stream.
  CudaStreamScope(Device device, void* stream);
  ~CudaStreamScope();
  CudaStreamScope(const CudaStreamScope&) = delete;
  CudaStreamScope& operator=(const CudaStreamScope&) = delete;

 private:
  Device device_;
  void* previous_;
};

// The calling thread's current stream on `device` (nullptr: the legacy default stream).
void* current_cuda_stream(Device device);

// A CUDA stream of gradsync's making, for engines and tests that want their own stream without
// including CUDA headers: non-blocking (it does not synchronise with the legacy default
// stream, like the streams engines create). An Error without CUDA or without the device.
class CudaStream {
 public:
  explicit CudaStream(Device device);  // a new stream on `device`
  ~CudaStream();  // waits for what is queued on it, then destroys it
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  void* get() const { return stream_; }  // the cudaStream_t
  void synchronize() const;              // waits for everything queued on it

 private:
  Device device_;
  void* stream_ = nullptr;
};

}  // namespace gradsync
