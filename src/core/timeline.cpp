// The timeline (gradsync/core/timeline.h): events appended under one mutex to an in-memory
// list, written as a Chrome trace ({"traceEvents": [...]}) at stop() or exit. Timestamps are
// microseconds of wall-clock time (the steady clock's progress added to the wall clock read at
// start), so the ranks' files line up when merged; "B"/"E" pairs are spans of one thread, "i"
// instants, "M" metadata names the process (the rank) and the threads.
#include "gradsync/core/timeline.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <vector>

#include "environment.h"
#include "gradsync/core/error.h"

namespace gradsync::timeline {

namespace detail {
std::atomic<bool> recording{false};
}  // namespace detail

namespace {

using Clock = std::chrono::steady_clock;

struct Event {
  char phase;  // 'B', 'E', 'i'
  int thread;
  std::int64_t micros;
  const char* category;
  std::string name;
};

struct Recorder {
  std::mutex mutex;
  std::vector<Event> events;
  std::vector<std::pair<int, std::string>> thread_names;
  std::string path;
  int rank = 0;
  Clock::time_point origin;
  std::int64_t origin_wall_micros = 0;
  int next_thread = 0;
  bool atexit_registered = false;
};

Recorder& recorder() {
  static Recorder* instance = new Recorder;  // never destroyed: the atexit writer still uses it
  return *instance;
}

int thread_id() {
  thread_local int id = -1;
  if (id < 0) {
    Recorder& r = recorder();
    std::lock_guard<std::mutex> lock(r.mutex);
    id = r.next_thread++;
  }
  return id;
}

// run.json -> run.rank3.json; a folder (one that exists, or a path ending in '/') -> inside it,
// timeline.rank3.json.
std::string rank_path(const std::string& path, int rank) {
  std::error_code ignored;
  if (path.ends_with('/') || std::filesystem::is_directory(path, ignored)) {
    return (std::filesystem::path(path) / ("timeline.rank" + std::to_string(rank) + ".json")).string();
  }
  const std::filesystem::path p(path);
  const std::string extension = p.has_extension() ? p.extension().string() : std::string(".json");
  return (p.parent_path() / (p.stem().string() + ".rank" + std::to_string(rank) + extension)).string();
}

void append_json_string(std::string& out, const std::string& text) {
  out += '"';
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", c);
      out += escaped;
    } else {
      out += c;
    }
  }
  out += '"';
}

void record(char phase, const char* category, std::string name) {
  Recorder& r = recorder();
  const int thread = thread_id();
  const auto micros = r.origin_wall_micros +
                      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - r.origin).count();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!detail::recording.load(std::memory_order_relaxed)) return;
  r.events.push_back({phase, thread, micros, category, std::move(name)});
}

}  // namespace

namespace detail {
void begin(const char* category, std::string name) { record('B', category, std::move(name)); }
void end() { record('E', "", std::string()); }
void instant(const char* category, std::string name) { record('i', category, std::move(name)); }
}  // namespace detail

void start(const std::string& path, int rank) {
  Recorder& r = recorder();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (detail::recording.load()) return;
    r.path = rank_path(path, rank);
    r.rank = rank;
    r.origin = Clock::now();
    r.origin_wall_micros = std::chrono::duration_cast<std::chrono::microseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
    r.events.clear();
    if (!r.atexit_registered) {
      r.atexit_registered = true;
      std::atexit([] { stop(); });
    }
    detail::recording.store(true);
  }
  name_thread("main");
}

void start_from_environment(int rank) {
  const std::optional<std::string> path = environment::timeline_path();
  if (path && !enabled()) start(*path, rank);
}

std::string path() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  return detail::recording.load() ? r.path : std::string();
}

void name_thread(const std::string& name) {
  if (!enabled()) return;
  const int thread = thread_id();
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto& entry : r.thread_names) {
    if (entry.first == thread) {
      entry.second = name;
      return;
    }
  }
  r.thread_names.emplace_back(thread, name);
}

void stop() {
  Recorder& r = recorder();
  std::vector<Event> events;
  std::vector<std::pair<int, std::string>> names;
  std::string file;
  int rank = 0;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (!detail::recording.load()) return;
    detail::recording.store(false);
    events.swap(r.events);
    names = r.thread_names;
    file = r.path;
    rank = r.rank;
  }
  std::string out = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  const std::string pid = std::to_string(rank);
  out += "{\"ph\": \"M\", \"pid\": " + pid + ", \"tid\": 0, \"name\": \"process_name\", \"args\": {\"name\": \"rank " + pid + "\"}}";
  for (const auto& [thread, name] : names) {
    out += ",\n{\"ph\": \"M\", \"pid\": " + pid + ", \"tid\": " + std::to_string(thread) +
           ", \"name\": \"thread_name\", \"args\": {\"name\": ";
    append_json_string(out, name);
    out += "}}";
  }
  for (const Event& event : events) {
    out += ",\n{\"ph\": \"";
    out += event.phase;
    out += "\", \"pid\": " + pid + ", \"tid\": " + std::to_string(event.thread) + ", \"ts\": " + std::to_string(event.micros);
    if (event.phase != 'E') {
      out += ", \"cat\": ";
      append_json_string(out, event.category);
      out += ", \"name\": ";
      append_json_string(out, event.name);
    }
    if (event.phase == 'i') out += ", \"s\": \"t\"";
    out += "}";
  }
  out += "\n]}\n";
  std::error_code ignored;  // a folder named with a trailing '/' may not exist yet
  if (const auto folder = std::filesystem::path(file).parent_path(); !folder.empty()) {
    std::filesystem::create_directories(folder, ignored);
  }
  std::FILE* handle = std::fopen(file.c_str(), "w");
  if (handle == nullptr) {
    warn("timeline: cannot write " + file);
    return;
  }
  std::fwrite(out.data(), 1, out.size(), handle);
  std::fclose(handle);
}

}  // namespace gradsync::timeline
