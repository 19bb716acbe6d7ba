// Atomic writing (atomic_file.h).
#include "atomic_file.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "gradsync/core/error.h"

namespace gradsync::io {

namespace fs = std::filesystem;

namespace {
std::string errno_text() { return std::strerror(errno); }
}  // namespace

AtomicFileWriter::AtomicFileWriter(const fs::path& target) : target_(target), owner_(true) {
  remove_stale_temporaries();
  static std::atomic<unsigned> counter{0};
  temporary_ = target_;
  temporary_ += ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
  descriptor_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  GRADSYNC_CHECK(descriptor_ >= 0, "cannot save '", target_.string(), "': creating temporary file '",
                 temporary_.string(), "' failed: ", errno_text());
}

AtomicFileWriter::AtomicFileWriter(const fs::path& target, const fs::path& temporary)
    : target_(target), temporary_(temporary) {
  descriptor_ = ::open(temporary_.c_str(), O_WRONLY | O_CLOEXEC);
  GRADSYNC_CHECK(descriptor_ >= 0, "cannot save '", target_.string(), "': opening the temporary file '",
                 temporary_.string(), "' that another rank created failed: ", errno_text(),
                 " (do all ranks see the same folder?)");
}

AtomicFileWriter::~AtomicFileWriter() {
  if (descriptor_ >= 0) ::close(descriptor_);
  if (owner_ && !committed_) ::unlink(temporary_.c_str());
}

// A writer killed mid-save (SIGKILL, power loss) leaves TARGET.tmp-PID-N behind. Before a
// new save of the same target, remove those of our own naming whose process is gone; a
// live process's temporary (a concurrent save) is left alone.
void AtomicFileWriter::remove_stale_temporaries() const {
  const std::string prefix = target_.filename().string() + ".tmp-";
  const fs::path folder = target_.has_parent_path() ? target_.parent_path() : fs::path(".");
  std::error_code error;
  for (fs::directory_iterator it(folder, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    // The rest must be PID-N, digits only.
    const std::string rest = name.substr(prefix.size());
    const auto dash = rest.find('-');
    const bool ours = dash != std::string::npos && dash > 0 && dash + 1 < rest.size() &&
                      rest.find_first_not_of("0123456789-") == std::string::npos && rest.find('-', dash + 1) == std::string::npos;
    if (!ours || dash > 9) continue;
    const auto pid = static_cast<pid_t>(std::stol(rest.substr(0, dash)));
    // Not ours (another thread may be writing it), and its process no longer exists.
    if (pid != ::getpid() && ::kill(pid, 0) != 0 && errno == ESRCH) {
      std::error_code ignored;
      fs::remove(it->path(), ignored);
    }
  }
}

void AtomicFileWriter::write(const void* data, std::size_t nbytes) {
  write_at(bytes_written_, data, nbytes);
}

void AtomicFileWriter::write_at(std::size_t offset, const void* data, std::size_t nbytes) {
  GRADSYNC_CHECK(descriptor_ >= 0, "cannot save '", target_.string(), "': the temporary file is already closed");
  const char* bytes = static_cast<const char*>(data);
  std::size_t done = 0;
  while (done < nbytes) {
    const ssize_t written = ::pwrite(descriptor_, bytes + done, std::min<std::size_t>(nbytes - done, 1 << 30),
                                     static_cast<off_t>(offset + done));
    if (written < 0 && errno == EINTR) continue;
    GRADSYNC_CHECK(written > 0, "cannot save '", target_.string(), "': writing failed at byte ", offset, " after ", done, " of ",
                   nbytes, " bytes: ", written < 0 ? errno_text() : std::string("no progress"),
                   " (the previous file, if any, is untouched)");
    done += static_cast<std::size_t>(written);
  }
  bytes_written_ = std::max(bytes_written_, offset + nbytes);
}

void AtomicFileWriter::resize(std::size_t nbytes) {
  GRADSYNC_CHECK(::ftruncate(descriptor_, static_cast<off_t>(nbytes)) == 0, "cannot save '", target_.string(),
                 "': sizing the temporary file to ", nbytes, " bytes failed: ", errno_text());
}

void AtomicFileWriter::sync() {
  GRADSYNC_CHECK(::fsync(descriptor_) == 0, "cannot save '", target_.string(), "': fsync failed: ", errno_text());
  const int descriptor = std::exchange(descriptor_, -1);
  GRADSYNC_CHECK(::close(descriptor) == 0, "cannot save '", target_.string(), "': close failed: ", errno_text());
}

void AtomicFileWriter::commit() {
  GRADSYNC_CHECK(owner_, "cannot save '", target_.string(), "': only the rank that created the temporary renames it");
  if (descriptor_ >= 0) sync();
  GRADSYNC_CHECK(::rename(temporary_.c_str(), target_.c_str()) == 0, "cannot save '", target_.string(),
                 "': renaming the temporary file over it failed: ", errno_text());
  committed_ = true;
  // Make the rename itself durable: fsync the folder that holds the new directory entry.
  const fs::path folder = target_.parent_path().empty() ? fs::path(".") : target_.parent_path();
  const int folder_descriptor = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (folder_descriptor >= 0) {
    ::fsync(folder_descriptor);
    ::close(folder_descriptor);
  }
}

}  // namespace gradsync::io
