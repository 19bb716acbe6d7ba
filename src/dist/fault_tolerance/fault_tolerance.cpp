// Fault tolerance across replica groups (gradsync/dist/fault_tolerance/fault_tolerance.h): one step's life is
// start_step (the quorum; recovery), average_gradients (across the groups), should_commit (the
// coordinator's decision). Everything a group decides, its rank 0 learns from the coordinator
// and hands to the group's other ranks, so the ranks of a group never disagree.
#include "gradsync/dist/fault_tolerance/fault_tolerance.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <thread>

#include "gradsync/comm/records/flight_recorder.h"
#include "gradsync/comm/nccl/nccl.h"
#include "gradsync/core/error.h"
#include "gradsync/dist/replicas/replicas.h"
#include "gradsync/dist/zero/zero.h"
#include "gradsync/io/checksum.h"

namespace gradsync::dist {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

void digest_tensor(io::Xxh64& digest, const Tensor& tensor) {
  const Tensor host = tensor.device().is_cpu() ? tensor : tensor.to(Device::cpu());
  digest.update(host.data(), host.nbytes());
}

}  // namespace

FaultTolerance::FaultTolerance(ParameterRegistry& registry, optim::Optimizer* optimizer, comm::Communicator& group,
                               FaultToleranceOptions options)
    : registry_(registry), optimizer_(optimizer), group_(group), options_(std::move(options)), made_(Clock::now()) {
  // Across the groups a dead peer must leave a communicator that can be replaced by one among
  // the survivors: Gloo makes a new context through the coordinator's store.
  GRADSYNC_CHECK(options_.cross_backend == "gloo" || options_.cross_backend == "nccl", "FaultTolerance: cross_backend '",
                 options_.cross_backend, "': ",
                 options_.cross_backend == "mpi"
                     ? "MPI cannot go on without a dead rank (the standard's error handling ends the job; ULFM's "
                       "MPIX_Comm_shrink is not in the MPI builds gradsync targets): use gloo across the groups, MPI "
                       "inside them"
                     : "expected gloo or nccl (the groups' own communicators may be nccl, mpi or gloo)");
  GRADSYNC_CHECK(options_.cross_backend != "nccl" || comm::nccl_available(), "FaultTolerance: cross_backend 'nccl': ",
                 comm::nccl_unavailable_reason());
  GRADSYNC_CHECK(options_.samples_per_group >= 1, "FaultTolerance: samples_per_group must be positive, got ",
                 options_.samples_per_group);
  options_.coordinator.group_size = group.size();
  // The data position only adds up when every group's step consumes as much, and a recovery
  // only fits a model of the same size: the coordinator refuses a quorum that differs.
  options_.coordinator.agreement = "samples_per_group=" + std::to_string(options_.samples_per_group) +
                                   " parameters=" + std::to_string(registry.total_numel()) +
                                   " loss_scaler=" + (options_.grad_scaler != nullptr ? "on" : "off") +
                                   " zero=" + std::to_string(options_.zero != nullptr ? options_.zero->stage() : 0);
  client_ = std::make_unique<comm::QuorumClient>(options_.coordinator, group.rank() == 0);
  // Every rank beats under its leader's incarnation: a rank stopped while its leader runs is
  // then lost in a heartbeat, not at the cross-group timeout.
  const std::string incarnation = broadcast_bytes(group, group.rank() == 0 ? client_->incarnation() : std::string(), 0);
  if (group.rank() != 0) client_->keep_alive(incarnation, group.rank());
}

FaultTolerance::~FaultTolerance() {
  if (group_.rank() == 0) client_->leave(std::uncaught_exceptions() > 0 ? "failed" : "finished");
}

std::int64_t FaultTolerance::first_sample() const {
  return position_ + static_cast<std::int64_t>(std::max(quorum_.index, 0)) * options_.samples_per_group;
}

