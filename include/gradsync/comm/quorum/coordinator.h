// gradsync/comm/quorum/coordinator.h - the quorum of replica groups, decided once by one process and
// read by all (torchft's "lighthouse", over gradsync's own TCP store).
//
// A fault-tolerant job is R replica groups. Inside a group the ranks train as ever (one
// communicator, any backend); across the groups, a step counts only when the coordinator says
// so. Its protocol, all through the store it serves (docs/fault_tolerance.md has it step by
// step):
//  * each group's leader (its rank 0) keeps a heartbeat under "ft/hb/<group>" (each other rank
//    under "ft/hb/<group>/<rank>": a group is lost when any of them falls silent) and posts its
//    requests under "ft/req/<group>": "join" (a group with no quorum yet, a newcomer, one that
//    lost its place) or "vote" (a member of quorum Q: whether its cross-group reduction of this
//    step succeeded);
//  * the coordinator waits for every member's vote (a member whose heartbeat stops, or that says
//    it leaves, is not waited for; once a vote reports a failure, nobody is waited for longer
//    than vote_timeout), then answers every requester under "ft/ans/<group>" at once
//    with one decision: whether the step commits (every vote received said it succeeded), and
//    the next quorum: its members (the live voters and the groups that asked to join, with at
//    least min_replicas), its id (new whenever the members change or a step was discarded, so a
//    communicator that saw a failure is never reused), the step the quorum is at, and for each
//    member behind it the member it recovers from;
//  * a quorum that cannot reach min_replicas within join_timeout answers an error naming what is
//    missing, and every group ends with it.
// Its store stays flat: a quorum's keys (its rendezvous) are erased when the next quorum forms.
// A store filled anyway (by a token holder) ends every group with an error naming the bound.
// Never backwards: the coordinator keeps the highest step any of its quorums reached (the
// high-water mark; in state_file across its own restarts) and never forms a quorum below it. When
// every group that held it is gone, the groups asking are told, after join_timeout, that the step
// is lost (unless accept_lost_steps: the groups restarted from a checkpoint on purpose). A group
// claiming a step beyond the mark is vouched for by nobody: never a recovery source, it recovers.
// The one that is wrong is refused alone: a group whose ranks or agreement differ from the job's
// (the running quorum's, else most groups') ends with the error and the others go on; when a
// group's process is started again while the old one still speaks (a copy its launcher did not
// stop), the incarnation heard first is superseded: its heartbeat and requests no longer count,
// and it ends at its next request naming both.
// After its own restart the groups post their requests again and it decides from them (a vote
// names its quorum's id and size, so a step every member voted for still commits).
//
//   comm::Coordinator coordinator({.port = 29600, .replica_groups = 3, .min_replicas = 2});
//   // or the program: build/examples/coordinator --port 29600 --replica-groups 3 --min-replicas 2
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/comm/communicator.h"

namespace gradsync::comm {

// How the coordinator serves and decides (the program's flags say the same).
struct CoordinatorOptions {
  int port = 0;                    // 0: any free port (see port())
  // An address of this machine to listen on, or "" for every interface.
  std::string bind_host = "127.0.0.1";
  std::string token{};             // what the groups present; empty: coordinator_token(port)
  int replica_groups = 1;          // R: the groups are 0..R-1
  int min_replicas = 1;            // a quorum has at least this many groups
  // A member whose heartbeat (any of its ranks', beating every 100 ms) has not changed for this
  // long is taken for dead: what a stopped or cut-off group costs the others, plus a step.
  std::chrono::milliseconds heartbeat_timeout{1000};
  // How long a quorum waits for groups beyond min_replicas when it forms without a previous one
  // (the start, a coordinator restart), and how long a quorum short of min_replicas waits
  // before it fails.
  std::chrono::milliseconds join_timeout{10000};
  // Once a member has voted that its reduction failed, how long the others that have not voted
  // are waited for: a member that hangs (its heartbeat still beating) is then left out, and
  // comes back as a newcomer when it votes late. A step that nobody reported failing waits for
  // every live member, however slow.
  std::chrono::milliseconds vote_timeout{2000};
  // A file holding the high-water mark (the highest step a quorum reached), read at the start and
  // rewritten atomically as the mark rises (at most every 100 ms), so that a coordinator started
  // again after every group was lost still refuses to go back. Empty: kept in memory only.
  std::string state_file{};
  // Whether a quorum may form below the high-water mark. Off: when every group that held the
  // highest step is gone, the groups asking end with an error naming the lost step. On: they go
  // on from the step they hold (a restart from a checkpoint, on purpose), once no group holding
  // the mark came back within join_timeout (a holder that lives is still waited for).
  bool accept_lost_steps = false;
  bool quiet = false;              // no line per decision on stderr
};

// What the coordinator has decided so far (tests, the program's summary).
struct CoordinatorCounters {
  std::int64_t decisions = 0;   // rounds answered
  std::int64_t commits = 0;     // steps committed
  std::int64_t discards = 0;    // steps discarded
  std::int64_t quorum_changes = 0;  // new quorum ids
  std::int64_t recoveries = 0;  // members told to recover from a peer
  std::int64_t quorum_id = -1;  // the current quorum's id
  std::int64_t high_water = 0;  // the highest step a quorum reached: none forms below it
  std::int64_t refused = 0;     // groups refused alone (their ranks or agreement differ)
  std::int64_t superseded = 0;  // incarnations superseded by a newer one of their group
  std::int64_t store_bytes = 0;  // what its store holds now (flat: each quorum's keys go with it)
};

// The token of a coordinator on `port` when none is given: GRADSYNC_STORE_TOKEN when set, else
// one derived from the port (not a secret: a coordinator that listens beyond loopback refuses
// it, and the groups must then set GRADSYNC_STORE_TOKEN too).
std::string coordinator_token(int port);

// Serves the store and decides the quorums (above) from construction until destruction.
class Coordinator {
 public:
  // Serves on options.port (an error naming it when it cannot listen there). Listening beyond
  // loopback (bind_host "" or another address) needs a secret: options.token or
  // GRADSYNC_STORE_TOKEN, else an error naming it.
  explicit Coordinator(const CoordinatorOptions& options);
  ~Coordinator();  // stops serving
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;
  int port() const;                      // the port it serves
  CoordinatorCounters counters() const;  // (above)
  struct State;

