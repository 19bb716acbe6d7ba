// gradsync/comm/records/flight_recorder.h - what every rank was doing when a job hung or died, and
// which rank the others keep waiting for.
//
// Every communicator keeps a ring of its last operations (GRADSYNC_FLIGHT_RECORDER of them,
// 1024 by default; 0 turns it off): the sequence number, kind, dtype, count, root or reduction
// (or peer and tag for point-to-point), the label its issuer gave it (the Reducer names the
// bucket and its parameters), when it was issued, started and ended, and how it ended. The cost
// is a lock and a few stores per operation (docs/benchmarks.md has the measurement).
//
// A timeout on one rank says which operation that rank waited in; only the other ranks' records
// say why. Dumps are JSON, one file per rank (<folder>/rank<R>.json, every communicator of that
// rank in it):
//  * automatically, when GRADSYNC_FLIGHT_RECORDER_DIR names a folder: on a communicator's first
//    failure (a timeout, a collective mismatch, a lost peer) and on SIGUSR1;
//  * on request: dump_flight_records(folder).
// scripts/flight_report.py reads the dumps of all ranks and says, in a few lines, which ranks
// are behind, at which operation, and what the others are waiting in (docs/communication.md).
//
// Stragglers come from the same records: on a collective, the ranks that arrive early wait on
// the wire for the last one, so over a window of steps the rank whose collectives took least
// time on the wire is the one the others waited for. StragglerMonitor::collect() compares the
// ranks (one small allgather) and names it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/comm/communicator.h"

namespace gradsync::comm {

// Names the operations the calling thread issues while it lives; the innermost label wins. A
// label made once and shared (the Reducer's per bucket) costs no allocation per operation.
class OperationLabel {
 public:
  explicit OperationLabel(std::string label);  // labels the thread's operations until it goes
  explicit OperationLabel(std::shared_ptr<const std::string> label);  // the same, sharing a made label
  ~OperationLabel();
  OperationLabel(const OperationLabel&) = delete;
  OperationLabel& operator=(const OperationLabel&) = delete;

 private:
  std::shared_ptr<const std::string> previous_;
};

// Writes <folder>/rank<R>.json for every rank with a live communicator in this process (one
// file: a process is one rank, except in threads-as-ranks tests). Returns the files written.
std::vector<std::filesystem::path> dump_flight_records(const std::filesystem::path& folder,
                                                       const std::string& reason = "requested");

// The straggler summary of a window of steps.
struct StragglerReport {
  std::int64_t steps = 0;              // steps in the window (collect() calls count them)
  std::vector<double> wire_ms;         // per rank: time its collectives spent on the wire
  int slowest = -1;                    // the rank the others waited for (least time on the wire)
  double waited_ms_per_step = 0;       // mean over the other ranks of their excess wire time, per step
  double worst_waited_ms_per_step = 0; // the most any rank waited for it, per step
  std::string line() const;            // "slowest rank 2: the others waited 31.0 ms/step for it (max 44.1)"
};

// Sums, per window, the wire time of every collective of this rank's communicators that ended
// in it (from the flight records; with the recorder off every rank reports 0 and none is named).
class StragglerMonitor {
 public:
  explicit StragglerMonitor(Communicator& comm);  // over this rank's communicators; collects on `comm`
  // Counts one step.
  void step() { ++steps_; }
  // Collective over the monitor's communicator: the window since the last collect().
  StragglerReport collect();

 private:
  Communicator& comm_;
  int rank_;
  std::int64_t since_us_;
  std::int64_t steps_ = 0;
};

}  // namespace gradsync::comm
