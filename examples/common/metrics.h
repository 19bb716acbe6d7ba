// The trainers' metrics file (examples/common/): one JSON object per line, from rank 0.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/comm/records/flight_recorder.h"

namespace gradsync::examples {

// Progress lines reach whatever reads them (torchrun's log, a pipe, a file) as they are printed:
// stdout line-buffered, so the lines of an attempt that is killed are not lost in a block
// buffer. Every trainer calls it first.
void line_buffered_progress();

// One JSON object per line: {"step":..,"epoch":..,"loss":..[,"accuracy":..]}. Disabled when
// the path is empty; only rank 0 writes.
class Metrics {
 public:
  // `append`: add to what the file holds (a replica group restarted by its launcher).
  Metrics(const std::string& path, bool writer, bool append = false);
  ~Metrics();
  // grad_norm: the total gradient norm before clipping, written when it is a number.
  void step(std::int64_t step, int epoch, double loss, double grad_norm,
            const std::vector<std::pair<const char*, double>>& extra = {});  // more "name": value fields
  void epoch(std::int64_t step, int epoch, double loss, double accuracy);
  // {"step": .., "name": value, ...}: a record of its own (a validation loss, say).
  void record(std::int64_t step, const std::vector<std::pair<const char*, double>>& fields);
  void stragglers(std::int64_t step, const comm::StragglerReport& report);
  // {"step": .., "event": kind, "detail": text, "name": value, ...}: something that happened
  // (a fault-tolerant run's quorums, discarded steps, recoveries).
  void event(std::int64_t step, const std::string& kind, const std::string& detail,
             const std::vector<std::pair<const char*, double>>& fields);

 private:
  std::FILE* file_ = nullptr;
};

}  // namespace gradsync::examples
