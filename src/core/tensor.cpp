#include "gradsync/core/tensor.h"

#include <limits>
#include <sstream>

#include "convert.h"
#include "device_memory.h"

namespace gradsync {

std::int64_t shape_numel(const Shape& shape) {
  std::int64_t numel = 1;
  for (const std::int64_t extent : shape) {
    GRADSYNC_CHECK(extent >= 0, "negative dimension in shape ", shape_str(shape));
    GRADSYNC_CHECK(extent == 0 || numel <= std::numeric_limits<std::int64_t>::max() / extent,
                   "shape ", shape_str(shape), " has more elements than fit in 64 bits");
    numel *= extent;
  }
  return numel;
}

std::string shape_str(const Shape& shape) {
  std::ostringstream text;
  text << '[';
  for (std::size_t axis = 0; axis < shape.size(); ++axis) text << (axis ? ", " : "") << shape[axis];
  text << ']';
  return text.str();
}

// ---------------------------------------------------------------------------------------------
// Storage

std::shared_ptr<Storage> Storage::allocate(std::size_t nbytes, Device device) {
  void* data = detail::device_allocate(nbytes, device);
  return std::shared_ptr<Storage>(new Storage(data, nbytes, device, Kind::owned));
}

std::shared_ptr<Storage> Storage::allocate_paged(std::size_t nbytes, Device device) {
  if (!device.is_cpu()) return allocate(nbytes, device);
  return std::shared_ptr<Storage>(new Storage(detail::host_map_zeros(nbytes), nbytes, device, Kind::paged));
}

std::shared_ptr<Storage> Storage::borrow(void* data, std::size_t nbytes, Device device) {
  GRADSYNC_CHECK(data != nullptr || nbytes == 0, "cannot wrap a null pointer of ", nbytes, " bytes");
  return std::shared_ptr<Storage>(new Storage(data, nbytes, device, Kind::borrowed));
}

Storage::~Storage() {
  if (kind_ == Kind::owned) detail::device_free(data_, device_);
  if (kind_ == Kind::paged) detail::host_unmap(data_, nbytes_);
}

// ---------------------------------------------------------------------------------------------
// Tensor

Tensor::Tensor(std::shared_ptr<Storage> storage, std::size_t offset, Shape shape, DType dtype)
    : storage_(std::move(storage)), offset_(offset), shape_(std::move(shape)), numel_(shape_numel(shape_)),
      dtype_(dtype), device_(storage_->device()) {}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  const std::int64_t numel = shape_numel(shape);
  return Tensor(Storage::allocate(static_cast<std::size_t>(numel) * dtype_size(dtype), device), 0, shape, dtype);
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor tensor = empty(shape, dtype, device);
  detail::device_memset_zero(tensor.data(), tensor.nbytes(), device);
  return tensor;
}

Tensor Tensor::zeros_paged(const Shape& shape, DType dtype, Device device) {
  if (!device.is_cpu()) return zeros(shape, dtype, device);
  const std::int64_t numel = shape_numel(shape);
  return Tensor(Storage::allocate_paged(static_cast<std::size_t>(numel) * dtype_size(dtype), device), 0, shape, dtype);
}

void Tensor::zero_releasing_pages() {
  if (numel_ == 0) return;
  if (storage_ == nullptr || !storage_->paged()) {
    detail::device_memset_zero(data(), nbytes(), device_);
    return;
  }
  detail::host_release_zero(data(), nbytes());
}

namespace {
template <typename T>
Tensor tensor_from_values(const std::vector<T>& values, const Shape& shape) {
  GRADSYNC_CHECK(shape_numel(shape) == static_cast<std::int64_t>(values.size()), "from_vector: ", values.size(),
                 " values do not fill shape ", shape_str(shape));
  Tensor tensor = Tensor::empty(shape, dtype_of<T>());
  std::copy(values.begin(), values.end(), tensor.data_as<T>());
  return tensor;
}
}  // namespace

Tensor Tensor::from_vector(const std::vector<float>& values, const Shape& shape) {
  return tensor_from_values(values, shape);
}

Tensor Tensor::from_vector(const std::vector<double>& values, const Shape& shape) {
  return tensor_from_values(values, shape);
}

Tensor Tensor::wrap(void* data, const Shape& shape, DType dtype, Device device) {
  const std::size_t nbytes = static_cast<std::size_t>(shape_numel(shape)) * dtype_size(dtype);
  return Tensor(Storage::borrow(data, nbytes, device), 0, shape, dtype);
}

std::int64_t Tensor::dim(std::size_t axis) const {
  GRADSYNC_CHECK(axis < shape_.size(), "axis ", axis, " out of range for ", describe());
  return shape_[axis];
}

bool Tensor::is_view() const {
  return storage_ != nullptr && (offset_ != 0 || nbytes() != storage_->nbytes() || !storage_->owned());
}

void* Tensor::data() const {
  GRADSYNC_CHECK(storage_ != nullptr, "data() of an empty tensor handle");
  return static_cast<char*>(storage_->data()) + offset_ * dtype_size(dtype_);
}

void Tensor::require_dtype(DType expected) const {
  GRADSYNC_CHECK(dtype_ == expected, "tensor ", describe(), " accessed as ", dtype_name(expected));
}

Tensor Tensor::view(std::size_t offset, const Shape& shape) const {
  GRADSYNC_CHECK(storage_ != nullptr, "view of an empty tensor handle");
  const std::int64_t count = shape_numel(shape);
  GRADSYNC_CHECK(offset <= static_cast<std::size_t>(numel_) && static_cast<std::int64_t>(offset) + count <= numel_,
                 "view of ", count, " elements at offset ", offset, " is out of range for ", describe());
  return Tensor(storage_, offset_ + offset, shape, dtype_);
}

Tensor Tensor::reshape(const Shape& shape) const {
  GRADSYNC_CHECK(shape_numel(shape) == numel_, "cannot reshape ", describe(), " to ", shape_str(shape));
  return Tensor(storage_, offset_, shape, dtype_);
}

Tensor Tensor::clone() const { return to_device_copy(device_); }

Tensor Tensor::to(Device device) const {
  if (device == device_) return *this;
  return to_device_copy(device);
}

Tensor Tensor::to_device_copy(Device device) const {
  Tensor copy = empty(shape_, dtype_, device);
  copy.copy_from(*this);
  return copy;
}

Tensor Tensor::to(DType dtype) const {
  GRADSYNC_CHECK(defined(), "to(", dtype_name(dtype), ") of an empty tensor handle");
  Tensor converted = empty(shape_, dtype, device_);
  detail::convert_elements(data(), dtype_, converted.data(), dtype, numel_, device_);
  return converted;
}

void Tensor::copy_from(const Tensor& source) {
  GRADSYNC_CHECK(defined() && source.defined(), "copy between empty tensor handles");
  GRADSYNC_CHECK(source.dtype_ == dtype_ && source.numel_ == numel_, "copy from ", source.describe(), " into ",
                 describe(), ": dtype and element count must match (use to(DType) to convert)");
  detail::device_copy(data(), device_, source.data(), source.device_, nbytes());
}

std::vector<double> Tensor::to_double_vector() const {
  const Tensor host = to(Device::cpu()).to(DType::f64);
  const double* values = host.data_as<double>();
  return std::vector<double>(values, values + numel_);
}

std::string Tensor::describe() const {
  if (!defined()) return "<empty tensor>";
  return std::string(dtype_name(dtype_)) + shape_str(shape_) + " on " + device_.str();
}

}  // namespace gradsync
