// XXH64 (gradsync/io/checksum.h), written from the specification: four lanes of 8-byte
// multiply-rotate rounds over 32-byte stripes, then the lanes merged, the tail folded in by 8,
// 4 and 1 bytes, and a final avalanche. Little-endian reads, as the specification fixes.
#include "gradsync/io/checksum.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <vector>

#include "core/hashing.h"
#include "core/parallel.h"
#include "gradsync/core/error.h"
#include "readable_file.h"

namespace gradsync::io {

namespace {

static_assert(std::endian::native == std::endian::little, "XXH64 here reads little-endian words directly");

constexpr std::uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
constexpr std::uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;
constexpr std::uint64_t kPrime3 = 0x165667B19E3779F9ULL;
constexpr std::uint64_t kPrime4 = 0x85EBCA77C2B2AE63ULL;
constexpr std::uint64_t kPrime5 = 0x27D4EB2F165667C5ULL;

std::uint64_t read64(const unsigned char* p) {
  std::uint64_t value;
  std::memcpy(&value, p, 8);
  return value;
}

std::uint32_t read32(const unsigned char* p) {
  std::uint32_t value;
  std::memcpy(&value, p, 4);
  return value;
}

std::uint64_t lane_round(std::uint64_t lane, std::uint64_t input) {
  lane += input * kPrime2;
  lane = std::rotl(lane, 31);
  return lane * kPrime1;
}

std::uint64_t merge(std::uint64_t accumulator, std::uint64_t lane) {
  accumulator ^= lane_round(0, lane);
  return accumulator * kPrime1 + kPrime4;
}

// The 32-byte stripes of [p, p + size), size a multiple of 32.
void stripes(std::uint64_t (&lanes)[4], const unsigned char* p, std::size_t size) {
  for (const unsigned char* end = p + size; p < end; p += 32) {
    lanes[0] = lane_round(lanes[0], read64(p));
    lanes[1] = lane_round(lanes[1], read64(p + 8));
    lanes[2] = lane_round(lanes[2], read64(p + 16));
    lanes[3] = lane_round(lanes[3], read64(p + 24));
  }
}

}  // namespace

Xxh64::Xxh64(std::uint64_t seed)
    : seed_(seed), lanes_{seed + kPrime1 + kPrime2, seed + kPrime2, seed, seed - kPrime1}, pending_{} {}

void Xxh64::update(const void* data, std::size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  total_ += size;
  if (pending_size_ > 0) {  // complete the stripe begun by an earlier update
    const std::size_t take = std::min(size, 32 - pending_size_);
    std::memcpy(pending_ + pending_size_, p, take);
    pending_size_ += take;
    p += take;
    size -= take;
    if (pending_size_ < 32) return;
    stripes(lanes_, pending_, 32);
    pending_size_ = 0;
  }
  const std::size_t whole = size / 32 * 32;
  stripes(lanes_, p, whole);
  std::memcpy(pending_, p + whole, size - whole);
  pending_size_ = size - whole;
}

std::uint64_t Xxh64::digest() const {
  std::uint64_t hash;
  if (total_ >= 32) {
    hash = std::rotl(lanes_[0], 1) + std::rotl(lanes_[1], 7) + std::rotl(lanes_[2], 12) + std::rotl(lanes_[3], 18);
    for (const std::uint64_t lane : lanes_) hash = merge(hash, lane);
  } else {
    hash = seed_ + kPrime5;
  }
  hash += total_;
  const unsigned char* p = pending_;
  std::size_t left = pending_size_;
  for (; left >= 8; p += 8, left -= 8) hash = std::rotl(hash ^ lane_round(0, read64(p)), 27) * kPrime1 + kPrime4;
  if (left >= 4) {
    hash = std::rotl(hash ^ (read32(p) * kPrime1), 23) * kPrime2 + kPrime3;
    p += 4;
    left -= 4;
  }
  for (; left > 0; ++p, --left) hash = std::rotl(hash ^ (*p * kPrime5), 11) * kPrime1;
  hash ^= hash >> 33;
  hash *= kPrime2;
  hash ^= hash >> 29;
  hash *= kPrime3;
  hash ^= hash >> 32;
  return hash;
}

std::uint64_t xxh64(const void* data, std::size_t size, std::uint64_t seed) {
  Xxh64 hash(seed);
  hash.update(data, size);
  return hash.digest();
}

FileChecksum checksum_file(const std::filesystem::path& path) {
  // Only a regular file (a FIFO or /dev/zero would never end), read through one descriptor.
  std::string what = "file '";  // (appended: GCC 12 warns, wrongly, about "'" + string)
  what += path.string();
  what += '\'';
  const ReadableFile file(path, what);
  std::vector<unsigned char> buffer(std::size_t{4} << 20);
  Xxh64 hash;
  FileChecksum result;
  for (;;) {
    const ssize_t got = ::read(file.descriptor(), buffer.data(), buffer.size());
    if (got < 0 && errno == EINTR) continue;
    GRADSYNC_CHECK(got >= 0, "cannot read '", path.string(), "': ", std::strerror(errno));
    if (got == 0) break;
    hash.update(buffer.data(), static_cast<std::size_t>(got));
    result.bytes += static_cast<std::uint64_t>(got);
  }
  result.xxh64 = hash.digest();
  return result;
}

std::string hex_digest(std::uint64_t digest) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string text(16, '0');
  for (int k = 15; k >= 0; --k, digest >>= 4) text[static_cast<std::size_t>(k)] = kDigits[digest & 15];
  return text;
}

std::uint64_t piece_checksum(std::string_view name, std::int64_t first, const Tensor& piece) {
  GRADSYNC_CHECK(first >= 0, "piece_checksum: '", name, "': first element ", first, " is negative");
  const Tensor host = piece.device().is_cpu() ? piece : piece.to(Device::cpu());
  const std::uint64_t key = hashing::name_hash(name);
  const std::size_t width = dtype_size(host.dtype());
  const auto* bytes = static_cast<const unsigned char*>(host.data());
  // Sums of disjoint chunks, added in any order: addition mod 2^64 is exact, so the result does
  // not depend on the threads.
  std::vector<std::uint64_t> partial(64, 0);
  const std::int64_t n = host.numel();
  const std::int64_t chunk = std::max<std::int64_t>(1 << 16, (n + 63) / 64);
  parallel::for_each_task((n + chunk - 1) / chunk, [&](std::int64_t task) {
    const std::int64_t begin = task * chunk, end = std::min(n, begin + chunk);
    std::uint64_t sum = 0;
    for (std::int64_t k = begin; k < end; ++k) {
      std::uint64_t bits = 0;
      std::memcpy(&bits, bytes + static_cast<std::size_t>(k) * width, width);  // little-endian, zero-extended
      const auto i = static_cast<std::uint64_t>(first + k);
      sum += hashing::mix((key + i * hashing::kGolden) ^ (bits * 0xD6E8FEB86659FD93ull));
    }
    partial[static_cast<std::size_t>(task)] = sum;
  });
  std::uint64_t total = 0;
  for (const std::uint64_t sum : partial) total += sum;
  return total;
}

}  // namespace gradsync::io
