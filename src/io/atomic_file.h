// Internal: writing a file atomically (gradsync/io/safetensors.h's promise that a failed save
// never damages the previous file). Everything goes to a temporary file beside the target; only
// a complete, flushed file is renamed over it; any failure removes the temporary and throws.
// Several processes may write one temporary at their own offsets (io::SafetensorsPieceWriter):
// its owner creates, sizes and finally renames it; the others join it by name, write and sync.
#pragma once

#include <cstddef>
#include <filesystem>

namespace gradsync::io {

class AtomicFileWriter {
 public:
  // The owner: creates TARGET.tmp-PID-N (after removing stale ones of dead writers).
  explicit AtomicFileWriter(const std::filesystem::path& target);
  // A joiner: opens the owner's temporary for writing; it never renames nor removes it.
  AtomicFileWriter(const std::filesystem::path& target, const std::filesystem::path& temporary);
  // Closes; the owner removes the temporary unless it committed.
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  const std::filesystem::path& temporary() const { return temporary_; }
  void write(const void* data, std::size_t nbytes);                      // at the end of what was written
  void write_at(std::size_t offset, const void* data, std::size_t nbytes);  // at a byte offset
  void resize(std::size_t nbytes);                                        // the file's size (sparse)
  void sync();    // flushed to the disk and closed (a joiner's last act)
  void commit();  // the owner: flushed, closed, renamed over the target, the folder synced

 private:
  void remove_stale_temporaries() const;

  std::filesystem::path target_;
  std::filesystem::path temporary_;
  int descriptor_ = -1;
  std::size_t bytes_written_ = 0;
  bool owner_ = false;
  bool committed_ = false;
};

}  // namespace gradsync::io
