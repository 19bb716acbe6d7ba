// gradsync/registry/parameter.h - one named parameter: a view into its registry's arenas.
//
// A Parameter is created by ParameterRegistry::add() and lives as long as the registry. Its
// value and gradient are views into the flat arenas, available once the registry is
// finalized. The gradient is either *defined* or *undefined* (PyTorch's None); that is a
// semantic difference, not a zero: optimizers skip undefined gradients, and DDP leaves
// globally unused parameters undefined.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "gradsync/core/tensor.h"

namespace gradsync {

class ParameterRegistry;

// One named parameter of a registry (above).
class Parameter {
 public:
  const std::string& name() const { return name_; }  // unique in its registry
  const Shape& shape() const { return shape_; }      // its dimensions
  std::int64_t numel() const { return numel_; }      // its number of elements
  DType dtype() const { return dtype_; }             // the value's dtype
  DType grad_dtype() const { return grad_dtype_; }  // the gradient's dtype (usually dtype())
  Device device() const { return device_; }              // where value and gradient live
  bool requires_grad() const { return requires_grad_; }  // trainable (false: a frozen buffer)
  std::size_t index() const { return index_; }  // registration order, identical on every rank

  // Where the parameter lives: which arena, and its element offset in it.
  std::size_t arena_index() const { return arena_index_; }
  std::size_t arena_offset() const { return arena_offset_; }  // its first element in the arena

  // The value, for reading and writing (initialization, optimizer updates).
  Tensor& value();
  const Tensor& value() const;

  // The gradient buffer, for reading. Check grad_defined() before trusting its contents.
  const Tensor& grad() const;
  bool grad_defined() const { return grad_defined_; }  // false: PyTorch's None

  // Gradient writes. Each marks the gradient defined.
  //  * set_grad copies `gradient` in (any device, grad_dtype() and the element count).
  //  * accumulate_grad adds it, or copies it when the gradient was undefined.
  //  * grad_for_overwrite returns the buffer for the engine to write every element itself.
  //  * grad_for_accumulate returns the buffer for the engine to add into; an undefined
  //    gradient is zero-filled first, so accumulation always starts from zero.
  // On a frozen parameter (requires_grad false) each of them is an error naming it.
  void set_grad(const Tensor& gradient);
  void accumulate_grad(const Tensor& gradient);  // (above)
  Tensor& grad_for_overwrite();                  // (above)
  Tensor& grad_for_accumulate();                 // (above)

  // Sets the gradient to zero (defined) or back to undefined.
  void zero_grad(bool set_to_undefined = true);

  // Marks the gradient defined without touching it: for the reduction engine, which writes
  // results into the buffer itself.
  void mark_grad_defined();

  // Sharded gradients (ZeRO stages 2 and 3): the buffer holds this rank's reduced piece of the
  // gradient, set by the Reducer when it writes one. A later backward that adds into it must
  // have the piece set aside first (DataParallel::begin_backward does), or it would be reduced
  // again. set_grad, grad_for_overwrite and zero_grad discard the old gradient and clear it.
  void mark_grad_reduced_piece(bool holds) { grad_reduced_piece_ = holds; }
  bool grad_holds_reduced_piece() const { return grad_reduced_piece_; }  // (above)

  // Sharded parameters (ZeRO stage 3, dist/zero.h): while `why` is set, this rank does not hold
  // the whole value, and value() is an error that names the parameter and says `why` (which
  // unit to gather). Null: the value is here.
  void set_value_released(std::shared_ptr<const std::string> why) { released_ = std::move(why); }
  bool value_released() const { return released_ != nullptr; }  // this rank holds only its piece

 private:
  friend class ParameterRegistry;
  Parameter(std::string name, Shape shape, DType dtype, DType grad_dtype, Device device, bool requires_grad,
            std::size_t index);
  void require_finalized(const char* what) const;
  void require_trainable(const char* what) const;

  std::string name_;
  Shape shape_;
  std::int64_t numel_;
  DType dtype_;
  DType grad_dtype_;
  Device device_;
  bool requires_grad_;
  std::size_t index_;
  std::size_t arena_index_ = 0;
  std::size_t arena_offset_ = 0;
  Tensor value_;
  Tensor grad_;
  bool grad_defined_ = false;
  bool grad_reduced_piece_ = false;
  std::shared_ptr<const std::string> released_;
};

}  // namespace gradsync
