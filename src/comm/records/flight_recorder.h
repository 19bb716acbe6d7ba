// Internal: one communicator's flight recorder (gradsync/comm/records/flight_recorder.h), and the
// process-wide list of them that dumps read.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "comm/collective.h"

namespace gradsync::comm {

// Microseconds since the epoch, from the wall clock: comparable between the ranks of a machine
// (and, as closely as their clocks agree, between machines).
std::int64_t wall_microseconds();

class FlightRecorder {
 public:
  // What an operation was: a collective's descriptor, or a point-to-point operation.
  struct Operation {
    Descriptor collective;     // seq, kind, dtype, count, root, op (kind 0: point-to-point)
    const char* p2p = nullptr; // "send" or "recv"
    int peer = -1;
    int tag = -1;
  };

  // `name` is the same on every rank for the same communicator ("world", "world/1", ...).
  // Registered in the process's list until destroyed. Capacity from GRADSYNC_FLIGHT_RECORDER.
  static std::shared_ptr<FlightRecorder> create(std::string name, int rank, int size, std::string backend);
  ~FlightRecorder();

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  bool enabled() const { return !ring_.empty(); }

  // A new operation, labelled with the calling thread's OperationLabel. Returns its handle
  // for the calls below (-1 when the recorder is off: they ignore it).
  std::int64_t issued(const Operation& operation);
  void started(std::int64_t handle);
  void completed(std::int64_t handle);
  void failed(std::int64_t handle, const std::string& error, bool timed_out);

  // The communicator's first failure: remembered in the record, and, when
  // GRADSYNC_FLIGHT_RECORDER_DIR is set, this rank's records dumped there. Returns what to add
  // to the error message (" (flight record: DIR/rank1.json)"), or "" when nothing was dumped.
  std::string on_failure(const std::string& reason);

  // When the collectives that ended at or after `since_us` were on the wire: [started, ended).
  void wire_intervals_since(std::int64_t since_us, std::vector<std::pair<std::int64_t, std::int64_t>>& intervals) const;

  nlohmann::json to_json() const;

 private:
  FlightRecorder(std::string name, int rank, int size, std::string backend, std::size_t capacity);

  enum class State : std::uint8_t { issued, started, completed, failed, timed_out };
  struct Entry {
    std::int64_t handle = -1;  // which operation occupies the slot (handles grow; slot = handle % capacity)
    Operation operation;
    std::shared_ptr<const std::string> label;
    std::int64_t issued_us = 0, started_us = 0, ended_us = 0;
    State state = State::issued;
    std::string error;
  };
  Entry* find(std::int64_t handle);  // null once overwritten; call with the mutex held

  std::string name_;
  int rank_;
  int size_;
  std::string backend_;
  mutable std::mutex mutex_;
  std::vector<Entry> ring_;
  std::int64_t next_ = 0;
  std::string broken_;
};

// While it lives, this process is rank `rank` connecting (at the rendezvous, `where`) with no
// communicator yet: SIGUSR1 is handled already (with GRADSYNC_FLIGHT_RECORDER_DIR), and its dump
// is a record with no communicators that says where the rank waits, instead of a killed process.
class ConnectingScope {
 public:
  ConnectingScope(int rank, std::string where);
  ~ConnectingScope();
  ConnectingScope(const ConnectingScope&) = delete;
  ConnectingScope& operator=(const ConnectingScope&) = delete;
};

// Every live recorder of `rank` (-1: of every rank), in creation order.
std::vector<std::shared_ptr<FlightRecorder>> flight_recorders(int rank);

// Writes <folder>/rank<R>.json for `rank` (-1: every rank with a recorder); returns the files.
std::vector<std::filesystem::path> dump_rank_records(const std::filesystem::path& folder, const std::string& reason,
                                                     int rank);

}  // namespace gradsync::comm
