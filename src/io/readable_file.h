// Internal: a file opened for reading the one safe way (gradsync/io/safetensors.h, checksum.h).
// Every file gradsync reads may come from someone else, so it is opened once, checked to be a
// regular file through the descriptor it was opened with (a FIFO would block the reader for ever,
// /dev/zero would fill memory, a folder has nothing to read), and read only through that
// descriptor: a path checked and then opened again could name another file by then.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

namespace gradsync::io {

class ReadableFile {
 public:
  // Opens `path` (links followed) without blocking and refuses anything but a regular file,
  // naming it as `what` ("safetensors file 'x'") and its kind ("a FIFO", "a character device").
  ReadableFile(const std::filesystem::path& path, std::string what);
  ~ReadableFile();
  ReadableFile(const ReadableFile&) = delete;
  ReadableFile& operator=(const ReadableFile&) = delete;

  int descriptor() const { return descriptor_; }
  std::uint64_t size() const { return size_; }  // at open
  const std::string& what() const { return what_; }
  // Bytes [offset, offset + bytes) into `data`; an error naming the file when it ends before.
  void read_at(std::uint64_t offset, void* data, std::size_t bytes) const;
  // The whole file, refused when it holds more than `cap` bytes (counted while reading too: a
  // file that grows as it is read cannot get past it).
  std::string read_all(std::uint64_t cap) const;

 private:
  std::string what_;
  int descriptor_ = -1;
  std::uint64_t size_ = 0;
};

// Whether `path`, its links resolved, is a file directly in `folder` or in the folder `link`
// really lives in (links resolved too): the files of a set may be links into the folder of the
// set's own index (as a Hugging Face cache lays them out), never out of it.
bool resolves_inside(const std::filesystem::path& path, const std::filesystem::path& folder,
                     const std::filesystem::path& link);

}  // namespace gradsync::io
