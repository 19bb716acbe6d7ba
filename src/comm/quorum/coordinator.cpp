// The coordinator of fault-tolerant replica groups (gradsync/comm/quorum/coordinator.h; the groups'
// side is client.cpp). Requests and answers are lines.h's text lines, stored in
// the coordinator's TCP store; the coordinator hears each set as it arrives
// (TcpStoreServerOptions::on_set) and answers by storing into its own server.
#include "gradsync/comm/quorum/coordinator.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <thread>

#include "core/environment.h"
#include "gradsync/core/error.h"
#include "lines.h"
#include "comm/store/tcp_store.h"

namespace gradsync::comm {

using namespace quorum_lines;

std::string coordinator_token(int port) {
  if (const auto token = environment::store_token()) return *token;
  return "gradsync-coordinator:" + std::to_string(port);
}

std::string Quorum::describe() const {
  if (!error.empty()) return "no quorum: " + error;
  std::string text = "quorum " + std::to_string(id) + ": groups " + join_ints(members) + ", step " + std::to_string(step);
  if (recover_from >= 0) text += ", recovering from group " + std::to_string(recover_from);
  return text;
}

std::string Quorum::to_line() const {
  if (!error.empty()) return "error=" + encode_text(error);
  return "id=" + std::to_string(id) + " members=" + join_ints(members) + " step=" + std::to_string(step) +
         " commit=" + (committed ? "1" : "0") + " from=" + std::to_string(recover_from) +
         " recovering=" + join_ints(recovering);
}

Quorum Quorum::from_line(const std::string& line, int group) {
  const Fields fields = parse_fields(line);
  Quorum quorum;
  if (fields.count("error")) {
    quorum.error = decode_text(fields.at("error"));
    return quorum;
  }
  quorum.id = field_int(fields, "id");
  quorum.committed = field_int(fields, "commit", 0) == 1;
  quorum.members = split_ints(fields.count("members") ? fields.at("members") : "");
  quorum.step = field_int(fields, "step", 0);
  quorum.recover_from = static_cast<int>(field_int(fields, "from", -1));
  quorum.recovering = split_ints(fields.count("recovering") ? fields.at("recovering") : "");
  const auto self = std::find(quorum.members.begin(), quorum.members.end(), group);
  quorum.index = self == quorum.members.end() ? -1 : static_cast<int>(self - quorum.members.begin());
  return quorum;
}

// ---- The coordinator ---------------------------------------------------------------------------

struct Coordinator::State {
  // One group's latest request, and what the coordinator knows of it.
  struct Request {
    std::int64_t seq = -1;
    std::string incarnation;
    std::string kind;  // "join", "vote", "leave"
    std::int64_t quorum = -1;
    std::int64_t quorum_size = 0;
    bool ok = false;
    std::int64_t step = 0;
    int group_size = 0;
    std::string agreement;  // QuorumClientOptions::agreement
    bool answered = true;
  };
  struct Heartbeat {
    std::string incarnation;
    Clock::time_point seen{};
  };

  CoordinatorOptions options;
  std::shared_ptr<TcpStoreServer> server;
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<Request> requests;
  std::vector<Heartbeat> heartbeats;
  // The current quorum: its id, its members and the incarnation each had when it joined.
  std::int64_t quorum_id = -1;
  std::int64_t last_id = -1;
  std::vector<int> members;
  std::map<int, std::string> member_incarnation;
  Clock::time_point waiting_since{};  // the first unanswered request without a quorum
  Clock::time_point failure_seen{};   // this round's first vote reporting a failure
  CoordinatorCounters counters;
  bool stopping = false;
  std::thread decider;

