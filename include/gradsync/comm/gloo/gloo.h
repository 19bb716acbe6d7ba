// gradsync/comm/gloo/gloo.h - Gloo communicators (CPU tensors, TCP).
//
// Four ways for ranks to meet:
//  * gloo_thread_group(n): n ranks as threads of this process, meeting through an in-memory
//    store and talking over loopback TCP: the harness of our multi-rank tests (as Gloo's own).
//  * gloo_file_store(path, rank, size): ranks as processes meeting through files in a folder
//    they all see (a shared file system across machines). Remove the folder between runs.
//  * gloo_tcp_store(host, port, rank, size): ranks as processes on one or several machines,
//    meeting through a small key-value server that rank 0 runs on `port` (torchrun's
//    MASTER_ADDR / MASTER_PORT; comm::connect reads them together with RANK and WORLD_SIZE).
//  * gloo_torch_store(host, port, rank, size, prefix): the same at a PyTorch TCPStore that
//    something else serves (torchrun's agent does; comm::connect chooses it there).
// The address each rank listens on for its peers is GRADSYNC_GLOO_HOST (an address or name the
// other machines can reach), else loopback, which is enough on one machine.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include "gradsync/comm/communicator.h"

namespace gradsync::comm {

bool gloo_available();  // this build has Gloo

// Runs body(communicator) on `size` threads, one communicator per rank, and rethrows the
// first exception any rank raised (after all threads finished). Each thread is labelled with
// its rank for error messages.
void run_gloo_thread_group(int size, const std::function<void(Communicator&)>& body,
                           const CommOptions& options = {});
// The same with each rank's own options (e.g. CommOptions::node, to simulate several nodes);
// the rendezvous takes its timeouts from rank 0's.
void run_gloo_thread_group(int size, const std::function<void(Communicator&)>& body,
                           const std::function<CommOptions(int rank)>& options_of);

// A process's communicator, meeting the others through a folder.
std::unique_ptr<Communicator> gloo_file_store(const std::filesystem::path& folder, int rank, int size,
                                              const CommOptions& options = {});

// A process's communicator, meeting the others through rank 0's TCP store at host:port.
std::unique_ptr<Communicator> gloo_tcp_store(const std::string& host, int port, int rank, int size,
                                             const CommOptions& options = {});

// A process's communicator, meeting the others at a PyTorch TCPStore that something else serves
// at host:port (torchrun's agent, or a torch.distributed.TCPStore of your own): every rank is a
// client, and gradsync's keys live under `prefix`. comm::connect chooses this under torchrun.
std::unique_ptr<Communicator> gloo_torch_store(const std::string& host, int port, int rank, int size,
                                               const std::string& prefix, const CommOptions& options = {});

}  // namespace gradsync::comm
