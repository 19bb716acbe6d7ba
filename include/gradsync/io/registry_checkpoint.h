// gradsync/io/registry_checkpoint.h - save and load a whole ParameterRegistry.
//
// A checkpoint is one safetensors file: each parameter's value under its own name and,
// optionally, each *defined* gradient under "<name>.grad" (undefined gradients are simply
// absent, so the defined/undefined distinction survives a round trip). Files written by
// PyTorch (torch's safetensors.save_file of a state_dict) load directly when names match.
//
// Loading checks every parameter's name, shape and dtype against the registry first and
// reports every difference in one error; then it reads all data into staging buffers; only
// when all of that succeeded does it copy into the registry. A bad file leaves the registry
// exactly as it was.
#pragma once

#include <filesystem>

#include "gradsync/io/safetensors.h"
#include "gradsync/registry/parameter_registry.h"

namespace gradsync::io {

// What save_registry writes besides the values.
struct RegistrySaveOptions {
  bool include_grads = false;  // the defined gradients too, as "<name>.grad"
  Metadata metadata;  // stored in the header's __metadata__
};

// What load_registry accepts besides exactly the registry's values.
struct RegistryLoadOptions {
  // Load "<name>.grad" entries too: present ones become defined gradients, absent ones
  // leave the gradient undefined.
  bool load_grads = false;
  // Tolerate tensors in the file that belong to no parameter (e.g. optimizer state saved
  // in the same file). Off by default: an unexpected tensor is reported as a difference.
  bool allow_extra_tensors = false;
  // Load a floating tensor of another dtype by converting it (round to nearest even when it
  // narrows): an f32 checkpoint into a bf16 model, or back. Off by default, so that a dtype
  // mismatch is reported. With mixed precision, Optimizer::load_master_weights() also keeps
  // the f32 values as the master copy instead of their rounded 16-bit image.
  bool convert_dtypes = false;
};

std::string grad_key(const std::string& parameter_name);  // "<name>.grad": a gradient's name in a file

// Every parameter's value under its name (PyTorch's safetensors loader reads them as a state
// dict), atomically: a failed save leaves the previous file whole.
void save_registry(const ParameterRegistry& registry, const std::filesystem::path& path,
                   const RegistrySaveOptions& options = {});

// Loads every parameter's value from a file save_registry (or PyTorch) wrote, after validating
// every tensor (names, dtypes, shapes): any difference is one error listing them all, and
// nothing changes. Returns the file's metadata.
Metadata load_registry(ParameterRegistry& registry, const std::filesystem::path& path,
                       const RegistryLoadOptions& options = {});

}  // namespace gradsync::io
