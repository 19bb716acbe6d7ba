#include "gradsync/core/dtype.h"

#include "gradsync/core/error.h"

namespace gradsync {

namespace {
struct DTypeInfo {
  DType dtype;
  std::size_t size;
  const char* name;
  const char* safetensors_name;
  bool floating;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::f32, 4, "f32", "F32", true},   {DType::f64, 8, "f64", "F64", true},
    {DType::f16, 2, "f16", "F16", true},   {DType::bf16, 2, "bf16", "BF16", true},
    {DType::i32, 4, "i32", "I32", false},  {DType::i64, 8, "i64", "I64", false},
};

const DTypeInfo& info(DType dtype) {
  const auto index = static_cast<std::size_t>(dtype);
  GRADSYNC_CHECK(index < std::size(kDTypes), "invalid dtype value ", index);
  return kDTypes[index];
}
}  // namespace

std::size_t dtype_size(DType dtype) { return info(dtype).size; }
const char* dtype_name(DType dtype) { return info(dtype).name; }
const char* dtype_safetensors_name(DType dtype) { return info(dtype).safetensors_name; }
bool is_floating(DType dtype) { return info(dtype).floating; }

DType dtype_from_safetensors_name(std::string_view name) {
  for (const DTypeInfo& entry : kDTypes) {
    if (name == entry.safetensors_name) return entry.dtype;
  }
  detail::throw_error("unsupported dtype '", name, "' (gradsync handles F32, F64, F16, BF16, I32, I64)");
}

}  // namespace gradsync
