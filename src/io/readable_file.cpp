// A file opened for reading the one safe way (readable_file.h).
#include "readable_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>
#include <utility>

#include "gradsync/core/error.h"

namespace gradsync::io {

namespace {

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

ReadableFile::ReadableFile(const std::filesystem::path& path, std::string what) : what_(std::move(what)) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
  descriptor_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (descriptor_ < 0) {
    const int error = errno;
    detail::throw_error("cannot open ", what_, ": ",
                        error == ENOENT ? std::string("it is not there") : std::string(std::strerror(error)));
  }
  struct stat status {};
  const bool stated = ::fstat(descriptor_, &status) == 0;
  if (!stated || !S_ISREG(status.st_mode)) {
    const std::string kind = stated ? kind_of(status.st_mode) : std::string("unreadable: ") + std::strerror(errno);
    ::close(descriptor_);
    detail::throw_error(what_, " is ", kind, ", not a regular file");
  }
  size_ = static_cast<std::uint64_t>(status.st_size);
  ::fcntl(descriptor_, F_SETFL, ::fcntl(descriptor_, F_GETFL) & ~O_NONBLOCK);
}

ReadableFile::~ReadableFile() {
  if (descriptor_ >= 0) ::close(descriptor_);
}

void ReadableFile::read_at(std::uint64_t offset, void* data, std::size_t bytes) const {
  char* into = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t got = ::pread(descriptor_, into, std::min<std::size_t>(bytes, std::size_t{1} << 30),
                                static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    GRADSYNC_CHECK(got > 0, what_, ": read at byte ", offset, " failed: ",
                   got < 0 ? std::string(std::strerror(errno))
                           : std::string("unexpected end of file (was it truncated while open?)"));
    into += got;
    offset += static_cast<std::uint64_t>(got);
    bytes -= static_cast<std::size_t>(got);
  }
}

std::string ReadableFile::read_all(std::uint64_t cap) const {
  GRADSYNC_CHECK(size_ <= cap, what_, " is ", size_, " bytes, over the ", cap, " it may have");
  std::string text;
  char buffer[1 << 16];
  for (std::uint64_t offset = 0;;) {
    const ssize_t got = ::pread(descriptor_, buffer, sizeof buffer, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    GRADSYNC_CHECK(got >= 0, what_, ": read at byte ", offset, " failed: ", std::strerror(errno));
    if (got == 0) return text;
    offset += static_cast<std::uint64_t>(got);
    GRADSYNC_CHECK(offset <= cap, what_, " grew past the ", cap, " bytes it may have while it was read");
    text.append(buffer, static_cast<std::size_t>(got));
  }
}

bool resolves_inside(const std::filesystem::path& path, const std::filesystem::path& folder,
                     const std::filesystem::path& link) {
  std::error_code error;
  const std::filesystem::path real = std::filesystem::canonical(path, error);
  if (error) return true;  // not there: opening it says so
  const std::filesystem::path home = std::filesystem::canonical(folder, error);
  if (!error && real.parent_path() == home) return true;
  const std::filesystem::path link_home = std::filesystem::canonical(link, error).parent_path();
  return !error && real.parent_path() == link_home;
}

}  // namespace gradsync::io
