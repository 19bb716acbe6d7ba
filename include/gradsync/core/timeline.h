// gradsync/core/timeline.h - a trace of what every rank did when, in the Chrome trace-event
// format (loads in Perfetto, ui.perfetto.dev, and chrome://tracing), like Horovod's timeline.
//
// Switched on by GRADSYNC_TIMELINE=path (read when the first communicator connects, which
// knows the rank) or by timeline::start(path, rank). Each rank writes its own file,
// `path` with ".rank<R>" inserted before the extension (run.json -> run.rank0.json), or, when
// `path` is a folder, timeline.rank<R>.json inside it; the events are kept in memory and
// written by timeline::stop() or at process exit.
// scripts/timeline_merge.py joins the ranks' files into one trace (ranks as processes);
// scripts/timeline_plot.py draws one step's overlap as a PNG.
//
// What is recorded (threads appear as tracks: the caller's, the communication thread's):
//   step              Optimizer::step                      (span)
//   backward          DataParallel begin..end_backward     (span: one microbatch's backward)
//   ready <param>     ParameterRegistry::mark_ready        (instant)
//   launch bucket <k> the Reducer hands bucket k over      (instant)
//   <collective>      the operation on the wire            (span, on the thread that runs it)
//   wait              the Reducer blocked in wait()        (span)
//   status            DataParallel's status allreduce      (span)
//   save <file>       a safetensors save                   (span)
// Off, each of these costs one relaxed atomic load.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace gradsync::timeline {

namespace detail {
extern std::atomic<bool> recording;
void begin(const char* category, std::string name);
void end();
void instant(const char* category, std::string name);
}  // namespace detail

inline bool enabled() { return detail::recording.load(std::memory_order_relaxed); }  // recording now

// Starts recording this process as rank `rank` into `path` (".rank<R>" is inserted).
void start(const std::string& path, int rank);
// Writes the events recorded so far and stops. Idempotent.
void stop();
// Starts recording from GRADSYNC_TIMELINE when it is set and nothing records yet.
void start_from_environment(int rank);
// The file this rank writes ("" when not recording).
std::string path();
// Names the calling thread's track ("engine", "communication", ...).
void name_thread(const std::string& name);

// A span: begins at construction, ends at destruction (when recording at construction).
class Span {
 public:
  // A span named `name` in `category` ("comm", "dist", ...).
  Span(const char* category, const char* name) : active_(enabled()) {
    if (active_) detail::begin(category, name);
  }
  // A span whose name name_fn() builds only when recording (the int tells the forms apart).
  template <typename NameFn>
  Span(const char* category, NameFn&& name_fn, int) : active_(enabled()) {
    if (active_) detail::begin(category, name_fn());
  }
  ~Span() {
    if (active_) detail::end();
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  bool active_;
};

// Call sites that build the name test enabled() first, so that nothing is built when off.
inline void instant(const char* category, const std::string& name) {
  if (enabled()) detail::instant(category, name);
}

}  // namespace gradsync::timeline
