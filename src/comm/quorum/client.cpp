// The groups' side of the coordinator (gradsync/comm/quorum/coordinator.h): a leader's requests and
// heartbeat, and the cross-group communicators every rank makes through the coordinator's store.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "comm/gloo/rendezvous.h"
#include "core/environment.h"
#include "gradsync/comm/quorum/coordinator.h"
#include "gradsync/core/error.h"
#include "lines.h"
#include "comm/store/socket_io.h"
#include "comm/store/tcp_store.h"

namespace gradsync::comm {

using namespace quorum_lines;

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
         " recovering=" + join_ints(recovering) + (stop ? " stop=1" : "");
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
  quorum.stop = field_int(fields, "stop", 0) == 1;
  const auto self = std::find(quorum.members.begin(), quorum.members.end(), group);
  quorum.index = self == quorum.members.end() ? -1 : static_cast<int>(self - quorum.members.begin());
  return quorum;
}

// The token when none is given: a secret from the environment, else derived from the port (the
// coordinator refuses the derived one beyond loopback).
std::string coordinator_token(int port) {
  if (const auto token = environment::store_token()) return *token;
  return "gradsync-coordinator:" + std::to_string(port);
}

// ---- A group's client --------------------------------------------------------------------------

struct QuorumClient::State {
  QuorumClientOptions options;
  bool leader = false;
  std::string where;
  std::string token;
  std::string incarnation;
  std::mutex store_mutex;
  std::shared_ptr<TcpStore> store;
  std::int64_t seq = 0;
  Clock::time_point superseded_checked{};
  std::atomic<bool> stopping{false};
  std::thread heartbeat;

  // The store; with `reconnect`, a new connection (the coordinator restarted), tried for a
  // couple of seconds: with_store tries again until answer_timeout.
  std::shared_ptr<TcpStore> current(bool reconnect) {
    std::lock_guard<std::mutex> lock(store_mutex);
    if (store && !reconnect) return store;
    store.reset();
    store = std::make_shared<TcpStore>(options.host, options.port, false, std::chrono::milliseconds(2000), token);
    return store;
  }

