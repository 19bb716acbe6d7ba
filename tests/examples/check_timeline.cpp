// Checks the structure of a run's timeline (the ranks' Chrome trace files, core/timeline.h):
//   check_timeline PATH RANKS        reads PATH's .rank<R> files
// Per rank: the file parses; every span ends after it begins on its own thread; in every
// synchronized backward every bucket is launched exactly once, in bucket order; each bucket is
// launched after the ready signal of each of its members in that backward; every launch has its
// collective on the wire afterwards. Exit 0 when all holds, else 1 with the reasons.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

int failures = 0;

template <typename... Parts>
void fail(const Parts&... parts) {
  std::ostringstream text;
  (text << ... << parts);
  std::fprintf(stderr, "check_timeline: %s\n", text.str().c_str());
  ++failures;
}

std::string rank_file(const std::string& path, int rank) {
  const std::filesystem::path p(path);
  return (p.parent_path() / (p.stem().string() + ".rank" + std::to_string(rank) + p.extension().string())).string();
}

void check_rank(const std::string& file, int rank) {
  std::ifstream in(file);
  if (!in) return fail(file, ": missing");
  const nlohmann::json trace = nlohmann::json::parse(in, nullptr, false);
  if (trace.is_discarded() || !trace.contains("traceEvents")) return fail(file, ": not a Chrome trace");
  struct Event {
    std::string ph, cat, name;
    int tid;
    long long ts;
  };
  std::vector<Event> events;
  bool named = false;
  for (const auto& e : trace["traceEvents"]) {
    if (e.value("ph", "") == "M") {
      named |= e.value("name", "") == "process_name" && e["args"].value("name", "") == "rank " + std::to_string(rank);
      continue;
    }
    if (e.value("pid", -1) != rank) fail(file, ": an event of pid ", e.value("pid", -1));
    events.push_back({e.value("ph", ""), e.value("cat", ""), e.value("name", ""), e.value("tid", -1), e.value("ts", 0LL)});
  }
  if (!named) fail(file, ": no process_name metadata for rank ", rank);

  // Spans: balanced per thread, ends after begins.
  std::map<int, std::vector<const Event*>> open;
  int launches = 0, synchronized_backwards = 0;
  std::vector<long long> wire_begins;  // every collective on the wire
  for (const Event& e : events) {
    if (e.ph == "B") open[e.tid].push_back(&e);
    if (e.ph == "E") {
      if (open[e.tid].empty()) {
        fail(file, ": a span end without a begin on thread ", e.tid);
        continue;
      }
      const Event* begin = open[e.tid].back();
      open[e.tid].pop_back();
      if (e.ts < begin->ts) fail(file, ": span '", begin->name, "' ends before it begins");
      if (begin->cat == "wire") wire_begins.push_back(begin->ts);
    }
  }
  for (const auto& [tid, stack] : open) {
    if (!stack.empty()) fail(file, ": ", stack.size(), " span(s) never ended on thread ", tid);
  }

  // Backwards: launches in order, each once, after its members' ready signals.
  bool in_synced = false;
  int next_bucket = 0, bucket_count = -1;
  std::set<std::string> ready;
  for (const Event& e : events) {
    if (e.ph == "B" && e.cat == "backward") {
      in_synced = e.name.find("synchronized") != std::string::npos;
      next_bucket = 0;
      if (in_synced) ++synchronized_backwards;
    }
    if (e.ph == "i" && e.cat == "ready") ready.insert(e.name.substr(6));  // "ready <param>"
    if (e.ph == "i" && e.cat == "bucket") {
      ++launches;
      bool on_wire = false;  // the launched bucket's collective starts at or after its launch
      for (const long long begin : wire_begins) on_wire |= begin >= e.ts;
      if (!on_wire) fail(file, ": '", e.name, "' has no collective on the wire after it");
      if (!in_synced) fail(file, ": '", e.name, "' outside a synchronized backward");
      const std::string prefix = "launch bucket " + std::to_string(next_bucket) + ":";
      if (e.name.rfind(prefix, 0) != 0) fail(file, ": expected bucket ", next_bucket, " next, got '", e.name, "'");
      std::istringstream members(e.name.substr(e.name.find(':') + 1));
      for (std::string member; members >> member;) {
        if (!ready.contains(member)) fail(file, ": '", e.name, "' before the ready signal of ", member);
      }
      ++next_bucket;
    }
    if (e.ph == "B" && e.cat == "step") {
      // A step ends the window: its synchronized backward launched every bucket, and the next
      // window's ready signals start afresh (the first may precede its backward's span: the
      // first ready signal is what begins a backward).
      if (in_synced) {
        if (bucket_count < 0) bucket_count = next_bucket;
        if (next_bucket != bucket_count) {
          fail(file, ": a synchronized step launched ", next_bucket, " buckets, another ", bucket_count);
        }
      }
      in_synced = false;
      ready.clear();
    }
  }
  if (synchronized_backwards == 0 || launches == 0) fail(file, ": no synchronized backward with launches");
  std::printf("rank %d: %zu events, %d synchronized backward(s), %d launches, %d buckets per step\n", rank, events.size(),
              synchronized_backwards, launches, bucket_count);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: check_timeline PATH RANKS\n");
    return 2;
  }
  for (int rank = 0; rank < std::stoi(argv[2]); ++rank) check_rank(rank_file(argv[1], rank), rank);
  return failures == 0 ? 0 : 1;
}
