// The flight recorder (gradsync/comm/records/flight_recorder.h): a ring of operations per
// communicator, the process's list of them, the dumps, SIGUSR1, and the straggler summary.
#include "flight_recorder.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/environment.h"
#include "gradsync/comm/records/flight_recorder.h"

namespace gradsync::comm {

namespace {

using json = nlohmann::json;

thread_local std::shared_ptr<const std::string> t_label;

// The process's recorders. Never destroyed: the SIGUSR1 thread may read it while the process
// exits.
struct Registry {
  std::mutex dump_mutex;  // one dump at a time: two communicators of a rank may fail together
  std::mutex mutex;
  std::vector<std::weak_ptr<FlightRecorder>> recorders;
  std::map<int, int> worlds;  // per rank: top-level communicators made so far
  // This process's rank while it connects and has no communicator yet (-1: none), and where
  // it waits: what a SIGUSR1 dump says then instead of nothing.
  int connecting_rank = -1;
  std::string connecting_where;
};
Registry& registry() {
  static Registry* const instance = new Registry;
  return *instance;
}

// SIGUSR1: the handler only writes a byte to a pipe (what a signal handler may do); a thread
// reading the pipe writes the dumps.
int g_signal_pipe[2] = {-1, -1};

void on_sigusr1(int) {
  const int saved = errno;
  const char byte = 1;
  [[maybe_unused]] const ssize_t written = ::write(g_signal_pipe[1], &byte, 1);
  errno = saved;
}

void install_sigusr1() {
  static std::once_flag once;
  std::call_once(once, [&] {
    if (::pipe(g_signal_pipe) != 0) return;
    std::thread([] {
      char byte;
      while (::read(g_signal_pipe[0], &byte, 1) > 0 || errno == EINTR) {
        try {
          if (const auto folder = environment::flight_recorder_dir()) dump_rank_records(*folder, "SIGUSR1", -1);
        } catch (const std::exception& error) {
          std::fprintf(stderr, "gradsync: flight recorder: %s\n", error.what());
        }
      }
    }).detach();
    struct sigaction action {};
    action.sa_handler = on_sigusr1;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    ::sigaction(SIGUSR1, &action, nullptr);
  });
}

const char* state_name(int state) {
  static constexpr const char* kNames[] = {"issued", "started", "completed", "failed", "timed out"};
  return kNames[state];
}

}  // namespace

std::int64_t wall_microseconds() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// ---- OperationLabel ----------------------------------------------------------------------------

OperationLabel::OperationLabel(std::string label)
    : OperationLabel(std::make_shared<const std::string>(std::move(label))) {}
OperationLabel::OperationLabel(std::shared_ptr<const std::string> label) : previous_(std::move(t_label)) {
  t_label = std::move(label);
}
OperationLabel::~OperationLabel() { t_label = std::move(previous_); }

// ---- One recorder ------------------------------------------------------------------------------

FlightRecorder::FlightRecorder(std::string name, int rank, int size, std::string backend, std::size_t capacity)
    : name_(std::move(name)), rank_(rank), size_(size), backend_(std::move(backend)), ring_(capacity) {}

std::shared_ptr<FlightRecorder> FlightRecorder::create(std::string name, int rank, int size, std::string backend) {
  const std::size_t capacity = environment::flight_recorder_entries();
  if (environment::flight_recorder_dir()) install_sigusr1();
  Registry& all = registry();
  std::lock_guard<std::mutex> lock(all.mutex);
  // A top-level communicator is "world"; a process (or a rank of a thread group) that makes
  // several numbers the later ones, in the order every rank makes them.
  if (name.empty()) {
    const int made = all.worlds[rank]++;
    name = made == 0 ? "world" : "world#" + std::to_string(made + 1);
  }
  std::shared_ptr<FlightRecorder> recorder(new FlightRecorder(std::move(name), rank, size, std::move(backend), capacity));
  std::erase_if(all.recorders, [](const std::weak_ptr<FlightRecorder>& entry) { return entry.expired(); });
  all.recorders.push_back(recorder);
  return recorder;
}

FlightRecorder::~FlightRecorder() = default;

std::int64_t FlightRecorder::issued(const Operation& operation) {
  if (ring_.empty()) return -1;
  const std::int64_t now = wall_microseconds();
  std::lock_guard<std::mutex> lock(mutex_);
  const std::int64_t handle = next_++;
  Entry& entry = ring_[static_cast<std::size_t>(handle) % ring_.size()];
  entry.handle = handle;
  entry.operation = operation;
  entry.label = t_label;
  entry.issued_us = now;
  entry.started_us = entry.ended_us = 0;
  entry.state = State::issued;
  entry.error.clear();
  return handle;
}

FlightRecorder::Entry* FlightRecorder::find(std::int64_t handle) {
  if (handle < 0 || ring_.empty()) return nullptr;
  Entry& entry = ring_[static_cast<std::size_t>(handle) % ring_.size()];
  return entry.handle == handle ? &entry : nullptr;
}

void FlightRecorder::started(std::int64_t handle) {
  if (handle < 0) return;
  const std::int64_t now = wall_microseconds();
  std::lock_guard<std::mutex> lock(mutex_);
  if (Entry* entry = find(handle)) {
    entry->started_us = now;
    entry->state = State::started;
  }
}

void FlightRecorder::completed(std::int64_t handle) {
  if (handle < 0) return;
  const std::int64_t now = wall_microseconds();
  std::lock_guard<std::mutex> lock(mutex_);
  if (Entry* entry = find(handle); entry != nullptr && entry->ended_us == 0) {
    entry->ended_us = now;
    entry->state = State::completed;
  }
}

void FlightRecorder::failed(std::int64_t handle, const std::string& error, bool timed_out) {
  if (handle < 0) return;
  const std::int64_t now = wall_microseconds();
  std::lock_guard<std::mutex> lock(mutex_);
  if (Entry* entry = find(handle)) {
    if (entry->state == State::completed) return;  // it finished just before it could be cancelled
    entry->ended_us = now;
    entry->state = timed_out ? State::timed_out : State::failed;
    entry->error = error.substr(0, 1000);
  }
}

std::string FlightRecorder::on_failure(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!broken_.empty()) return "";
    broken_ = reason.substr(0, 1000);
  }
  const auto folder = environment::flight_recorder_dir();
  if (!folder || ring_.empty()) return "";
  try {
    const auto files = dump_rank_records(*folder, reason, rank_);
    return files.empty() ? "" : " (flight record: " + files.front().string() + ")";
  } catch (const std::exception& error) {
    std::fprintf(stderr, "gradsync: rank %d: flight recorder: %s\n", rank_, error.what());
    return "";
  }
}

