// gradsync/io/safetensors_set.h - a model stored as several safetensors files with an index, the
// form pretrained models ship in (Hugging Face's model.safetensors.index.json), or as one file.
//
//   io::SafetensorsSet model("checkpoint/model.safetensors.index.json");
//   Tensor mine = model.read_range("model.layers.3.mlp.up_proj.weight", begin, count, DType::f32);
//
// The index is JSON: {"metadata": {...}, "weight_map": {"<tensor>": "<file>", ...}}, each file a
// name in the index's folder. Opening the set validates all of it before anything is read: the
// index's JSON, each file name (a plain name in that folder, no path), each file (every header
// validated as SafetensorsReader validates one, so a truncated file is found here), that every
// tensor the index maps is in the file it names, that no tensor is named twice (in the index, or
// in two files), and metadata.total_size when the index gives it. Every error names the index
// and the file or tensor at fault. Reading by ranges reads only the bytes of the range, from the
// one file that holds the tensor.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gradsync/io/safetensors.h"

namespace gradsync::io {

// A set of safetensors files read as one model (above).
class SafetensorsSet {
 public:
  // `path`: an index (a .json file) or a single .safetensors file (a set of one).
  explicit SafetensorsSet(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }  // the index, or the one file
  const Metadata& metadata() const { return metadata_; }  // the index's "metadata" (strings), or the file's
  std::vector<std::string> names() const;                  // every tensor, sorted
  const TensorInfo* find(std::string_view name) const;     // nullptr when absent
  // The file that holds tensor `name` (an error naming it when absent).
  const SafetensorsReader& file_of(std::string_view name) const;

  Tensor read(std::string_view name) const;  // the whole tensor, as SafetensorsReader::read
  // Elements [first, first + count) of tensor `name`, as SafetensorsReader::read_range.
  Tensor read_range(std::string_view name, std::int64_t first, std::int64_t count,
                    std::optional<DType> dtype = std::nullopt) const;

 private:
  std::filesystem::path path_;
  Metadata metadata_;
  std::vector<std::unique_ptr<SafetensorsReader>> files_;
  std::map<std::string, std::size_t, std::less<>> owner_;  // tensor -> its file in files_
};

}  // namespace gradsync::io
