#include "gradsync/io/registry_checkpoint.h"

#include <set>
#include <sstream>

namespace gradsync::io {

std::string grad_key(const std::string& parameter_name) { return parameter_name + ".grad"; }

void save_registry(const ParameterRegistry& registry, const std::filesystem::path& path,
                   const RegistrySaveOptions& options) {
  GRADSYNC_CHECK(registry.finalized(), "cannot save registry to '", path.string(), "': it is not finalized");
  std::vector<NamedTensor> tensors;
  std::set<std::string> names;
  const auto add = [&](const std::string& name, const Tensor& tensor) {
    GRADSYNC_CHECK(names.insert(name).second, "cannot save registry to '", path.string(), "': the name '", name,
                   "' is used twice (a parameter's name collides with another's gradient key)");
    tensors.push_back({name, tensor});
  };
  for (const Parameter& parameter : registry) add(parameter.name(), parameter.value());
  if (options.include_grads) {
    for (const Parameter& parameter : registry) {
      if (parameter.grad_defined()) add(grad_key(parameter.name()), parameter.grad());
    }
  }
  Metadata metadata = options.metadata;
  metadata.emplace("format", "pt");  // what transformers/safetensors readers expect of a torch state dict
  metadata.emplace("gradsync.kind", "registry");
  save_safetensors(path, tensors, metadata);
}

namespace {

// Joins message parts into one line (GCC 12's -Wrestrict misfires on chains of
// std::string operator+, so lines are streamed instead).
template <typename... Parts>
std::string line(const Parts&... parts) {
  std::ostringstream text;
  (text << ... << parts);
  return text.str();
}

// Appends a line to `differences` when the file's entry does not match the parameter's value
// (or gradient) of dtype `dtype`. With `convert`, any floating dtype matches a floating one.
void compare_entry(const SafetensorsReader& file, const std::string& key, const Parameter& parameter, DType dtype,
                   bool convert, std::vector<std::string>& differences) {
  const TensorInfo* info = file.find(key);
  if (info == nullptr) {
    differences.push_back(line("'", key, "' is missing from the file (registered as ", dtype_name(dtype),
                               shape_str(parameter.shape()), ")"));
    return;
  }
  if (info->shape != parameter.shape()) {
    differences.push_back(line("'", key, "' has shape ", shape_str(info->shape), " in the file, ",
                               shape_str(parameter.shape()), " registered"));
  }
  const bool convertible = convert && info->dtype && is_floating(*info->dtype) && is_floating(dtype);
  if (info->dtype != dtype && !convertible) {
    differences.push_back(line("'", key, "' has dtype ", info->dtype_label(), " in the file, ", dtype_name(dtype),
                               " registered", convert ? " (only floating dtypes convert)" : ""));
  }
}

// The file's tensor in `dtype` (rounded to nearest even when it narrows).
Tensor read_as(const SafetensorsReader& file, const std::string& key, DType dtype) {
  Tensor data = file.read(key);
  return data.dtype() == dtype ? data : data.to(dtype);
}

}  // namespace

Metadata load_registry(ParameterRegistry& registry, const std::filesystem::path& path,
                       const RegistryLoadOptions& options) {
  GRADSYNC_CHECK(registry.finalized(), "cannot load '", path.string(), "' into the registry: it is not finalized");
  const SafetensorsReader file(path);

  // 1. Compare everything and report every difference at once.
  std::vector<std::string> differences;
  std::set<std::string> expected;
  for (const Parameter& parameter : registry) {
    expected.insert(parameter.name());
    compare_entry(file, parameter.name(), parameter, parameter.dtype(), options.convert_dtypes, differences);
    if (options.load_grads && file.find(grad_key(parameter.name())) != nullptr) {
      expected.insert(grad_key(parameter.name()));
      compare_entry(file, grad_key(parameter.name()), parameter, parameter.grad_dtype(), options.convert_dtypes,
                    differences);
      if (!parameter.requires_grad()) {
        differences.push_back(line("'", grad_key(parameter.name()), "' is a gradient for a frozen parameter"));
      }
    }
  }
  if (!options.allow_extra_tensors) {
    for (const TensorInfo& info : file.tensors()) {
      if (!expected.contains(info.name)) {
        differences.push_back(line("'", info.name, "' is in the file but matches no registered parameter"));
      }
    }
  }
  if (!differences.empty()) {
    std::ostringstream message;
    message << "checkpoint '" << path.string() << "' does not match the registry (" << differences.size()
            << (differences.size() == 1 ? " difference" : " differences") << "):";
    for (const std::string& line : differences) message << "\n  - " << line;
    throw Error(message.str());
  }

  // 2. Stage: read all the data. Any read error leaves the registry untouched.
  std::vector<Tensor> values;
  std::vector<Tensor> grads;
  for (const Parameter& parameter : registry) {
    values.push_back(read_as(file, parameter.name(), parameter.dtype()));
    const bool has_grad = options.load_grads && file.find(grad_key(parameter.name())) != nullptr;
    grads.push_back(has_grad ? read_as(file, grad_key(parameter.name()), parameter.grad_dtype()) : Tensor());
  }

  // 3. Commit.
  for (std::size_t index = 0; index < registry.size(); ++index) {
    Parameter& parameter = registry[index];
    parameter.value().copy_from(values[index]);
    if (!options.load_grads) continue;
    if (grads[index].defined()) {
      parameter.set_grad(grads[index]);
    } else {
      parameter.zero_grad(/*set_to_undefined=*/true);
    }
  }
  return file.metadata();
}

}  // namespace gradsync::io