  void heard(const std::string& key, const std::string& value) {
    const bool request = key.rfind("ft/req/", 0) == 0;
    if (!request && key.rfind("ft/hb/", 0) != 0) return;
    int group = -1;
    try {
      group = std::stoi(key.substr(request ? 7 : 6));
    } catch (const std::exception&) {
      return;
    }
    if (group < 0 || group >= options.replica_groups) return;
    const Fields fields = parse_fields(value);
    std::lock_guard<std::mutex> lock(mutex);
    const auto incarnation = fields.find("inc");
    if (incarnation == fields.end()) return;
    if (!request) {
      heartbeats[group] = {incarnation->second, Clock::now()};
      return;
    }
    Request& latest = requests[group];
    const std::int64_t seq = field_int(fields, "seq");
    if (latest.incarnation == incarnation->second && seq <= latest.seq) return;  // a repeat
    latest = {seq,
              incarnation->second,
              fields.count("kind") ? fields.at("kind") : "",
              field_int(fields, "quorum"),
              field_int(fields, "size", 0),
              field_int(fields, "ok", 0) == 1,
              field_int(fields, "step", 0),
              static_cast<int>(field_int(fields, "places", 0)),
              fields.count("agree") ? decode_text(fields.at("agree")) : "",
              false};
    // A request is proof of life too.
    heartbeats[group] = {incarnation->second, Clock::now()};
    changed.notify_all();
  }

  bool alive(int group, Clock::time_point now) const {
    const Heartbeat& heartbeat = heartbeats[group];
    const Request& request = requests[group];
    return heartbeat.incarnation == request.incarnation && request.kind != "leave" &&
           now - heartbeat.seen < options.heartbeat_timeout;
  }

  void answer(int group, const std::string& text) {
    tcp_store_server_set(*server, answer_key(group),
                         "inc=" + requests[group].incarnation + " seq=" + std::to_string(requests[group].seq) + " " + text);
    requests[group].answered = true;
  }

  void say(const std::string& line) const {
    if (!options.quiet) std::fprintf(stderr, "gradsync coordinator: %s\n", line.c_str());
  }

