// Writes, with gradsync, the same tensors that generate_fixtures.py writes with the
// reference library (names, shapes, dtypes and values by the shared formula), so that
// check_interop.py can read our file with the reference library and compare.
#include <cstdio>

#include "gradsync/io/safetensors.h"

using namespace gradsync;

namespace {
// Must match reference_value() in generate_fixtures.py.
double reference_value(std::int64_t index, DType dtype) {
  if (dtype == DType::i32) return static_cast<double>((index * 7919) % 100003 - 50000);
  if (dtype == DType::i64) return static_cast<double>(index * 1000000007 - 3 * (std::int64_t{1} << 40));
  return static_cast<double>(index - 7) * 0.25;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: interop_writer OUTPUT.safetensors\n");
    return 2;
  }
  const std::vector<std::pair<std::string, Shape>> shapes{
      {"scalar", {}}, {"vector", {5}}, {"matrix", {3, 4}}, {"cube", {2, 3, 2}}, {"empty", {0, 3}}};
  std::vector<io::NamedTensor> tensors;
  for (DType dtype : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64}) {
    for (const auto& [shape_name, shape] : shapes) {
      const std::int64_t numel = shape_numel(shape);
      std::vector<double> values(static_cast<std::size_t>(numel));
      for (std::int64_t i = 0; i < numel; ++i) values[static_cast<std::size_t>(i)] = reference_value(i, dtype);
      Tensor tensor = Tensor::empty(shape, dtype);
      if (numel > 0) {
        // i64 values up to ~1e10 are exact in double, so converting from f64 loses nothing.
        Tensor source = Tensor::from_vector(values, {numel});
        tensor.copy_from(source.to(dtype).reshape(shape));
      }
      tensors.push_back({std::string(dtype_name(dtype)) + "." + shape_name, tensor});
    }
  }
  try {
    io::save_safetensors(argv[1], tensors, {{"writer", "gradsync"}});
  } catch (const Error& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return 1;
  }
  return 0;
}