  template <typename Action>
  auto with_store(Action&& action) {
    const auto deadline = Clock::now() + options.answer_timeout;
    bool reconnect = false;
    for (;;) {
      try {
        return action(*current(reconnect));
      } catch (const StoreGone& gone) {
        GRADSYNC_CHECK(Clock::now() < deadline, where, " has been gone for ", options.answer_timeout.count(),
                       " ms (answer_timeout): ", gone.what());
      } catch (const Error& unreachable) {  // a reconnection that found nobody yet
        GRADSYNC_CHECK(!reconnect || Clock::now() < deadline, where, " has been gone for ", options.answer_timeout.count(),
                       " ms (answer_timeout): ", unreachable.what());
        if (!reconnect) throw;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      reconnect = true;
    }
  }

  void set(const std::string& key, const std::string& value) {
    with_store([&](TcpStore& s) {
      s.set(key, std::vector<char>(value.begin(), value.end()));
      return 0;
    });
  }

  // Posts a request and waits for its answer, posting it again every second (a coordinator that
  // restarted has forgotten it).
  Quorum request(const std::string& kind, const std::string& fields) {
    GRADSYNC_CHECK(leader, "QuorumClient: only a group's leader (its rank 0) requests");
    const std::int64_t my_seq = ++seq;
    const std::string line = "inc=" + incarnation + " seq=" + std::to_string(my_seq) + " kind=" + kind +
                             " places=" + std::to_string(options.group_size) +
                             " agree=" + encode_text(options.agreement) + " " + fields;
    const std::string key = request_key(options.group);
    const auto deadline = Clock::now() + options.answer_timeout;
    auto posted = Clock::time_point{};
    for (;;) {
      const auto now = Clock::now();
      if (now - posted > std::chrono::seconds(1)) {
        set(key, line);
        posted = now;
      }
      const std::vector<char> raw = with_store([&](TcpStore& s) {
        std::vector<char> value;
        if (!s.try_get(answer_key(options.group), value)) value.clear();
        return value;
      });
      const std::string text(raw.begin(), raw.end());
      const Fields answer = parse_fields(text);
      if (answer.count("inc") && answer.at("inc") != incarnation) end_if_superseded(now);
      if (answer.count("inc") && answer.at("inc") == incarnation && field_int(answer, "seq") == my_seq) {
        Quorum quorum = Quorum::from_line(text, options.group);
        if (!quorum.error.empty()) detail::throw_error("replica group ", options.group, ": ", where, " says: ", quorum.error);
        return quorum;
      }
      GRADSYNC_CHECK(Clock::now() < deadline, "replica group ", options.group, ": no answer to its ", kind, " from ", where,
                     " within ", options.answer_timeout.count(), " ms (QuorumClientOptions::answer_timeout)");
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
  }

  // Another incarnation of this group is being answered: ends this one if the coordinator says a
  // newer one superseded it (coordinator.h: two copies of one group must never train). Read at
  // most every 50 ms.
  void end_if_superseded(Clock::time_point now) {
    if (now - superseded_checked < std::chrono::milliseconds(50)) return;
    superseded_checked = now;
    const std::vector<char> raw = with_store([&](TcpStore& s) {
      std::vector<char> value;
      if (!s.try_get(fence_key(options.group), value)) value.clear();
      return value;
    });
    const Fields fence = parse_fields(std::string(raw.begin(), raw.end()));
    if (!fence.count("superseded")) return;
    std::istringstream listed(fence.at("superseded"));
    std::string one;
    while (std::getline(listed, one, ',')) {
      GRADSYNC_CHECK(one != incarnation, "replica group ", options.group, ": this process (incarnation ", incarnation,
                     ") was superseded by a newer incarnation of the same group (", fence.count("newest") ? fence.at("newest") : "?",
                     "), which ", where, " heard after it: the group was started again while this process still ran (a ",
                     "copy its launcher did not stop); this one stops, since two copies of one group must never train");
    }
  }

  // The leader beats for the group, rank > 0 for itself with the leader's incarnation.
  void beat(int rank, const std::string& group_incarnation) {
    const std::string key = rank == 0 ? heartbeat_key(options.group) : rank_heartbeat_key(options.group, rank);
    std::int64_t beats = 0;
    while (!stopping) {
      try {
        const std::string value = "inc=" + group_incarnation + " n=" + std::to_string(++beats);
        std::shared_ptr<TcpStore> s = current(false);
        s->set(key, std::vector<char>(value.begin(), value.end()));
      } catch (const std::exception&) {
        try {
          current(true);  // the coordinator restarting: a new connection, or the next beat tries again
        } catch (const std::exception&) {
        }
      }
      for (int slept = 0; slept < options.heartbeat_every.count() && !stopping; slept += 10) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  }
};

QuorumClient::QuorumClient(const QuorumClientOptions& options, bool leader) : state_(std::make_shared<State>()) {
  GRADSYNC_CHECK(options.port > 0 && options.port < 65536, "QuorumClient: the coordinator's port ", options.port,
                 " is not a TCP port");
  GRADSYNC_CHECK(options.group >= 0, "QuorumClient: replica group ", options.group, " must not be negative");
  State& state = *state_;
  state.options = options;
  state.leader = leader;
  state.where = "the coordinator at " + options.host + ":" + std::to_string(options.port);
  state.token = options.token.empty() ? coordinator_token(options.port) : options.token;
  std::random_device entropy;
  state.incarnation = std::to_string(entropy()) + std::to_string(entropy());
  state.current(false);
  if (leader) state.heartbeat = std::thread([raw = state_.get()] { raw->beat(0, raw->incarnation); });
}

const std::string& QuorumClient::incarnation() const { return state_->incarnation; }

void QuorumClient::keep_alive(const std::string& group_incarnation, int rank) {
  GRADSYNC_CHECK(!state_->leader && rank > 0 && !state_->heartbeat.joinable(), "QuorumClient::keep_alive(rank ", rank,
                 "): for a group's other ranks, once (the leader beats from the start)");
  state_->heartbeat = std::thread([raw = state_.get(), group_incarnation, rank] { raw->beat(rank, group_incarnation); });
}

QuorumClient::~QuorumClient() {
  state_->stopping = true;
  if (state_->heartbeat.joinable()) state_->heartbeat.join();
}

Quorum QuorumClient::join(std::int64_t step) { return state_->request("join", "step=" + std::to_string(step)); }

Quorum QuorumClient::vote(const Quorum& quorum, std::int64_t step, bool ok, bool stop) {
  return state_->request("vote", "quorum=" + std::to_string(quorum.id) + " size=" + std::to_string(quorum.members.size()) +
                                     " ok=" + (ok ? "1" : "0") + " step=" + std::to_string(step) +
                                     (stop ? " stop=1" : ""));
}

void QuorumClient::leave(const std::string& why) noexcept {
  try {
    State& state = *state_;
    const std::string line = "inc=" + state.incarnation + " seq=" + std::to_string(++state.seq) + " kind=leave why=" +
                             encode_text(why);
    std::shared_ptr<TcpStore> store = state.current(false);
    store->set(request_key(state.options.group), std::vector<char>(line.begin(), line.end()));
  } catch (const std::exception&) {  // the coordinator learns from the silent heartbeat instead
  }
}

std::unique_ptr<Communicator> QuorumClient::connect(std::int64_t quorum, const std::string& purpose, int place, int rank,
                                                    int members) {
  std::shared_ptr<TcpStore> store = state_->current(false);
  const std::string prefix = "ft/q" + std::to_string(quorum) + "/" + purpose + "/p" + std::to_string(place);
  return gloo_prefixed_communicator(store, prefix, state_->where, rank, members, state_->options.cross_options);
}

std::string QuorumClient::lost_from(std::int64_t quorum) {
  std::vector<char> raw;
  if (!state_->current(false)->try_get(broken_key(), raw)) return {};
  const Fields broken = parse_fields(std::string(raw.begin(), raw.end()));
  if (field_int(broken, "quorum") != quorum || !broken.count("lost")) return {};
  return broken.at("lost");
}

const std::string& QuorumClient::where() const { return state_->where; }

}  // namespace gradsync::comm
