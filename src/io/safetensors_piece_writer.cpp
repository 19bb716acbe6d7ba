// One safetensors file from several processes (gradsync/io/safetensors_piece_writer.h).
#include "gradsync/io/safetensors_piece_writer.h"

#include "atomic_file.h"
#include "gradsync/core/error.h"

namespace gradsync::io {

SafetensorsPieceWriter::SafetensorsPieceWriter(std::filesystem::path path, std::vector<TensorSpec> specs,
                                               Metadata metadata)
    : path_(std::move(path)), specs_(std::move(specs)), layout_(layout_safetensors(path_, specs_, metadata)) {
  for (std::size_t i = 0; i < specs_.size(); ++i) index_.emplace(specs_[i].name, i);
}

SafetensorsPieceWriter::~SafetensorsPieceWriter() = default;

std::filesystem::path SafetensorsPieceWriter::create() {
  GRADSYNC_CHECK(!file_, "cannot save '", path_.string(), "': the temporary file is already created or opened");
  file_ = std::make_unique<AtomicFileWriter>(path_);
  file_->write(layout_.head.data(), layout_.head.size());
  file_->resize(layout_.file_bytes);  // sparse: the others' pieces land in it
  return file_->temporary();
}

void SafetensorsPieceWriter::open(const std::filesystem::path& temporary) {
  GRADSYNC_CHECK(!file_, "cannot save '", path_.string(), "': the temporary file is already created or opened");
  file_ = std::make_unique<AtomicFileWriter>(path_, temporary);
}

void SafetensorsPieceWriter::write(std::string_view name, std::int64_t first, const Tensor& piece) {
  GRADSYNC_CHECK(file_, "cannot save '", path_.string(), "': create() or open() the temporary file first");
  const auto found = index_.find(name);
  GRADSYNC_CHECK(found != index_.end(), "cannot save '", path_.string(), "': tensor '", name, "' is not in its header");
  const TensorSpec& spec = specs_[found->second];
  GRADSYNC_CHECK(piece.defined() && piece.dtype() == spec.dtype, "cannot save '", path_.string(), "': a piece of '",
                 name, "' is ", piece.defined() ? dtype_name(piece.dtype()) : "undefined", ", the header says ",
                 dtype_name(spec.dtype));
  const std::int64_t numel = shape_numel(spec.shape);
  GRADSYNC_CHECK(first >= 0 && first + piece.numel() <= numel, "cannot save '", path_.string(), "': elements [", first,
                 ", ", first + piece.numel(), ") are outside '", name, "' (", numel, " elements)");
  const Tensor host = piece.device().is_cpu() ? piece : piece.to(Device::cpu());
  const std::size_t element = dtype_size(spec.dtype);
  file_->write_at(layout_.offsets[found->second] + static_cast<std::size_t>(first) * element, host.data(), host.nbytes());
}

void SafetensorsPieceWriter::flush() {
  GRADSYNC_CHECK(file_, "cannot save '", path_.string(), "': create() or open() the temporary file first");
  file_->sync();
}

void SafetensorsPieceWriter::commit() {
  GRADSYNC_CHECK(file_, "cannot save '", path_.string(), "': create() the temporary file first");
  file_->commit();
}

}  // namespace gradsync::io
