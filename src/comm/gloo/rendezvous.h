// Internal: how Gloo ranks meet. A store (in-process, a shared folder, or the TCP store rank 0
// serves) carries each rank's transport address to the others; Gloo's connectFullMesh then
// opens a TCP pair between every two ranks. The waits report who has not arrived yet and end
// at the rendezvous timeout with an error naming them. rendezvous.cpp also holds the
// public ways to start a Gloo world (gradsync/comm/gloo/gloo.h).
#pragma once

#include <gloo/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/device.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/cpu/backend.h"

namespace gradsync::comm {

// How a Gloo world met: the store (kept, so that duplicate() can meet again under a fresh
// prefix), this rank's transport device, and whatever must outlive the store's clients.
struct Rendezvous {
  std::shared_ptr<gloo::rendezvous::Store> store;
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<void> keepalive;  // rank 0 of a TCP rendezvous: the store server
  std::string where;                // "the TCP store at host:port", for messages
  std::chrono::milliseconds timeout{300000};  // the rendezvous timeout
  bool interruptible = false;                 // CommOptions::interruptible
};

// A view of a store under a prefix that keeps the store alive (Gloo's PrefixStore holds a plain
// reference): a thread that outlives its caller (store_markers) may use it.
class OwningPrefixStore final : public gloo::rendezvous::PrefixStore {
 public:
  OwningPrefixStore(const std::string& prefix, std::shared_ptr<gloo::rendezvous::Store> parent)
      : PrefixStore(prefix, *parent), parent_(std::move(parent)) {}

 private:
  std::shared_ptr<gloo::rendezvous::Store> parent_;
};

// Connects this rank to every other through `store` (the rendezvous' own, or a prefixed view of
// it for a duplicate), within the rendezvous timeout. A failure names the ranks that said
// nothing while the others failed (died or hung while the ranks connected).
std::shared_ptr<gloo::Context> connect_full_mesh(std::shared_ptr<gloo::rendezvous::Store> store, const Rendezvous& rendezvous,
                                                 int rank, int size);

// Records keys[me] in `store`, then which of the other keys are there: each looked for until
// `grace` has passed. On a thread of its own, waited for at most grace + slack: a store whose
// server is stopped (not gone) would otherwise hold the caller for the store's own timeout.
// nullopt when the store did not answer in time, failed, or is null. The thread holds the store.
// How the ranks of a failure tell the dead from the survivors (backend.cpp, connect_full_mesh).
std::optional<std::vector<bool>> store_markers(std::shared_ptr<gloo::rendezvous::Store> store, std::vector<std::string> keys,
                                               int me, std::chrono::milliseconds grace, std::chrono::milliseconds slack);
// Which ranks said they failed while the ranks connected (prefix + "gradsync/connect-failed/r",
// through store_markers), this rank's failure recorded first. The rank that serves the store
// (rendezvous.keepalive) then waits, at most a moment, until those ranks have read the answer,
// so that its exit does not take the store from a slower survivor still asking.
std::optional<std::vector<bool>> connect_failure_census(std::shared_ptr<gloo::rendezvous::Store> store,
                                                        const std::string& prefix, const Rendezvous& rendezvous, int rank,
                                                        int size);
// " (rank 2 said nothing: ...)" from store_markers' answer, for a failure of rank `me` of `size`.
std::string silent_ranks(const std::optional<std::vector<bool>>& said, int me, int size, const std::string& where);

// The backend over a connected context (backend.cpp); `prefix` names it in the store, so
// that its duplicates meet under fresh names.
std::unique_ptr<Backend> make_gloo_backend(std::shared_ptr<gloo::Context> context, Rendezvous rendezvous,
                                           std::string prefix);

// A Gloo communicator of `size` ranks meeting under `prefix` in `store` (which it keeps): the
// fault-tolerant groups' cross-group communicators, made anew for every quorum through the
// coordinator's store. `where` names the store in messages.
std::unique_ptr<Communicator> gloo_prefixed_communicator(std::shared_ptr<gloo::rendezvous::Store> store,
                                                         const std::string& prefix, std::string where, int rank, int size,
                                                         const CommOptions& options);

}  // namespace gradsync::comm