void FlightRecorder::wire_intervals_since(std::int64_t since_us,
                                          std::vector<std::pair<std::int64_t, std::int64_t>>& intervals) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const Entry& entry : ring_) {
    if (entry.handle < 0 || entry.operation.collective.kind == 0 || entry.state != State::completed) continue;
    if (entry.ended_us >= since_us && entry.started_us > 0) {
      intervals.emplace_back(std::max(entry.started_us, since_us), entry.ended_us);
    }
  }
}

json FlightRecorder::to_json() const {
  std::lock_guard<std::mutex> lock(mutex_);
  json entries = json::array();
  const std::int64_t capacity = static_cast<std::int64_t>(ring_.size());
  for (std::int64_t handle = std::max<std::int64_t>(0, next_ - capacity); handle < next_; ++handle) {
    const Entry& entry = ring_[static_cast<std::size_t>(handle % capacity)];
    const Descriptor& op = entry.operation.collective;
    json item;
    if (entry.operation.p2p != nullptr) {
      item = {{"p2p", entry.operation.p2p}, {"seq", op.seq}, {"peer", entry.operation.peer}, {"tag", entry.operation.tag}};
    } else {
      item = {{"seq", op.seq}, {"op", op_kind_name(op.kind)}};
      if (op.op >= 0) item["reduce"] = reduce_op_name(static_cast<ReduceOp>(op.op));
      if (op.root >= 0) item["root"] = op.root;
    }
    item["dtype"] = dtype_name(static_cast<DType>(op.dtype));
    item["count"] = op.count;
    item["what"] = op.str();
    if (entry.label) item["label"] = *entry.label;
    item["state"] = state_name(static_cast<int>(entry.state));
    item["issued_us"] = entry.issued_us;
    if (entry.started_us) item["started_us"] = entry.started_us;
    if (entry.ended_us) item["ended_us"] = entry.ended_us;
    if (!entry.error.empty()) item["error"] = entry.error;
    entries.push_back(std::move(item));
  }
  return {{"name", name_},       {"backend", backend_}, {"rank", rank_},
          {"size", size_},       {"capacity", ring_.size()}, {"operations", next_},
          {"broken", broken_},   {"entries", std::move(entries)}};
}

// ---- The process's recorders, and dumps ---------------------------------------------------------

std::vector<std::shared_ptr<FlightRecorder>> flight_recorders(int rank) {
  Registry& all = registry();
  std::lock_guard<std::mutex> lock(all.mutex);
  std::vector<std::shared_ptr<FlightRecorder>> found;
  for (const auto& weak : all.recorders) {
    if (auto recorder = weak.lock(); recorder && (rank < 0 || recorder->rank() == rank)) found.push_back(recorder);
  }
  return found;
}

