// gradsync/nn/data_parallel_module.h - DDP at the Module level, and Composer's helpers.
//
//   auto model = nn::prepare_ddp_module(my_model, *comm, /*find_unused_parameters=*/false);
//   for (int mb = 0; mb < microbatches; ++mb) {
//     nn::SyncContext sync(*model, mb + 1 == microbatches, strategy);
//     Tensor out = model->forward(x[mb]);
//     model->backward(loss_gradient(out));
//   }
//   optimizer.step();
#pragma once

#include <memory>

#include "gradsync/comm/communicator.h"
#include "gradsync/dist/data_parallel/sync_strategy.h"
#include "gradsync/nn/module.h"

namespace gradsync::nn {

// A Module whose backward synchronizes gradients through a DataParallel.
class DistributedDataParallel final : public Module {
 public:
  // Wraps `module`: collective, as the DataParallel it makes over the module's registry.
  DistributedDataParallel(std::shared_ptr<Module> module, comm::Communicator& comm, dist::DataParallelOptions options = {});
  ParameterRegistry& registry() override { return module_->registry(); }
  Tensor forward(const Tensor& input) override { return module_->forward(input); }
  Tensor backward(const Tensor& grad_output) override;  // begin_backward, the module's backward, end_backward
  dist::DataParallel& data_parallel() { return ddp_; }  // the synchronization underneath
  Module& module() { return *module_; }                 // the wrapped module

 private:
  std::shared_ptr<Module> module_;
  dist::DataParallel ddp_;
};

// Composer's prepare_ddp_module: the module wrapped in DistributedDataParallel when the world
// has more than one rank and the module has trainable parameters; the module itself otherwise.
std::shared_ptr<Module> prepare_ddp_module(std::shared_ptr<Module> module, comm::Communicator& comm,
                                           bool find_unused_parameters);

// Composer's ddp_sync_context at the Module level: the strategy's guard when the module is a
// DistributedDataParallel, nothing otherwise (see dist::DDPSyncContext).
class SyncContext {
 public:
  // Opens the context for one microbatch of `module` (dist::DDPSyncContext's meaning).
  SyncContext(Module& module, bool is_final_microbatch, dist::DDPSyncStrategy strategy);
  ~SyncContext() noexcept(false);
  SyncContext(const SyncContext&) = delete;
  SyncContext& operator=(const SyncContext&) = delete;
  void close();  // ends the context (FORCED's synchronization runs here, and may throw)

 private:
  std::unique_ptr<dist::DDPSyncContext> context_;
  int uncaught_;
};

}  // namespace gradsync::nn
