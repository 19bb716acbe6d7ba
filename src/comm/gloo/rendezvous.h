// Internal: how Gloo ranks meet. A store (in-process, a shared folder, or the TCP store rank 0
// serves) carries each rank's transport address to the others; Gloo's connectFullMesh then
// opens a TCP pair between every two ranks. The waits report who has not arrived yet and end
// at the rendezvous timeout with an error naming them. rendezvous.cpp also holds the
// public ways to start a Gloo world (gradsync/comm/gloo/gloo.h).
#pragma once

#include <gloo/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/device.h>

#include <chrono>
#include <memory>
#include <string>

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

// Connects this rank to every other through `store` (the rendezvous' own, or a prefixed view of
// it for a duplicate), within the rendezvous timeout.
std::shared_ptr<gloo::Context> connect_full_mesh(gloo::rendezvous::Store& store, const Rendezvous& rendezvous, int rank,
                                                 int size);

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
