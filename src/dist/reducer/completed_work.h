// Internal: the Work of a reduction that a hook finished on the caller's thread (Adasum,
// PowerSGD): already complete, nothing to wait for.
#pragma once

#include <string>

#include "gradsync/comm/communicator.h"

namespace gradsync::dist {

class CompletedWork final : public comm::Work {
 public:
  explicit CompletedWork(std::string description) : description_(std::move(description)) {}
  bool is_completed() const override { return true; }
  void wait(std::chrono::milliseconds) override {}
  const std::string& description() const override { return description_; }

 private:
  std::string description_;
};

}  // namespace gradsync::dist