 private:
  std::shared_ptr<State> state_;
};

// ---- The groups' side ----------------------------------------------------------------------

// One answer of the coordinator to a group.
struct Quorum {
  std::int64_t id = -1;           // the quorum's id; -1: none
  bool committed = false;         // (answer to a vote) the voted step counts
  std::vector<int> members;       // the groups in it, ascending
  int index = -1;                 // this group's place among them
  std::int64_t step = 0;          // the committed steps of the quorum's state
  int recover_from = -1;          // the group this one must copy its state from; -1: none
  std::vector<int> recovering;    // the members recovering from this group (it is their source)
  bool stop = false;              // (with a commit) a member asked to stop: the job ends after this step
  std::string error;              // the quorum cannot form: why (every group ends with it)
  std::string describe() const;   // "quorum 4: groups 0,2, step 17"
  // As one line of text, and back: how a group's leader hands the answer to its other ranks.
  std::string to_line() const;
  static Quorum from_line(const std::string& line, int group);  // `group`: whose index to find
};

// Where a group's coordinator is, and how long it is waited for.
struct QuorumClientOptions {
  // The coordinator's address.
  std::string host = "127.0.0.1";
  // The coordinator's port.
  int port = 0;
  std::string token{};             // empty: coordinator_token(port)
  int group = 0;                   // this replica group, in [0, R)
  int group_size = 1;              // ranks per group (every group must have as many)
  // What every group of the job must have alike, as text (FaultTolerance puts the samples a
  // group's step consumes and the model's size there): a quorum whose groups differ is refused,
  // every group ending with the error that names both.
  std::string agreement{};
  // How often the leader says it is alive.
  std::chrono::milliseconds heartbeat_every{100};
  // How long a request waits for its answer (a quorum waits for its slowest member's vote), and
  // how long a lost coordinator is waited for before the group gives up.
  std::chrono::milliseconds answer_timeout{120000};
  // The cross-group communicators' timeouts (their rendezvous and every operation on them); they
  // are interruptible (CommOptions::interruptible), so that a step whose quorum lost a member is
  // given up as soon as the coordinator says so.
  CommOptions cross_options{.timeout = std::chrono::milliseconds(30000),
                            .rendezvous_timeout = std::chrono::milliseconds(5000),
                            .interruptible = true};
};

// A group's connection to the coordinator. The leader (the group's rank 0) requests and keeps
// the heartbeat; every rank makes its cross-group communicators through the coordinator's store.
class QuorumClient {
 public:
  // `leader`: this rank requests and heartbeats (one per group).
  QuorumClient(const QuorumClientOptions& options, bool leader);
  ~QuorumClient();
  QuorumClient(const QuorumClient&) = delete;
  QuorumClient& operator=(const QuorumClient&) = delete;

  // Leader only. Asks to join the next quorum with the state of `step` committed steps; waits
  // for the answer.
  Quorum join(std::int64_t step);
  // Leader only. This group's vote on the step it ran in `quorum` (at `step` committed steps):
  // `ok` when its cross-group reduction succeeded. The answer says whether the step commits, and
  // the quorum of the next step. `stop`: this group asks the job to stop after this step (a time
  // budget spent); the coordinator says stop to every group with the commit.
  Quorum vote(const Quorum& quorum, std::int64_t step, bool ok, bool stop = false);
  // Leader only. Says this group is leaving (finished, or failed inside): the quorum stops
  // waiting for it at once. Never throws.
  void leave(const std::string& why) noexcept;

  // The communicator of place `place` (a rank of the group) across the quorum's members: rank =
  // the group's index in it. Collective over those ranks. `purpose` tells communicators of one
  // quorum apart ("reduce", "recover-2"); `members` is its rank count.
  std::unique_ptr<Communicator> connect(std::int64_t quorum, const std::string& purpose, int place, int rank,
                                        int members);
  // Any rank. The groups the coordinator has lost from `quorum` while this group still runs its
  // step in it ("2" or "1,2"), or "" while it has lost none: a reduction waiting on them would
  // only end at its timeout. One store read.
  std::string lost_from(std::int64_t quorum);
  // Where the coordinator is, for messages: "the coordinator at host:port".
  const std::string& where() const;
  // This process's incarnation (a random word); the leader's is its group's.
  const std::string& incarnation() const;
  // Not the leader: beat as `rank` of the group whose leader's incarnation is `group_incarnation`,
  // every heartbeat_every, until destroyed. The coordinator takes a group whose rank falls silent
  // for lost (stopped, cut off) even while its leader beats. Once.
  void keep_alive(const std::string& group_incarnation, int rank);
  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace gradsync::comm