void FaultTolerance::resume(std::int64_t step, std::int64_t position) {
  GRADSYNC_CHECK(!in_quorum_, "FaultTolerance::resume: group ", group(), " has joined a quorum already (resume before the ",
                 "first start_step)");
  GRADSYNC_CHECK(step >= 0 && position >= 0, "FaultTolerance::resume: step ", step, " and position ", position,
                 " must not be negative");
  step_ = step;
  position_ = position;
}

double FaultTolerance::seconds() const { return seconds_since(made_); }

std::vector<FaultToleranceEvent> FaultTolerance::take_events() {
  std::vector<FaultToleranceEvent> taken;
  taken.swap(events_);
  return taken;
}

void FaultTolerance::event(const std::string& kind, double took, const std::string& detail) {
  events_.push_back({kind, step_, quorum_.id, seconds_since(made_), took, detail});
}

// The leader's answer, on every rank of the group (the coordinator's error too, thrown by all).
void FaultTolerance::broadcast_quorum() {
  const std::string line = broadcast_bytes(group_, group_.rank() == 0 ? quorum_.to_line() : std::string(), 0);
  quorum_ = comm::Quorum::from_line(line, group());
  // The leader's error names the group and the coordinator already.
  if (!quorum_.error.empty()) throw Error(quorum_.error);
}

// Whether every rank of the group says ok (one small allreduce inside the group).
bool FaultTolerance::group_agrees(bool ok) {
  Tensor flag = Tensor::from_vector(std::vector<double>{ok ? 1.0 : 0.0}, {1});
  group_.allreduce_host(flag, comm::ReduceOp::min);
  return flag.to_double_vector()[0] > 0.5;
}

void FaultTolerance::join() {
  const auto started = Clock::now();
  if (group_.rank() == 0) {
    try {
      quorum_ = client_->join(step_);
    } catch (const std::exception& error) {
      quorum_ = comm::Quorum{};
      quorum_.error = error.what();
    }
  }
  broadcast_quorum();
  in_quorum_ = true;
  event("joined", seconds_since(started), quorum_.describe());
}

void FaultTolerance::connect_quorum() {
  if (connected_ == quorum_.id && cross_) return;
  const auto started = Clock::now();
  cross_device_.reset();  // before the Gloo context it was bootstrapped through
  cross_.reset();
  connected_ = quorum_.id;
  try {
    cross_ = client_->connect(quorum_.id, "reduce", group_.rank(), quorum_.index, static_cast<int>(quorum_.members.size()));
    if (options_.cross_backend == "nccl") {
      cross_device_ = comm::nccl_communicator(*cross_, options_.coordinator.cross_options, options_.cross_device);
    }
  } catch (const std::exception& error) {
    cross_.reset();
    step_ok_ = false;  // a member died while the quorum met: this step is discarded
    event("failed", seconds_since(started), std::string("connecting the quorum: ") + error.what());
    return;
  }
  event("quorum", seconds_since(started), quorum_.describe());
}

const comm::Quorum& FaultTolerance::start_step() {
  step_ok_ = true;
  if (!in_quorum_) join();
  connect_quorum();
  recover();
  return quorum_;
}

// The state a recovery carries: the step and the data position, the optimizer's state as its
// checkpoint tensors, the loss scaler's, and the values: every arena whole, or under ZeRO this
// rank's pieces of the optimizer state and of the values only (the model's checksum, whatever the
// cut, is collective inside the group). The XXH64 covers what this rank sends.
FaultTolerance::Snapshot FaultTolerance::snapshot() {
  Snapshot snapshot;
  if (options_.zero != nullptr) {
    dist::ZeroOptimizer::State pieces = options_.zero->own_pieces();
    snapshot.tensors = std::move(pieces.tensors);
    snapshot.metadata = std::move(pieces.metadata);
    snapshot.model = options_.zero->model_checksum();
  } else if (optimizer_ != nullptr) {
    snapshot.tensors = optimizer_->state_tensors();
    snapshot.metadata = optimizer_->state_metadata();
  }
  io::Xxh64 digest(static_cast<std::uint64_t>(step_) * 1000003u + static_cast<std::uint64_t>(position_));
  if (options_.grad_scaler != nullptr) {  // its entries ride with the optimizer's ("grad_scaler.*")
    for (const auto& [key, value] : options_.grad_scaler->state_metadata()) {
      snapshot.metadata[key] = value;
      digest.update(key.data(), key.size());
      digest.update(value.data(), value.size());
    }
  }
  if (options_.zero == nullptr) {
    for (const Arena& arena : registry_.arenas()) {
      digest_tensor(digest, arena.values);
      snapshot.bytes += static_cast<std::int64_t>(arena.values.nbytes());
    }
  }
  for (const io::NamedTensor& tensor : snapshot.tensors) {
    digest.update(tensor.name.data(), tensor.name.size());
    digest_tensor(digest, tensor.tensor);
    snapshot.bytes += static_cast<std::int64_t>(tensor.tensor.nbytes());
  }
  snapshot.digest = digest.digest();
  return snapshot;
}