std::vector<std::filesystem::path> dump_rank_records(const std::filesystem::path& folder, const std::string& reason,
                                                     int rank) {
  std::lock_guard<std::mutex> one_at_a_time(registry().dump_mutex);
  std::map<int, json> by_rank;
  for (const auto& recorder : flight_recorders(rank)) {
    if (recorder->enabled()) by_rank[recorder->rank()].push_back(recorder->to_json());
  }
  std::string connecting;  // a rank still at the rendezvous has no communicator to dump
  {
    Registry& all = registry();
    std::lock_guard<std::mutex> lock(all.mutex);
    if (all.connecting_rank >= 0 && (rank < 0 || rank == all.connecting_rank) && !by_rank.count(all.connecting_rank)) {
      by_rank[all.connecting_rank] = json::array();
      connecting = all.connecting_where;
    }
  }
  std::filesystem::create_directories(folder);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::vector<std::filesystem::path> files;
  for (auto& [dumped_rank, communicators] : by_rank) {
    const bool waiting = communicators.empty() && !connecting.empty();
    json dump = {{"format", "gradsync-flight-record/1"}, {"rank", dumped_rank}, {"host", host},
                       {"pid", ::getpid()},                     {"reason", reason.substr(0, 1000)},
                       {"dumped_us", wall_microseconds()},      {"communicators", std::move(communicators)}};
    if (waiting) dump["connecting"] = connecting;
    const std::filesystem::path path = folder / ("rank" + std::to_string(dumped_rank) + ".json");
    // Written beside and renamed over: a reader never sees half a dump.
    const std::filesystem::path temporary =
        folder / (".rank" + std::to_string(dumped_rank) + "." + std::to_string(::getpid()) + ".tmp");
    {
      std::ofstream out(temporary, std::ios::trunc);
      out << dump.dump(1) << "\n";
      GRADSYNC_CHECK(out.good(), "cannot write the flight record ", temporary.string());
    }
    std::filesystem::rename(temporary, path);
    files.push_back(path);
  }
  return files;
}

ConnectingScope::ConnectingScope(int rank, std::string where) {
  if (environment::flight_recorder_dir()) install_sigusr1();
  Registry& all = registry();
  std::lock_guard<std::mutex> lock(all.mutex);
  all.connecting_rank = rank;
  all.connecting_where = std::move(where);
}

ConnectingScope::~ConnectingScope() {
  Registry& all = registry();
  std::lock_guard<std::mutex> lock(all.mutex);
  all.connecting_rank = -1;
  all.connecting_where.clear();
}

std::vector<std::filesystem::path> dump_flight_records(const std::filesystem::path& folder, const std::string& reason) {
  return dump_rank_records(folder, reason, -1);
}

// ---- Stragglers ---------------------------------------------------------------------------------

StragglerMonitor::StragglerMonitor(Communicator& comm)
    : comm_(comm), rank_(comm.rank()), since_us_(wall_microseconds()) {}

StragglerReport StragglerMonitor::collect() {
  // The union of the wire intervals of every communicator of this rank: a wait that two
  // communicators share (a bucket and the step status waiting for the same late rank) counts once.
  const std::int64_t now = wall_microseconds();
  std::vector<std::pair<std::int64_t, std::int64_t>> intervals;
  for (const auto& recorder : flight_recorders(rank_)) recorder->wire_intervals_since(since_us_, intervals);
  std::sort(intervals.begin(), intervals.end());
  std::int64_t wire = 0, covered_until = since_us_;
  for (const auto& [begin, end] : intervals) {
    const std::int64_t from = std::max(begin, covered_until);
    if (end > from) wire += end - from;
    covered_until = std::max(covered_until, end);
  }
  since_us_ = now;
  Tensor mine = Tensor::from_vector(std::vector<double>{static_cast<double>(wire) / 1000.0}, {1});
  Tensor all = Tensor::zeros({comm_.size()}, DType::f64);
  comm_.allgather_host(mine, all);
  StragglerReport report;
  report.steps = std::exchange(steps_, 0);
  report.wire_ms = all.to_double_vector();
  const auto least = std::min_element(report.wire_ms.begin(), report.wire_ms.end());
  if (comm_.size() < 2 || report.steps == 0 || *std::max_element(report.wire_ms.begin(), report.wire_ms.end()) <= 0.0) {
    return report;  // nothing to compare
  }
  report.slowest = static_cast<int>(least - report.wire_ms.begin());
  double sum = 0;
  for (int r = 0; r < comm_.size(); ++r) {
    if (r == report.slowest) continue;
    const double waited = (report.wire_ms[static_cast<std::size_t>(r)] - *least) / static_cast<double>(report.steps);
    sum += waited;
    report.worst_waited_ms_per_step = std::max(report.worst_waited_ms_per_step, waited);
  }
  report.waited_ms_per_step = sum / (comm_.size() - 1);
  return report;
}

std::string StragglerReport::line() const {
  if (slowest < 0) return "no straggler measured (one rank, no steps, or the flight recorder is off)";
  std::ostringstream text;
  text.precision(1);
  text << std::fixed << "slowest rank " << slowest << ": the others waited " << waited_ms_per_step
       << " ms/step for it (max " << worst_waited_ms_per_step << ") over " << steps << " steps";
  return text.str();
}

}  // namespace gradsync::comm