  // One round, when it can be decided (the header's rules); called with the mutex held.
  void decide(Clock::time_point now) {
    const int groups = options.replica_groups;
    std::vector<int> voters, joiners, waiting_for, lost;
    std::int64_t voted_quorum = -1;
    for (const int member : members) {
      const Request& request = requests[member];
      const bool same = request.incarnation == member_incarnation[member];
      if (same && !request.answered && request.kind == "vote" && request.quorum == quorum_id) {
        voters.push_back(member);
      } else if (!same || !alive(member, now) || !request.answered) {
        lost.push_back(member);  // restarted, silent, leaving, or asking to join again
      } else {
        waiting_for.push_back(member);
      }
    }
    if (!waiting_for.empty()) {
      // Every live member votes first; but once a vote says the reduction failed, a member that
      // stays silent past vote_timeout (hung, its heartbeat still beating) is left out.
      bool failure_reported = false;
      for (const int voter : voters) failure_reported = failure_reported || !requests[voter].ok;
      if (!failure_reported) {
        failure_seen = Clock::time_point{};
        return;
      }
      if (failure_seen == Clock::time_point{}) failure_seen = now;
      if (now - failure_seen < options.vote_timeout) return;
      lost.insert(lost.end(), waiting_for.begin(), waiting_for.end());
      say("quorum " + std::to_string(quorum_id) + ": groups " + join_ints(waiting_for) + " did not vote within " +
          std::to_string(options.vote_timeout.count()) + " ms of a reported failure: left out");
    }
    failure_seen = Clock::time_point{};
    for (int group = 0; group < groups; ++group) {
      const Request& request = requests[group];
      if (request.answered || !alive(group, now) || std::find(voters.begin(), voters.end(), group) != voters.end()) continue;
      if (request.kind == "join" || request.kind == "vote") joiners.push_back(group);
    }
    bool commit = false;
    if (quorum_id >= 0) {
      commit = !voters.empty();
      for (const int voter : voters) commit = commit && requests[voter].ok;
    } else {
      // No quorum known (the start, or after a restart of this coordinator): a step commits when
      // every member of the quorum it ran in voted for it.
      voters.clear();
      std::map<std::int64_t, std::vector<int>> by_quorum;
      for (const int group : joiners) {
        if (requests[group].kind == "vote") by_quorum[requests[group].quorum].push_back(group);
      }
      for (auto& [id, votes] : by_quorum) {
        bool all_ok = static_cast<std::int64_t>(votes.size()) == requests[votes.front()].quorum_size;
        for (const int group : votes) all_ok = all_ok && requests[group].ok;
        if (all_ok && votes.size() > voters.size()) {
          voters = votes;
          voted_quorum = id;
        }
      }
      commit = !voters.empty();
      for (const int group : voters) joiners.erase(std::find(joiners.begin(), joiners.end(), group));
      const int arrived = static_cast<int>(voters.size() + joiners.size());
      if (arrived == 0) return;
      if (waiting_since == Clock::time_point{}) waiting_since = now;
      const bool everyone = arrived == groups;
      if (!everyone && now - waiting_since < options.join_timeout) return;  // wait for the others a while
    }
    std::vector<int> next = voters;
    next.insert(next.end(), joiners.begin(), joiners.end());
    std::sort(next.begin(), next.end());
    if (static_cast<int>(next.size()) < options.min_replicas) {
      if (quorum_id >= 0) {  // fewer than the minimum: wait for newcomers, as at the start
        say("quorum " + std::to_string(quorum_id) + " lost groups " + join_ints(lost) + "; " + std::to_string(next.size()) +
            " left, fewer than --min-replicas " + std::to_string(options.min_replicas) + ": waiting for groups to join");
        quorum_id = -1;
        members.clear();
        waiting_since = now;
        return;
      }
      if (now - waiting_since < options.join_timeout) return;
      std::vector<int> missing;
      for (int group = 0; group < groups; ++group) {
        if (std::find(next.begin(), next.end(), group) == next.end()) missing.push_back(group);
      }
      const std::string why = "a quorum needs at least " + std::to_string(options.min_replicas) + " of " +
                              std::to_string(groups) + " replica groups (min_replicas); after " +
                              std::to_string(options.join_timeout.count()) + " ms only " + std::to_string(next.size()) +
                              (next.empty() ? "" : " (groups " + join_ints(next) + ")") + " had asked, groups " +
                              join_ints(missing) + " did not (dead, or never started)";
      say(why);
      for (const int group : next) answer(group, "error=" + encode_text(why));
      waiting_since = Clock::time_point{};
      return;
    }
    // Every member of one quorum must have as many ranks (place p talks to place p) and what
    // the groups said they must share (QuorumClientOptions::agreement): the job ends naming both.
    const Request& first = requests[next.front()];
    for (const int group : next) {
      const Request& other = requests[group];
      std::string why;
      if (other.group_size != first.group_size) {
        why = "replica group " + std::to_string(group) + " has " + std::to_string(other.group_size) + " ranks, group " +
              std::to_string(next.front()) + " has " + std::to_string(first.group_size) +
              " (every replica group has as many ranks)";
      } else if (other.agreement != first.agreement) {
        why = "replica group " + std::to_string(group) + " says '" + other.agreement + "', group " +
              std::to_string(next.front()) + " says '" + first.agreement + "' (the groups of one job must agree)";
      }
      if (!why.empty()) {
        say(why);
        for (const int member : next) answer(member, "error=" + encode_text(why));
        return;
      }
    }
    // The members' states after this decision, and who recovers from whom.
    std::map<int, std::int64_t> steps;
    for (const int group : next) {
      const bool voted = std::find(voters.begin(), voters.end(), group) != voters.end();
      steps[group] = requests[group].step + (voted && commit ? 1 : 0);
    }
    std::int64_t step = 0;
    for (const auto& [group, at] : steps) step = std::max(step, at);
    std::vector<int> sources;
    for (const auto& [group, at] : steps) {
      if (at == step) sources.push_back(group);
    }
    std::map<int, int> source_of;
    std::size_t turn = 0;
    for (const auto& [group, at] : steps) {
      if (at < step) source_of[group] = sources[turn++ % sources.size()];
    }
    const bool same_members = next == members;
    std::int64_t id = quorum_id;
    // A new id whenever anything may have broken the old communicators: other members, the same
    // group in a new incarnation, a discarded step, or no quorum before. Its rendezvous keys are
    // then fresh: nobody meets a dead process's stale address.
    if (!same_members || !lost.empty() || !commit || quorum_id < 0) {
      id = std::max({last_id, quorum_id, voted_quorum});
      for (const int group : next) id = std::max(id, requests[group].quorum);
      ++id;
      ++counters.quorum_changes;
    }
    const std::string common = "id=" + std::to_string(id) + " members=" + join_ints(next) + " step=" + std::to_string(step);
    for (const int group : next) {
      const bool voted = std::find(voters.begin(), voters.end(), group) != voters.end();
      std::vector<int> recovering;
      for (const auto& [healer, source] : source_of) {
        if (source == group) recovering.push_back(healer);
      }
      const auto source = source_of.find(group);
      answer(group, common + " commit=" + (voted && commit ? "1" : "0") +
                        " from=" + std::to_string(source == source_of.end() ? -1 : source->second) +
                        " recovering=" + join_ints(recovering));
    }
    ++counters.decisions;
    if (!voters.empty()) ++(commit ? counters.commits : counters.discards);
    counters.recoveries += static_cast<std::int64_t>(source_of.size());
    if (id != quorum_id) {
      std::string line = "quorum " + std::to_string(id) + ": groups " + join_ints(next) + " at step " + std::to_string(step);
      if (!voters.empty()) line += commit ? " (the step committed)" : " (the step was discarded)";
      if (!lost.empty()) line += ", lost groups " + join_ints(lost);
      if (!source_of.empty()) {
        line += ", recovering";
        for (const auto& [healer, source] : source_of) line += " " + std::to_string(healer) + "<-" + std::to_string(source);
      }
      say(line);
    }
    member_incarnation.clear();
    for (const int group : next) member_incarnation[group] = requests[group].incarnation;
    members = next;
    quorum_id = id;
    last_id = std::max(last_id, id);
    counters.quorum_id = id;
    waiting_since = Clock::time_point{};
  }

