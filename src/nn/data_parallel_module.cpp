// DDP at the Module level (gradsync/nn/data_parallel_module.h).
#include "gradsync/nn/data_parallel_module.h"

#include <exception>

namespace gradsync::nn {

bool Module::has_trainable_parameters() {
  for (const Parameter& parameter : registry()) {
    if (parameter.requires_grad()) return true;
  }
  return false;
}

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<Module> module, comm::Communicator& comm,
                                                 dist::DataParallelOptions options)
    : module_(std::move(module)), ddp_(module_->registry(), comm, options) {}

Tensor DistributedDataParallel::backward(const Tensor& grad_output) {
  ddp_.begin_backward();
  Tensor grad_input = module_->backward(grad_output);
  ddp_.end_backward();
  return grad_input;
}

std::shared_ptr<Module> prepare_ddp_module(std::shared_ptr<Module> module, comm::Communicator& comm,
                                           bool find_unused_parameters) {
  if (comm.size() > 1 && module->has_trainable_parameters()) {
    return std::make_shared<DistributedDataParallel>(std::move(module), comm,
                                                     dist::DataParallelOptions{.find_unused_parameters = find_unused_parameters});
  }
  return module;
}

SyncContext::SyncContext(Module& module, bool is_final_microbatch, dist::DDPSyncStrategy strategy)
    : uncaught_(std::uncaught_exceptions()) {
  if (auto* ddp = dynamic_cast<DistributedDataParallel*>(&module)) {
    context_ = std::make_unique<dist::DDPSyncContext>(ddp->data_parallel(), is_final_microbatch, strategy);
  }
}

void SyncContext::close() {
  if (context_) context_->close();
}

SyncContext::~SyncContext() noexcept(false) {
  if (context_ && std::uncaught_exceptions() == uncaught_) context_->close();
}

}  // namespace gradsync::nn
