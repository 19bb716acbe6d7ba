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
#include <optional>
#include <thread>

#include "comm/store/tcp_store.h"
#include "core/environment.h"
#include "gradsync/core/error.h"
#include "high_water.h"
#include "incarnations.h"
#include "liveness.h"
#include "lines.h"
#include "settings.h"

namespace gradsync::comm {

using namespace quorum_lines;

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
    bool stop = false;      // (a vote) this group asks the job to stop after the step
  };

  CoordinatorOptions options;
  std::shared_ptr<TcpStoreServer> server;
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<Request> requests;
  std::optional<Liveness> liveness;  // every rank's heartbeat (liveness.h)
  // The current quorum: its id, its members and the incarnation each had when it joined.
  std::int64_t quorum_id = -1;
  std::int64_t last_id = -1;
  std::vector<int> members;
  std::map<int, std::string> member_incarnation;
  std::map<int, int> source_of;  // the current quorum's newcomers and whom they recover from
  Clock::time_point waiting_since{};  // the first unanswered request without a quorum
  Clock::time_point failure_seen{};   // this round's first vote reporting a failure
  std::optional<HighWaterMark> high_water;  // never backwards (high_water.h)
  std::optional<Incarnations> incarnations;  // one process per group (incarnations.h)
  CoordinatorCounters counters;
  std::string store_full;  // why no quorum can form any more: the store refused a set
  std::string broken_said;  // the last broken_key() value published
  bool stopping = false;
  std::thread decider;

  void heard(const std::string& key, const std::string& value) {
    const bool request = key.rfind("ft/req/", 0) == 0;
    if (!request && key.rfind("ft/hb/", 0) != 0) return;
    // "ft/req/G", "ft/hb/G" (a leader's beat) or "ft/hb/G/R" (rank R's).
    int group = -1, rank = 0;
    try {
      const std::string rest = key.substr(request ? 7 : 6);
      std::size_t used = 0;
      group = std::stoi(rest, &used);
      if (used < rest.size()) {
        if (request || rest[used] != '/') return;
        rank = std::stoi(rest.substr(used + 1));
        if (rank < 1 || rank > 65535) return;
      }
    } catch (const std::exception&) {
      return;
    }
    if (group < 0 || group >= options.replica_groups) return;
    const Fields fields = parse_fields(value);
    std::lock_guard<std::mutex> lock(mutex);
    const auto incarnation = fields.find("inc");
    if (incarnation == fields.end() || !current_incarnation(group, incarnation->second)) return;
    if (!request) {
      liveness->beat(group, rank, incarnation->second, Clock::now());
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
              false,
              field_int(fields, "stop", 0) == 1};
    // A request is proof of its leader's life too.
    liveness->beat(group, 0, incarnation->second, Clock::now());
    changed.notify_all();
  }

  // Whether `incarnation` is group's current one (incarnations.h); a new one supersedes the one
  // before, which is told so under fence_key(group).
  bool current_incarnation(int group, const std::string& incarnation) {
    std::string fence;
    const Incarnations::Heard heard = incarnations->heard(group, incarnation, fence);
    if (heard == Incarnations::Heard::superseding) {
      ++counters.superseded;
      tcp_store_server_set(*server, fence_key(group), fence);
    }
    return heard != Incarnations::Heard::superseded;
  }

  bool alive(int group, Clock::time_point now) const {
    const Request& request = requests[group];
    return request.kind != "leave" && liveness->alive(group, request.incarnation, now);
  }

  void answer(int group, const std::string& text) {
    tcp_store_server_set(*server, answer_key(group),
                         "inc=" + requests[group].incarnation + " seq=" + std::to_string(requests[group].seq) + " " + text);
    requests[group].answered = true;
  }

  void say(const std::string& line) const {
    if (!options.quiet) std::fprintf(stderr, "gradsync coordinator: %s\n", line.c_str());
  }

  // The groups of one quorum must share their settings (settings.h): a group that differs from
  // the job's is refused alone; when nothing says which side is right, every group ends. Returns
  // false when it ended every group.
  bool refuse_the_ones_that_differ(std::vector<int>& next, const std::vector<int>& voters) {
    std::map<int, GroupSettings> settings;
    for (const int group : next) settings[group] = {requests[group].group_size, requests[group].agreement};
    const SettingsCheck check = check_settings(next, voters, settings);
    if (!check.everyone.empty()) {
      say(check.everyone);
      for (const int member : next) answer(member, "error=" + encode_text(check.everyone));
      return false;
    }
    for (const auto& [group, why] : check.refused) {
      say(why);
      answer(group, "error=" + encode_text(why));
      ++counters.refused;
    }
    next = check.agreeing;
    return true;
  }

  // A store that refused a set (max_stored_bytes) cannot carry the next quorum's rendezvous: the
  // groups would discard and try again for ever. A job's own keys stay far below the bound, so a
  // token holder filled it: every group asking is told so and ends. Returns whether it is full.
  bool store_is_full() {
    if (store_full.empty()) {
      const TcpStoreServerCounters store = tcp_store_server_counters(*server);
      if (store.refused_full_store == 0) return false;
      store_full = "the coordinator's store is full: it refused a set at " + std::to_string(store.stored_bytes) +
                   " bytes stored, its bound (GRADSYNC_STORE_MAX_MB). A job's own keys stay far below it (each " +
                   "quorum's are erased when the next forms), so a process holding the job's token filled it; no " +
                   "quorum can meet through it";
      say(store_full);
    }
    for (int group = 0; group < options.replica_groups; ++group) {
      if (!requests[group].answered) answer(group, "error=" + encode_text(store_full));
    }
    return true;
  }

  // Never backwards (high_water.h): whether a quorum of `next` at `step` may form; when the mark
  // is lost, every group asking ends with the error naming it.
  bool at_or_above_high_water(const std::vector<int>& next, std::int64_t step, Clock::time_point now) {
    const HighWaterMark::Verdict verdict =
        high_water->check(next, step, now, [&](int group, const std::string& incarnation) {
          return liveness->alive(group, incarnation, now);
        });
    if (!verdict.say.empty()) say(verdict.say);
    if (verdict.kind == HighWaterMark::Verdict::form) return true;
    if (verdict.kind == HighWaterMark::Verdict::lost) {
      say(verdict.why);
      for (const int group : next) answer(group, "error=" + encode_text(verdict.why));
      quorum_id = -1;
      members.clear();
    }
    counters.high_water = high_water->step();
    return false;
  }

  // One round, when it can be decided (the header's rules); called with the mutex held.
  void decide(Clock::time_point now) {
    const int groups = options.replica_groups;
    if (store_is_full()) return;
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
    // A newcomer whose recovery source is lost cannot vote before its transfer times out: it is
    // lost with its source (and joins again when it asks), not waited for past vote_timeout.
    const auto orphans = std::stable_partition(waiting_for.begin(), waiting_for.end(), [&](int member) {
      return !source_of.count(member) || std::find(lost.begin(), lost.end(), source_of[member]) == lost.end();
    });
    lost.insert(lost.end(), orphans, waiting_for.end());
    waiting_for.erase(orphans, waiting_for.end());
    if (!waiting_for.empty() && !lost.empty() && quorum_id >= 0) {
      // Members are gone (silent, superseded, said goodbye) while others still run the step, likely
      // waiting on them across the groups: say so once, and they give it up (FaultTolerance).
      const std::string broken = "quorum=" + std::to_string(quorum_id) + " lost=" + join_ints(lost);
      if (broken != broken_said) {
        broken_said = broken;
        tcp_store_server_set(*server, broken_key(), broken);
        std::string silent;  // a hung rank is worth naming: its group's leader may look fine
        for (const int member : lost) silent += liveness->why_silent(member, requests[member].incarnation, now);
        say("quorum " + std::to_string(quorum_id) + ": groups " + join_ints(lost) + " lost while groups " +
            join_ints(waiting_for) + " still run the step: told to give it up" + silent);
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
    if (!refuse_the_ones_that_differ(next, voters)) return;
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
    // The members' states after this decision, and who recovers from whom.
    std::map<int, std::int64_t> steps;
    std::vector<int> unvouched;
    for (const int group : next) {
      const bool voted = std::find(voters.begin(), voters.end(), group) != voters.end();
      steps[group] = requests[group].step + (voted && commit ? 1 : 0);
      if (!voted && last_id >= 0 && steps[group] > high_water->step()) unvouched.push_back(group);
    }
    // A claim beyond every step this coordinator's quorums reached is vouched for by nobody (a
    // state no quorum made): never a source, it recovers like a newcomer. (Before its first
    // quorum, a restarted coordinator's mark may lag its state file's by 100 ms: no judgement.)
    if (!unvouched.empty() && unvouched.size() < next.size()) {
      say("groups " + join_ints(unvouched) + " claim a step beyond " + std::to_string(high_water->step()) +
          ", the highest any quorum reached: no member vouches for it; they recover from one that holds it");
      for (const int group : unvouched) steps[group] = -1;
    }
    std::int64_t step = 0;
    for (const auto& [group, at] : steps) step = std::max(step, at);
    if (!at_or_above_high_water(next, step, now)) return;
    const std::map<int, int> sources = HighWaterMark::recovery_sources(steps, step);
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
    // A stop asked by any voter ends the job after this step, for every group alike (a decision
    // the quorum shares, as a commit is); asked on a discarded step, it waits for the next commit.
    bool stop = false;
    for (const int voter : voters) stop = stop || (commit && requests[voter].stop);
    if (stop) say("quorum " + std::to_string(id) + ": a member asked to stop; the job stops at step " + std::to_string(step));
    const std::string common = "id=" + std::to_string(id) + " members=" + join_ints(next) + " step=" + std::to_string(step) +
                               (stop ? " stop=1" : "");
    for (const int group : next) {
      const bool voted = std::find(voters.begin(), voters.end(), group) != voters.end();
      std::vector<int> recovering;
      for (const auto& [healer, source] : sources) {
        if (source == group) recovering.push_back(healer);
      }
      const auto source = sources.find(group);
      answer(group, common + " commit=" + (voted && commit ? "1" : "0") +
                        " from=" + std::to_string(source == sources.end() ? -1 : source->second) +
                        " recovering=" + join_ints(recovering));
    }
    ++counters.decisions;
    if (!voters.empty()) ++(commit ? counters.commits : counters.discards);
    counters.recoveries += static_cast<std::int64_t>(sources.size());
    if (id != quorum_id) {
      // The older quorums' keys (their rendezvous) are needed by nobody: every live member of the
      // last one voted, so it met; a member still meeting an older one has been left out.
      tcp_store_server_erase_prefix(*server, "ft/q", "ft/q" + std::to_string(id) + "/");
      std::string line = "quorum " + std::to_string(id) + ": groups " + join_ints(next) + " at step " + std::to_string(step);
      if (!voters.empty()) line += commit ? " (the step committed)" : " (the step was discarded)";
      if (!lost.empty()) line += ", lost groups " + join_ints(lost);
      if (!sources.empty()) {
        line += ", recovering";
        for (const auto& [healer, source] : sources) line += " " + std::to_string(healer) + "<-" + std::to_string(source);
      }
      say(line);
    }
    std::map<int, std::string> reached;
    for (const int group : next) reached[group] = requests[group].incarnation;
    high_water->reached(step, reached);
    counters.high_water = high_water->step();
    source_of = sources;
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
      const auto now = Clock::now();
      decide(now);
      if (std::optional<std::string> line = high_water->due(now)) {
        lock.unlock();
        save_state(*line);
        lock.lock();
      }
    }
  }

  // Writes the high-water mark's line to the state file, outside the decisions' lock (a file's
  // flush must not hold up a step). A failure is said and tried again at the next round.
  void save_state(const std::string& line) {
    try {
      HighWaterMark::write(high_water->state_file(), line);
    } catch (const std::exception& error) {
      say(std::string("cannot save the high-water mark: ") + error.what());
      std::lock_guard<std::mutex> lock(mutex);
      high_water->again();
    }
  }
};

