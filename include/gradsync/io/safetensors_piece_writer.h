// gradsync/io/safetensors_piece_writer.h - one safetensors file written by several processes at
// once, each its pieces of the tensors, atomically (dist::ZeroOptimizer::save_model's writer).
//
//   io::SafetensorsPieceWriter file(path, specs, metadata);  // every rank: the same header
//   rank 0:      temporary = file.create();                  // header written, file sized
//   (the name reaches the others; they) file.open(temporary);
//   every rank:  file.write("layers.3.weight", first_element, my_piece); ... file.flush();
//   (once every rank has flushed) rank 0: file.commit();     // renamed over `path`
//
// The bytes are the ones save_safetensors writes for the same tensors and metadata (the same
// layout, layout_safetensors), so the file loads in PyTorch and in the reference library. The
// creator owns the temporary file beside `path`: destroyed before commit() it removes it, so a
// save that fails anywhere leaves the previous file as it was. The processes must see the same
// folder (one machine, or a shared file system).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gradsync/io/safetensors.h"

namespace gradsync::io {

class AtomicFileWriter;

// One writer per process (above).
class SafetensorsPieceWriter {
 public:
  // The layout of the file (layout_safetensors): every process passes the same specs and metadata.
  SafetensorsPieceWriter(std::filesystem::path path, std::vector<TensorSpec> specs, Metadata metadata = {});
  ~SafetensorsPieceWriter();  // the creator removes its temporary unless committed
  SafetensorsPieceWriter(const SafetensorsPieceWriter&) = delete;
  SafetensorsPieceWriter& operator=(const SafetensorsPieceWriter&) = delete;

  const SafetensorsLayout& layout() const { return layout_; }  // where every byte goes
  // The creator (one process): the temporary file, its header written and its size the whole
  // file's; returns its path, which the others open.
  std::filesystem::path create();
  void open(const std::filesystem::path& temporary);  // every other process, after create()
  // Elements [first, first + piece.numel()) of tensor `name` (row-major in the whole tensor),
  // at their place in the file. Errors name the file and the tensor: absent, another dtype,
  // a range outside the tensor.
  void write(std::string_view name, std::int64_t first, const Tensor& piece);
  void flush();   // this process's writes on the disk; its descriptor closed
  void commit();  // the creator, once every process has flushed: renamed over the path

 private:
  std::filesystem::path path_;
  std::vector<TensorSpec> specs_;
  SafetensorsLayout layout_;
  std::map<std::string, std::size_t, std::less<>> index_;  // name -> spec
  std::unique_ptr<AtomicFileWriter> file_;
};

}  // namespace gradsync::io
