// Internal: what the collective algorithms of this folder are written over. Each CPU backend
// binds its point-to-point messages to this interface (MPI: MPI_Isend/MPI_Irecv on a private
// communicator; Gloo: unbound buffers of its TCP pairs), and the rings, recursive doubling and
// the chain are written once, here, for both.
//
// Messages are byte ranges between two ranks. Both ends of an algorithm post their messages in
// the same order, and messages with the same (peer, tag) match in the order they were posted.
// Every wait is bounded by the backend's timeout and gives up when the communicator aborts,
// with an error naming the message (`what`).
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <vector>

namespace gradsync::comm::algorithms {

// A message in flight: wait() completes it (or throws, naming it).
class PendingMessage {
 public:
  virtual ~PendingMessage() = default;
  virtual void wait(const char* what) = 0;
};
using Message = std::unique_ptr<PendingMessage>;

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Message send(const std::byte* data, std::size_t bytes, int peer, int tag) = 0;
  virtual Message receive(std::byte* data, std::size_t bytes, int peer, int tag) = 0;

  // Working memory the algorithms reuse from call to call. It only grows: growing a vector
  // zero-fills the new bytes, which for a ring's 8 MiB chunk after a small call would cost
  // more than the message itself.
  std::byte* scratch(std::size_t bytes) {
    if (scratch_.size() < bytes) scratch_.resize(std::max<std::size_t>(bytes, 1));
    return scratch_.data();
  }

  // How a ring cuts a chunk of `chunk_bytes` into messages (segment_size below, unless the
  // transport knows better: MPI between two ranks sends each chunk whole).
  virtual std::size_t ring_segment(std::size_t chunk_bytes, std::size_t element) const;

  int right() const { return (rank() + 1) % size(); }
  int left() const { return (rank() + size() - 1) % size(); }
  int wrap(int chunk) const { return ((chunk % size()) + size()) % size(); }

 private:
  std::vector<std::byte> scratch_;
};

// Pipelining: a chunk travels as segments of about half of it, within bounds that keep the
// per-message overhead small and the messages in flight few, in whole elements, so that the
// reduction of one segment overlaps the transfer of the next.
inline std::size_t segment_size(std::size_t chunk_bytes, std::size_t element) {
  constexpr std::size_t kMinSegmentBytes = 16 << 10;
  constexpr std::size_t kMaxSegmentBytes = 1 << 20;
  return std::max(std::clamp(chunk_bytes / 2, kMinSegmentBytes, kMaxSegmentBytes) / element * element, element);
}

inline std::size_t Transport::ring_segment(std::size_t chunk_bytes, std::size_t element) const {
  return segment_size(chunk_bytes, element);
}

// Posts one message per segment of [data, data + bytes), to or from `peer`.
inline std::vector<Message> post_segments(Transport& transport, std::byte* data, std::size_t bytes, std::size_t segment,
                                          int peer, int tag, bool receive) {
  std::vector<Message> messages;
  for (std::size_t offset = 0; offset < bytes; offset += segment) {
    const std::size_t length = std::min(segment, bytes - offset);
    messages.push_back(receive ? transport.receive(data + offset, length, peer, tag)
                               : transport.send(data + offset, length, peer, tag));
  }
  return messages;
}

}  // namespace gradsync::comm::algorithms