Coordinator::Coordinator(const CoordinatorOptions& options) : state_(std::make_shared<State>()) {
  GRADSYNC_CHECK(options.replica_groups >= 1, "Coordinator: replica_groups must be at least 1, got ", options.replica_groups);
  GRADSYNC_CHECK(options.min_replicas >= 1 && options.min_replicas <= options.replica_groups, "Coordinator: min_replicas ",
                 options.min_replicas, " must be in [1, replica_groups = ", options.replica_groups, "]");
  State& state = *state_;
  state.options = options;
  const auto groups = static_cast<std::size_t>(options.replica_groups);
  state.requests.resize(groups);
  state.liveness.emplace(options.replica_groups, options.heartbeat_timeout);
  state.incarnations.emplace(options.replica_groups);
  state.high_water.emplace(options.state_file, options.accept_lost_steps, options.join_timeout);
  if (const std::string loaded = state.high_water->load(); !loaded.empty()) state.say(loaded);
  state.counters.high_water = state.high_water->step();
  TcpStoreServerOptions server;
  server.bind_host = options.bind_host;
  server.bind_required = !options.bind_host.empty();
  server.port = options.port;
  server.token = options.token.empty() ? coordinator_token(options.port) : options.token;
  server.secret_token = environment::store_token().has_value() || !options.token.empty();
  server.refuse_derived_token = true;  // beyond loopback, whoever computes the token would speak as a group
  server.idle_timeout = std::chrono::milliseconds(3600000);
  server.max_stored_bytes = environment::store_max_bytes();  // GRADSYNC_STORE_MAX_MB, as every store
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
  if (std::optional<std::string> line = state_->high_water->due(Clock::now() + std::chrono::seconds(1))) {
    state_->save_state(*line);
  }
  state_->server.reset();  // stops serving before the state it calls into goes
}

int Coordinator::port() const { return tcp_store_server_port(*state_->server); }

CoordinatorCounters Coordinator::counters() const {
  CoordinatorCounters counters;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    counters = state_->counters;
  }
  counters.store_bytes = tcp_store_server_counters(*state_->server).stored_bytes;
  return counters;
}

}  // namespace gradsync::comm
