// gradsync/registry/parameter_registry.h - named parameters in flat arenas, and readiness.
//
// Life cycle:
//   1. add() every parameter (name, shape, dtype, device). Registration order is the order
//      every rank uses for buckets, checkpoints and collectives.
//   2. finalize(): one contiguous value buffer and one gradient buffer per (device, dtype),
//      the "arenas", are allocated (zero-filled), and each parameter becomes a view of them.
//      Each parameter starts at a multiple of kArenaAlignmentBytes (256 bytes), so any
//      parameter boundary can start a bucket or a vectorized kernel.
//   3. Training: the engine writes gradients through Parameter's grad_for_* / set_grad, then
//      calls mark_ready(). Listeners (the reducer, the distributed optimizer, DDP) hear about
//      it at once, on the engine's thread.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gradsync/registry/parameter.h"

namespace gradsync {

// Each parameter's first element sits at a multiple of this many bytes from its arena's
// start (and the arena itself is 256-byte aligned): 64 f32 elements, 128 f16 elements.
inline constexpr std::size_t kArenaAlignmentBytes = 256;

// One (device, dtype, gradient dtype) group: all its parameters' values in one buffer, their
// gradients in a second buffer with the same element layout. Padding between parameters is
// zero and stays zero.
struct Arena {
  Device device;                        // where both buffers live
  DType dtype;                          // of the values
  DType grad_dtype;                     // of the gradients: usually dtype; f32 for a 16-bit
                                        // model that accumulates its gradients in f32
  Tensor values;                        // 1-D, numel() elements including padding
  Tensor grads;                         // same element layout as values, in grad_dtype
  std::vector<std::size_t> parameters;  // registry indices, in registration order
};

// Named parameters in flat arenas, and their readiness (the life cycle above).
class ParameterRegistry {
 public:
  using ReadyListener = std::function<void(Parameter&)>;  // hears each mark_ready, on the caller's thread

  ParameterRegistry() = default;
  ParameterRegistry(const ParameterRegistry&) = delete;
  ParameterRegistry& operator=(const ParameterRegistry&) = delete;

  // Registers a parameter. Its gradient has the parameter's dtype unless `grad_dtype` says
  // otherwise: a bf16/f16 model may keep f32 gradients (Megatron's "main grads"), so that
  // accumulation over micro-batches and the reduction run in f32. Errors (each naming the
  // parameter): empty or duplicate name, a zero-sized or negative dimension, a non-floating
  // gradient dtype or one that differs for an f32/f64 parameter, registration after finalize().
  Parameter& add(const std::string& name, const Shape& shape, DType dtype = DType::f32,
                 Device device = Device::cpu(), bool requires_grad = true,
                 std::optional<DType> grad_dtype = std::nullopt);

  // Allocates the arenas. Idempotent: a second call does nothing. An empty registry is an error.
  void finalize();
  bool finalized() const { return finalized_; }  // the arenas are allocated

  std::size_t size() const { return parameters_.size(); }  // the number of parameters
  bool empty() const { return parameters_.empty(); }       // none registered yet
  Parameter& operator[](std::size_t index);                // by registration index
  const Parameter& operator[](std::size_t index) const;
  Parameter& at(std::string_view name);  // throws, naming it, when absent
  const Parameter& at(std::string_view name) const;
  Parameter* find(std::string_view name);  // nullptr when absent
  const Parameter* find(std::string_view name) const;
  bool contains(std::string_view name) const { return find(name) != nullptr; }  // a parameter has this name

  // Iteration in registration order: for (Parameter& p : registry) ...
  class Iterator;
  Iterator begin() const;  // the first parameter
  Iterator end() const;    // past the last

  const std::vector<Arena>& arenas() const;  // after finalize(), in first-use order

  // zero_grad over every parameter (frozen ones stay undefined).
  void zero_grad(bool set_to_undefined = true);

  // Total elements / bytes of parameter values (without padding).
  std::int64_t total_numel() const;

  // --- Autograd-free readiness -------------------------------------------------------------
  // "This parameter's gradient is complete for this backward pass." The gradient must be
  // defined (write it first) and the parameter trainable; otherwise it is an error naming
  // the parameter. Listeners run in subscription order on the calling thread.
  void mark_ready(Parameter& parameter);
  void mark_ready(std::string_view name) { mark_ready(at(name)); }

  // Subscribes a listener; it stays subscribed while the returned handle lives.
  class Subscription;
  [[nodiscard]] Subscription on_ready(ReadyListener listener);  // (above)

 private:
  void require_finalized(const char* what) const;

  std::vector<std::unique_ptr<Parameter>> parameters_;
  std::vector<Arena> arenas_;
  bool finalized_ = false;

  struct ListenerSlot {
    std::uint64_t id;
    ReadyListener listener;
  };
  std::vector<ListenerSlot> listeners_;
  std::uint64_t next_listener_id_ = 1;
  int notify_depth_ = 0;  // > 0 while mark_ready runs listeners
  void unsubscribe(std::uint64_t id);
};

// A forward iterator over the parameters, in registration order.
class ParameterRegistry::Iterator {
 public:
  using value_type = Parameter;            // what it visits
  using difference_type = std::ptrdiff_t;  // (a standard iterator's)
  Iterator(const std::unique_ptr<Parameter>* position) : position_(position) {}  // at a registry slot
  Parameter& operator*() const { return **position_; }         // the parameter here
  Parameter* operator->() const { return position_->get(); }   // its members
  // The next parameter.
  Iterator& operator++() {
    ++position_;
    return *this;
  }
  bool operator==(const Iterator& other) const = default;  // at the same slot

 private:
  const std::unique_ptr<Parameter>* position_;
};

// A ready listener's subscription: it unsubscribes when it goes (movable, not copyable).
class ParameterRegistry::Subscription {
 public:
  Subscription() = default;
  Subscription(Subscription&& other) noexcept;  // takes over `other`'s subscription
  Subscription& operator=(Subscription&& other) noexcept;  // unsubscribes its own, takes `other`'s
  ~Subscription();
  void reset();  // unsubscribes now

 private:
  friend class ParameterRegistry;
  Subscription(ParameterRegistry* registry, std::uint64_t id) : registry_(registry), id_(id) {}
  ParameterRegistry* registry_ = nullptr;
  std::uint64_t id_ = 0;
};

}  // namespace gradsync