void FaultTolerance::send_state(comm::Communicator& pair, Snapshot& snapshot, int newcomer) {
  char header[128];
  std::snprintf(header, sizeof header, "%lld %lld %016" PRIx64 " %016" PRIx64, static_cast<long long>(step_),
                static_cast<long long>(position_), snapshot.digest, snapshot.model);
  broadcast_bytes(pair, header, 0);
  recovery_moment("started", newcomer);
  if (options_.zero == nullptr) broadcast_parameters(registry_, pair, 0);  // under ZeRO the values are in the pieces
  recovery_moment("halfway", newcomer);
  broadcast_state(pair, snapshot.tensors, snapshot.metadata, 0);
  recovery_moment("sent", newcomer);
}

void FaultTolerance::recovery_moment(const char* moment, int newcomer) {
  if (options_.on_recovery_moment) options_.on_recovery_moment(moment, newcomer, step_);
}

FaultTolerance::Received FaultTolerance::receive_state(comm::Communicator& pair, int source) {
  Received received;
  const std::string header = broadcast_bytes(pair, std::string(), 0);
  long long step = 0, position = 0;
  GRADSYNC_CHECK(std::sscanf(header.c_str(), "%lld %lld %" SCNx64 " %" SCNx64, &step, &position, &received.digest,
                             &received.model) == 4,
                 "replica group ", group(), ": a malformed recovery header from group ", source, ": '", header, "'");
  received.step = step;
  received.position = position;
  if (options_.zero == nullptr) broadcast_parameters(registry_, pair, 0);
  broadcast_state(pair, received.tensors, received.metadata, 0);
  return received;
}

