// The fixture of tests over (world size, device): run a body on that many Gloo ranks-as-threads
// with the parameters on that device; the CUDA instances skip, saying why, where no GPU is usable.
// Instantiate with ::testing::Combine(worlds, ::testing::Values("cpu", "cuda")), naming the
// instances with RanksOnDevice::name ("3_ranks_cuda").
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <tuple>

#include "gradsync/comm/gloo/gloo.h"
#include "gradsync/core/device.h"
#include "parameters.h"

namespace gradsync::testing {

// Skips the calling test unless `device` can hold tensors here, saying why.
#define GRADSYNC_SKIP_UNLESS_USABLE(device)                                                   \
  do {                                                                                        \
    if ((device).is_cuda() && cuda_device_count() <= (device).index) {                        \
      GTEST_SKIP() << "skipped: " << (device).str() << " is not usable: "                     \
                   << (cuda_device_count() == 0 ? cuda_unavailable_reason() : "no such device"); \
    }                                                                                         \
  } while (0)

class RanksOnDevice : public ::testing::TestWithParam<std::tuple<int, const char*>> {
 protected:
  void SetUp() override { GRADSYNC_SKIP_UNLESS_USABLE(device()); }
  int world() const { return std::get<0>(GetParam()); }
  Device device() const { return Device::parse(std::get<1>(GetParam())); }
  // Runs body(comm, device) on world() Gloo ranks-as-threads.
  void on_gloo_ranks(const std::function<void(comm::Communicator&, Device)>& body,
                     const comm::CommOptions& options = {}) const {
    const Device where = device();
    comm::run_gloo_thread_group(world(), [&](comm::Communicator& comm) { body(comm, where); }, options);
  }

 public:
  static std::string name(const ::testing::TestParamInfo<std::tuple<int, const char*>>& info) {
    return std::to_string(std::get<0>(info.param)) + "_ranks_" + std::get<1>(info.param);
  }
};

// The same with one more parameter (an optimizer kind, a sync strategy, ...), named after the
// world and the device: "3_ranks_cpu_forced_sync".
inline std::string parameter_name(const std::string& text) { return text; }
inline std::string parameter_name(dist::DDPSyncStrategy strategy) { return strategy_name(strategy); }

template <typename Extra>
class RanksOnDeviceWith : public ::testing::TestWithParam<std::tuple<int, const char*, Extra>> {
 protected:
  void SetUp() override { GRADSYNC_SKIP_UNLESS_USABLE(device()); }
  int world() const { return std::get<0>(this->GetParam()); }
  Device device() const { return Device::parse(std::get<1>(this->GetParam())); }
  const Extra& extra() const { return std::get<2>(this->GetParam()); }
  void on_gloo_ranks(const std::function<void(comm::Communicator&, Device)>& body,
                     const comm::CommOptions& options = {}) const {
    const Device where = device();
    comm::run_gloo_thread_group(world(), [&](comm::Communicator& comm) { body(comm, where); }, options);
  }

 public:
  static std::string name(const ::testing::TestParamInfo<std::tuple<int, const char*, Extra>>& info) {
    return std::to_string(std::get<0>(info.param)) + "_ranks_" + std::get<1>(info.param) + "_" +
           parameter_name(std::get<2>(info.param));
  }
};

}  // namespace gradsync::testing
