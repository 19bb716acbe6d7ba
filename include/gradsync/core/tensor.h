// gradsync/core/tensor.h - a typed, shaped, contiguous block of memory on one device.
//
// A Tensor is a handle: copying it copies the handle, not the data (use clone() for that).
// It either owns its storage or is a view into another tensor's storage at an element
// offset. Views are how the parameter registry hands out parameters and gradients: all of a
// (device, dtype) group live in one flat arena, and each parameter is a view of it.
// Tensors are always contiguous and row-major; gradsync never needs strides, and leaving
// them out keeps every kernel a flat loop.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/core/device.h"
#include "gradsync/core/dtype.h"
#include "gradsync/core/error.h"

namespace gradsync {

using Shape = std::vector<std::int64_t>;  // a tensor's dimensions, outermost first

// Product of the dimensions; throws on a negative dimension or on overflow, naming the shape.
std::int64_t shape_numel(const Shape& shape);
std::string shape_str(const Shape& shape);  // "[3, 4]"

// Raw memory on one device. Owned storage is freed with the right allocator when the last
// tensor referring to it goes away; borrowed storage (Tensor::wrap) is never freed by us.
// Paged storage (host only) is an anonymous mapping: zero, and committed page by page when
// first written, so a large buffer costs the memory of the pages in use, and
// Tensor::zero_releasing_pages gives pages back.
class Storage {
 public:
  static std::shared_ptr<Storage> allocate(std::size_t nbytes, Device device);  // owned, uninitialized
  static std::shared_ptr<Storage> allocate_paged(std::size_t nbytes, Device device);  // paged (host), zero
  // Borrowed: the caller's memory, kept alive by the caller.
  static std::shared_ptr<Storage> borrow(void* data, std::size_t nbytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }             // the first byte
  std::size_t nbytes() const { return nbytes_; }    // its size
  Device device() const { return device_; }         // where it lives
  bool owned() const { return kind_ != Kind::borrowed; }  // freed by gradsync when the last tensor goes
  bool paged() const { return kind_ == Kind::paged; }     // committed page by page (above)

 private:
  enum class Kind { owned, paged, borrowed };
  Storage(void* data, std::size_t nbytes, Device device, Kind kind)
      : data_(data), nbytes_(nbytes), device_(device), kind_(kind) {}
  void* data_;
  std::size_t nbytes_;
  Device device_;
  Kind kind_;
};

// A handle to elements of one dtype on one device, in row-major order: an owning tensor or a
// view of another's storage (a parameter is a view of its arena). Copying a Tensor copies the
// handle, not the elements (clone() copies them).
class Tensor {
 public:
  Tensor() = default;  // an empty handle: defined() is false

  // New owning tensors. empty() leaves the memory uninitialized; zeros() fills with zero.
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());  // filled with zero
  // Zeros whose host memory is committed page by page as it is first written (Storage's paged
  // kind): what a buffer of which only parts are in use at a time wants, such as the gradient
  // arena under ZeRO stage 2. On a CUDA device it is zeros(): device memory is committed at once.
  static Tensor zeros_paged(const Shape& shape, DType dtype, Device device = Device::cpu());
  // A CPU f32/f64 tensor holding a copy of the given values (convenient in tests/examples).
  static Tensor from_vector(const std::vector<float>& values, const Shape& shape);
  static Tensor from_vector(const std::vector<double>& values, const Shape& shape);
  // A non-owning tensor over memory the caller keeps alive (an engine's own buffers).
  static Tensor wrap(void* data, const Shape& shape, DType dtype, Device device = Device::cpu());

  bool defined() const { return storage_ != nullptr; }  // false for an empty handle
  const Shape& shape() const { return shape_; }          // its dimensions
  std::int64_t dim(std::size_t axis) const;               // one dimension (an error past the last)
  std::int64_t numel() const { return numel_; }           // the number of elements
  // The bytes of its elements.
  std::size_t nbytes() const { return static_cast<std::size_t>(numel_) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }                  // the element type
  Device device() const { return device_; }               // where the elements live

  // Element offset of this tensor inside its storage (0 for an owning tensor).
  std::size_t storage_offset() const { return offset_; }
  bool is_view() const;  // true unless this handle covers all of storage it owns
  bool shares_storage_with(const Tensor& other) const { return storage_ == other.storage_; }  // same memory

  void* data() const;  // the first element (device memory for a CUDA tensor)
  // Typed pointer; throws if T does not match the dtype (T: float, double, Half, BFloat16,
  // std::int32_t, std::int64_t).
  template <typename T>
  T* data_as() const;

  // A view of numel(shape) elements starting `offset` elements into this tensor.
  Tensor view(std::size_t offset, const Shape& shape) const;
  // The same elements with another shape (same element count).
  Tensor reshape(const Shape& shape) const;
  Tensor flatten() const { return reshape({numel_}); }  // the same elements, one dimension

  // Deep copies. to() returns *this (no copy) when the tensor is already on `device`.
  Tensor clone() const;
  Tensor to(Device device) const;  // a copy on `device` (*this when it is there already)
  Tensor to(DType dtype) const;  // cast, on the same device

  // Copies another tensor's elements into this one: same dtype and element count, any devices.
  void copy_from(const Tensor& source);

  // Sets every element to zero. On paged storage the whole pages this tensor covers are given
  // back to the system rather than written (they read as zeros, and cost nothing until written
  // again); the partial pages at its ends are zero-filled. Elsewhere it is a plain zero fill.
  void zero_releasing_pages();

  // Host copy of the elements converted to double (for tests, messages and small reads).
  std::vector<double> to_double_vector() const;

  std::string describe() const;  // "f32[3, 4] on cpu"

 private:
  Tensor(std::shared_ptr<Storage> storage, std::size_t offset, Shape shape, DType dtype);
  void require_dtype(DType expected) const;
  Tensor to_device_copy(Device device) const;

  std::shared_ptr<Storage> storage_;
  std::size_t offset_ = 0;  // in elements
  Shape shape_;
  std::int64_t numel_ = 0;
  DType dtype_ = DType::f32;
  Device device_;
};

// The DType that a C++ element type stores as.
template <typename T>
constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }          // float: f32
template <> constexpr DType dtype_of<double>() { return DType::f64; }         // double: f64
template <> constexpr DType dtype_of<Half>() { return DType::f16; }           // Half: f16
template <> constexpr DType dtype_of<BFloat16>() { return DType::bf16; }      // BFloat16: bf16
template <> constexpr DType dtype_of<std::int32_t>() { return DType::i32; }   // std::int32_t: i32
template <> constexpr DType dtype_of<std::int64_t>() { return DType::i64; }   // std::int64_t: i64

template <typename T>
T* Tensor::data_as() const {
  require_dtype(dtype_of<T>());
  return static_cast<T*>(data());
}

}  // namespace gradsync