// A member behind the quorum receives the state of its source, place by place; a source sends
// to each member it is the source of, in their order. A group adopts what it received only when
// every one of its ranks received its part, loaded it and found the checksum right (two small
// agreements inside the group); otherwise it stays behind, to recover at the next quorum. The
// sender's own state is only read.
void FaultTolerance::recover() {
  const int place = group_.rank();
  if (!quorum_.recovering.empty()) {
    Snapshot state = snapshot();  // once for all its newcomers (collective with ZeRO)
    for (const int healer : quorum_.recovering) {
      if (!step_ok_) break;  // this place has no quorum: its receiver fails alone, by its timeout
      const auto started = Clock::now();
      try {
        comm::OperationLabel label("recovery of group " + std::to_string(healer) + " at step " + std::to_string(step_));
        recovery_moment("named", healer);
        auto pair = client_->connect(quorum_.id, "recover-" + std::to_string(healer), place, 0, 2);
        const auto met = Clock::now();
        send_state(*pair, state, healer);
        char timing[96];  // the pair's meeting apart from the sends: the rate is the sends'
        std::snprintf(timing, sizeof timing, "; met in %.1f ms, sent in %.2f ms)",
                      std::chrono::duration<double, std::milli>(met - started).count(),
                      std::chrono::duration<double, std::milli>(Clock::now() - met).count());
        event("sent", seconds_since(started),
              "state to group " + std::to_string(healer) + " (" + std::to_string(state.bytes) + " bytes from this rank" +
                  (options_.zero != nullptr ? ", its pieces" : "") + timing);
      } catch (const std::exception& error) {
        step_ok_ = false;
        event("failed", seconds_since(started), "sending the state to group " + std::to_string(healer) + ": " + error.what());
      }
    }
  }
  if (quorum_.recover_from < 0) return;
  const auto started = Clock::now();
  const std::string from = "group " + std::to_string(quorum_.recover_from);
  std::string why = step_ok_ ? "" : "this place did not meet the quorum";
  Received received;
  if (step_ok_) {
    try {
      comm::OperationLabel label("recovery from " + from);
      auto pair = client_->connect(quorum_.id, "recover-" + std::to_string(group()), place, 1, 2);
      received = receive_state(*pair, quorum_.recover_from);
    } catch (const std::exception& error) {
      why = error.what();
    }
  }
  const std::int64_t old_step = step_, old_position = position_;
  if (group_agrees(why.empty())) {
    try {
      io::Metadata scaler_state;  // the loss scaler's entries, apart from the optimizer's
      for (auto entry = received.metadata.begin(); entry != received.metadata.end();) {
        if (entry->first.rfind("grad_scaler.", 0) != 0) {
          ++entry;
          continue;
        }
        scaler_state.insert(*entry);
        entry = received.metadata.erase(entry);
      }
      if (options_.zero != nullptr) {  // collective: every rank checks, then adopts, then gathers
        options_.zero->adopt_pieces({std::move(received.tensors), std::move(received.metadata)},
                                    "the pieces received from " + from);
      } else if (optimizer_ != nullptr) {
        optimizer_->load_state(received.tensors, received.metadata, "the optimizer state received from " + from);
      }
      if (options_.grad_scaler != nullptr) options_.grad_scaler->load_state(scaler_state);
      step_ = received.step;
      position_ = received.position;
    } catch (const std::exception& error) {
      why = error.what();
    }
    // Every rank of the group checks (under ZeRO the model's checksum is collective).
    const Snapshot got = snapshot();
    if (why.empty() && got.digest != received.digest) {
      char digits[64];
      std::snprintf(digits, sizeof digits, "%016" PRIx64 ", sent %016" PRIx64, got.digest, received.digest);
      why = std::string("the state received does not match its checksum (XXH64 ") + digits + ")";
    }
    if (why.empty() && got.model != received.model) {
      char digits[64];
      std::snprintf(digits, sizeof digits, "%016" PRIx64 ", the source's %016" PRIx64, got.model, received.model);
      why = std::string("the model put together from the pieces is not the source's (checksum ") + digits + ")";
    }
    if (group_agrees(why.empty())) {
      failed_recoveries_ = 0;
      event("recovered", seconds_since(started), "from " + from + " at step " + std::to_string(step_));
      return;
    }
  }
  step_ = old_step;  // the group stays behind, and recovers again at the next quorum
  position_ = old_position;
  step_ok_ = false;
  event("failed", seconds_since(started),
        "recovering from " + from + ": " + (why.empty() ? "another rank of this group failed" : why));
  // A recovery that fails again and again is not a peer dying at the wrong moment: end with it.
  GRADSYNC_CHECK(++failed_recoveries_ < 5, "replica group ", group(), " rank ", place, ": recovery failed ",
                 failed_recoveries_, " times in a row, the last from ", from, ": ",
                 why.empty() ? "another rank of this group failed" : why);
}