  void run() {
    std::unique_lock<std::mutex> lock(mutex);
    while (!stopping) {
      changed.wait_for(lock, std::chrono::milliseconds(20));
      if (stopping) break;
      decide(Clock::now());
    }
  }
};

Coordinator::Coordinator(const CoordinatorOptions& options) : state_(std::make_shared<State>()) {
  GRADSYNC_CHECK(options.replica_groups >= 1, "Coordinator: replica_groups must be at least 1, got ", options.replica_groups);
  GRADSYNC_CHECK(options.min_replicas >= 1 && options.min_replicas <= options.replica_groups, "Coordinator: min_replicas ",
                 options.min_replicas, " must be in [1, replica_groups = ", options.replica_groups, "]");
  State& state = *state_;
  state.options = options;
  state.requests.resize(static_cast<std::size_t>(options.replica_groups));
  state.heartbeats.resize(static_cast<std::size_t>(options.replica_groups));
  TcpStoreServerOptions server;
  server.bind_host = options.bind_host;
  server.bind_required = !options.bind_host.empty();
  server.port = options.port;
  server.token = options.token.empty() ? coordinator_token(options.port) : options.token;
  server.secret_token = environment::store_token().has_value() || !options.token.empty();
  server.idle_timeout = std::chrono::milliseconds(3600000);
  State* raw = state_.get();
  server.on_set = [raw](const std::string& key, const std::string& value) { raw->heard(key, value); };
  state.server = start_tcp_store_server(server);
  state.decider = std::thread([raw] { raw->run(); });
}

Coordinator::~Coordinator() {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stopping = true;
  }
  state_->changed.notify_all();
  state_->decider.join();
  state_->server.reset();  // stops serving before the state it calls into goes
}

int Coordinator::port() const { return tcp_store_server_port(*state_->server); }

CoordinatorCounters Coordinator::counters() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->counters;
}

}  // namespace gradsync::comm
