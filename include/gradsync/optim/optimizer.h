// gradsync/optim/optimizer.h - the optimizer interface: parameter groups, a fused step over
// arenas, per-parameter step counts, state in arenas, and checkpoints.
//
// An optimizer updates some or all of a registry's parameters, organised in *groups* that
// each carry their own hyperparameters (PyTorch's param_groups). Its state buffers
// (momentum, exp_avg, ...) are arenas laid out exactly like the registry's value arenas, so
// one update pass covers a whole arena: step() merges neighbouring parameters that share a
// group and a step count into one contiguous segment and hands the segments of each arena
// to one fused kernel (one CUDA launch per arena).
//
// Semantics follow torch.optim:
//  * step() skips parameters whose gradient is undefined and leaves their state and step
//    count untouched;
//  * each parameter has its own step count (Adam's bias correction uses it);
//  * zero_grad(set_to_undefined = true) undefines the gradients, false zero-fills them.
//
// Subclasses (SGD, Adam, AdamW, or a user's own) supply the hyperparameters and the update;
// the DistributedOptimizer wraps any of them through this interface.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradsync/io/safetensors.h"
#include "gradsync/registry/parameter_registry.h"

namespace gradsync::optim {

// Hyperparameters as named numbers (booleans as 0/1): the form checkpoints and messages use.
using Hyperparameters = std::map<std::string, double>;

class Optimizer {
 public:
  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  virtual const char* name() const = 0;  // "SGD", "Adam", "AdamW", ...

  // One update of every parameter with a defined gradient.
  void step();
  void zero_grad(bool set_to_undefined = true);

  ParameterRegistry& registry() const { return registry_; }
  std::size_t group_count() const { return groups_.size(); }
  const std::vector<Parameter*>& group_parameters(std::size_t group) const;
  // Every hyperparameter of a group, and the learning rate on its own (what schedules set).
  virtual Hyperparameters hyperparameters(std::size_t group) const = 0;
  double lr(std::size_t group) const;
  void set_lr(std::size_t group, double lr);

  // Steps taken by this parameter (those with a defined gradient); 0 if never stepped.
  std::int64_t step_count(const Parameter& parameter) const;
  // The names of the state buffers this optimizer may keep ("momentum_buffer", "exp_avg", ...).
  const std::vector<std::string>& state_buffer_names() const { return buffer_names_; }
  // A view of one parameter's state buffer; an undefined Tensor while the buffer does not
  // exist yet (state is created at the first step that needs it, as in PyTorch).
  Tensor state(const Parameter& parameter, std::string_view buffer) const;

  // --- Checkpoints (safetensors): state tensors named "optimizer.state.<param>.<buffer>",
  // the type, the groups with their hyperparameters and the step counts in the metadata.
  std::vector<io::NamedTensor> state_tensors() const;
  io::Metadata state_metadata() const;
  void save_state(const std::filesystem::path& path) const;
  // Loads a state saved by an optimizer of the same type over the same parameters: groups
  // (their members and hyperparameters), step counts and buffers. Any mismatch raises one
  // error listing every difference, and leaves this optimizer unchanged.
  void load_state(const std::filesystem::path& path);
  void load_state(const io::SafetensorsReader& file);

 protected:
  // One contiguous run of elements of one arena, to update with one group's hyperparameters.
  // `step` is the step count after this update (1 on the first). `present` has bit b set when
  // the run's parameters already hold state in buffer b; a buffer without state starts from
  // PyTorch's initial value (SGD: the gradient itself; Adam: zeros).
  struct Segment {
    std::int64_t begin;
    std::int64_t count;
    std::size_t group;
    std::int64_t step;
    std::uint32_t present;
  };

  // groups: the parameters of each group (every one trainable, of this registry, in at most
  // one group); buffer_names: the state buffers the subclass may request.
  Optimizer(ParameterRegistry& registry, std::vector<std::vector<Parameter*>> groups,
            std::vector<std::string> buffer_names);

  // Replaces a group's hyperparameters after validating them (errors name the group and value).
  virtual void set_hyperparameters(std::size_t group, const Hyperparameters& values) = 0;
  // Which state buffers a group's update reads and writes (bit b for buffer b).
  virtual std::uint32_t buffers_used(std::size_t group) const = 0;
  // Updates one arena: `values`/`grads` are the registry's arenas, the segments are in
  // arena order. Request state buffers with state_buffer().
  virtual void update_arena(std::size_t arena, std::span<const Segment> segments) = 0;

  // The state arena for (arena, buffer), created zero-filled on first request.
  Tensor& state_buffer(std::size_t arena, std::size_t buffer);

 private:
  static constexpr std::size_t kNoGroup = static_cast<std::size_t>(-1);
  void require_optimized(const Parameter& parameter, const char* what) const;

  ParameterRegistry& registry_;
  std::vector<std::vector<Parameter*>> groups_;
  std::vector<std::size_t> group_of_;         // per registry index; npos when not optimized
  std::vector<std::int64_t> steps_;           // per registry index
  std::vector<std::uint32_t> present_;        // per registry index: bit b = holds state in buffer b
  std::vector<std::string> buffer_names_;
  std::vector<std::vector<Tensor>> buffers_;  // [arena][buffer], undefined until requested
};

// The registry's trainable parameters, in registration order: the default single group.
std::vector<Parameter*> trainable_parameters(ParameterRegistry& registry);

}  // namespace gradsync::optim
