// gradsync/core/device.h - where a tensor's memory lives: the host, or one CUDA device.
#pragma once

#include <string>
#include <string_view>

namespace gradsync {

// The host, or a CUDA GPU.
enum class DeviceType { cpu, cuda };

// A device: its type and, for CUDA, its ordinal.
struct Device {
  DeviceType type = DeviceType::cpu;  // cpu or cuda
  int index = 0;  // CUDA ordinal; always 0 for cpu

  static Device cpu() { return {DeviceType::cpu, 0}; }                 // the host
  static Device cuda(int index = 0) { return {DeviceType::cuda, index}; }  // CUDA device `index`
  // Parses "cpu", "cuda" or "cuda:N"; throws gradsync::Error naming the text otherwise.
  static Device parse(std::string_view text);

  bool is_cpu() const { return type == DeviceType::cpu; }    // the host
  bool is_cuda() const { return type == DeviceType::cuda; }  // a CUDA device
  std::string str() const;  // "cpu" or "cuda:N"

  friend bool operator==(const Device&, const Device&) = default;  // same type and ordinal
};

// True when this build of gradsync was compiled with CUDA support.
bool cuda_compiled();
// Number of usable CUDA devices: 0 when CUDA is not compiled in, no driver is present, or no
// device is visible. Never throws; cuda_unavailable_reason() says why the count is 0.
int cuda_device_count();
std::string cuda_unavailable_reason();  // why cuda_device_count() is 0 (empty when it is not)
// Waits until all work queued on `device` has finished (a no-op for the CPU). Benchmarks
// and engines that read device results through raw pointers call this first.
void synchronize(Device device);

}  // namespace gradsync