bool FaultTolerance::average_gradients() {
  // Every member with a communicator takes part, even one whose step already failed (its vote
  // discards the step): the others would otherwise wait for it until their timeout.
  bool ok = step_ok_ && cross_ != nullptr;
  if (cross_ != nullptr && quorum_.members.size() > 1) {
    try {
      comm::OperationLabel label("gradients of step " + std::to_string(step_) + " across quorum " +
                                 std::to_string(quorum_.id));
      const auto& arenas = registry_.arenas();
      for (std::size_t a = 0; a < arenas.size(); ++a) {
        Tensor grads = arenas[a].grads;
        comm::Communicator& across = arenas[a].device.is_cuda() && cross_device_ ? *cross_device_ : *cross_;
        if (optimizer_ == nullptr || !optimizer_->sharded()) {
          wait_across(*across.allreduce_async(grads, comm::ReduceOp::avg));
          continue;
        }
        // ZeRO 1 or 2 inside the group: this rank steps only its pieces, and place p of every
        // group owns the same ones, so only they cross (HSDP's saving: 1/S of the gradient per rank).
        std::vector<Tensor> pieces;
        for (const optim::Optimizer::ElementRange& range : optimizer_->shard_ranges(a)) {
          pieces.push_back(grads.view(static_cast<std::size_t>(range.begin), {range.end - range.begin}));
        }
        if (!pieces.empty()) wait_across(*across.allreduce_coalesced_async(std::move(pieces), comm::ReduceOp::avg));
      }
    } catch (const std::exception& error) {
      ok = false;
      cross_device_.reset();  // broken (NCCL's aborts): the next quorum makes new ones
      cross_.reset();
      std::string groups;  // the message names ranks of the quorum: say which groups they are
      for (std::size_t r = 0; r < quorum_.members.size(); ++r) {
        groups += (r > 0 ? ", rank " : "rank ") + std::to_string(r) + " is group " + std::to_string(quorum_.members[r]);
      }
      event("failed", 0, std::string("the cross-group reduction: ") + error.what() + " [" + groups + "]");
    }
  }
  step_ok_ = group_agrees(ok);
  return step_ok_;
}

// Waits for a cross-group operation, and gives it up as soon as the coordinator says a member of
// the quorum is lost (its heartbeat silent: stopped, partitioned, killed without a goodbye): the
// operation would otherwise end only at the cross-group timeout. A healthy step is hardly slowed:
// completion is polled every 100 us, and the coordinator's word read only once the operation has
// run 50 ms, then every 20 ms. Giving up expires the Work, which aborts the running operation
// (the cross-group communicators are interruptible) and breaks the communicator (the next
// quorum makes new ones), so nothing lands late in the gradients.
void FaultTolerance::wait_across(comm::Work& work) {
  const auto started = Clock::now();
  auto next_look = started + std::chrono::milliseconds(50);
  while (!work.is_completed()) {
    const auto now = Clock::now();
    if (now >= next_look) {
      next_look = now + std::chrono::milliseconds(20);
      const std::string lost = client_->lost_from(quorum_.id);
      if (!lost.empty()) {
        try {
          work.wait(std::chrono::milliseconds(1));  // long expired: aborts the operation
        } catch (const std::exception&) {
        }
        detail::throw_error("the coordinator lost group(s) ", lost, " of quorum ", quorum_.id, " while this group waited ",
                            "on them in ", work.description(), " (", static_cast<long long>(seconds_since(started) * 1000),
                            " ms in): given up, not waited out");
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  work.wait();
}

bool FaultTolerance::should_commit() {
  const comm::Quorum ran = quorum_;
  if (group_.rank() == 0) {
    try {
      quorum_ = client_->vote(ran, step_, step_ok_, stop_requested_);
    } catch (const std::exception& error) {
      quorum_ = comm::Quorum{};
      quorum_.error = error.what();
    }
  }
  broadcast_quorum();
  const bool committed = quorum_.committed;
  checkpoint_writer_ = committed && ran.index == 0;
  stopping_ = stopping_ || (committed && quorum_.stop);
  if (committed) {
    ++step_;
    position_ += static_cast<std::int64_t>(ran.members.size()) * options_.samples_per_group;
  } else {
    event("discarded", 0, "step " + std::to_string(step_ + 1) + " in quorum " + std::to_string(ran.id));
  }
  if (quorum_.id != connected_) {  // a new quorum meets at the next start_step
    cross_device_.reset();
    cross_.reset();
  }
  return committed;
}

}  // namespace gradsync::dist
