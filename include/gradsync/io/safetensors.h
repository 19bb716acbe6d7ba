// gradsync/io/safetensors.h - named tensors in the safetensors file format.
//
// The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
// length N, then N bytes of JSON mapping each tensor name to {"dtype", "shape",
// "data_offsets": [begin, end]} plus an optional "__metadata__" string-to-string map, then
// the raw little-endian tensor bytes. Offsets are relative to the end of the header.
//
// Writing follows the reference library's layout (tensors ordered by element size, then
// name; header padded with spaces to a multiple of 8, so every tensor is aligned to its
// element size), and so files we write load in the reference library and in PyTorch.
// Writing is atomic: a temporary file in the same folder is written, flushed, fsync'ed and
// renamed over the target, so a failed save never damages the previous file.
//
// Reading validates the whole header before any data is used, and rejects every malformed
// or hostile file with an Error naming the file and the problem: truncated files, a header
// length past the end, bad JSON, unknown dtypes, shape/size mismatches, offsets out of
// range, overlapping or leaving holes (the reference library rejects holes too).
// A tensor of a dtype the format defines but gradsync does not compute with (BOOL, U8,
// F8_E4M3..., which PyTorch writes next to the weights) is listed with no DType: the file
// opens, the other tensors read, and only reading that one is an error naming it.
#pragma once

#include <filesystem>
#include <memory>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <string_view>
#include <vector>

#include "gradsync/core/tensor.h"

namespace gradsync::io {

using Metadata = std::map<std::string, std::string>;  // the header's __metadata__: strings by key

// A tensor with the name it has in a file.
struct NamedTensor {
  std::string name;  // unique in its file
  Tensor tensor;  // any device; device tensors are copied to the host for writing
};

// Writes `tensors` (unique, non-empty names; "__metadata__" is reserved) and `metadata`.
void save_safetensors(const std::filesystem::path& path, const std::vector<NamedTensor>& tensors,
                      const Metadata& metadata = {});

// A tensor's header entry before its data exists.
struct TensorSpec {
  std::string name;  // unique in its file
  DType dtype;       // of the stored elements
  Shape shape;       // its dimensions
};

// Where everything goes in a file save_safetensors would write for these tensors: the bytes
// before the data (the 8-byte length and the padded header) and each tensor's first byte.
struct SafetensorsLayout {
  std::string head;                  // the header length and the header, as written
  std::vector<std::size_t> offsets;  // each spec's first byte from the file's start, in spec order
  std::size_t file_bytes = 0;        // the whole file
};
// The layout of `specs` and `metadata` (the same checks as save_safetensors, naming `path`): a
// pure function of them, so ranks that agree on the tensors agree on every byte offset.
SafetensorsLayout layout_safetensors(const std::filesystem::path& path, const std::vector<TensorSpec>& specs,
                                     const Metadata& metadata = {});

// One tensor's entry in a file's header, validated.
struct TensorInfo {
  std::string name;            // its key in the header
  std::optional<DType> dtype;  // empty: a format dtype gradsync does not handle (see stored_dtype)
  Shape shape;                 // its dimensions
  std::size_t data_begin;  // byte offsets relative to the start of the data section
  std::size_t data_end;    // (one past its last byte)
  std::string stored_dtype;  // the file's name for it: "F32", "BOOL", ...

  // For messages: gradsync's name ("f32") when it has one, else the file's ("BOOL").
  std::string dtype_label() const;
};

class ReadableFile;

// Opens a file and validates its header. Tensor data is read on demand, through the descriptor
// opened here (the file is opened once: only a regular file, never a FIFO or a device).
class SafetensorsReader {
 public:
  explicit SafetensorsReader(std::filesystem::path path);  // an error naming the file and the fault

  const std::filesystem::path& path() const { return path_; }  // the file
  const Metadata& metadata() const { return metadata_; }       // its __metadata__
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in data order
  const TensorInfo* find(std::string_view name) const;  // nullptr when absent

  // Reads one tensor into a new CPU tensor; throws naming it if absent or of a dtype gradsync
  // does not handle.
  Tensor read(std::string_view name) const;
  // Reads every tensor.
  std::vector<NamedTensor> read_all() const;
  // Reads elements [first, first + count) of tensor `name` (its elements in row-major order)
  // into a new CPU tensor of shape {count}: only those bytes are read from the file, so a rank
  // takes its piece of a tensor it never holds whole. `dtype`: converted on the way in (a bf16
  // file into f32 masters; nearest even when narrowing); unset: the file's. Errors name the file
  // and the tensor: absent, a dtype gradsync does not handle, a range outside the tensor.
  Tensor read_range(std::string_view name, std::int64_t first, std::int64_t count,
                    std::optional<DType> dtype = std::nullopt) const;

  // The largest header we accept, as the reference library does (100 MB).
  static constexpr std::size_t kMaxHeaderBytes = 100'000'000;

 private:
  Tensor read_tensor(const TensorInfo& info) const;

  std::filesystem::path path_;
  std::shared_ptr<const ReadableFile> file_;  // open for the reader's life (shared by its copies)
  std::size_t data_start_ = 0;  // 8 + header length
  Metadata metadata_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, std::size_t> index_;  // name -> position in tensors_
};

}  // namespace gradsync::io
