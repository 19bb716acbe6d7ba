// gradsync/comm/gloo.h - Gloo communicators (CPU tensors, TCP).
//
// Three ways for ranks to meet:
//  * gloo_thread_group(n): n ranks as threads of this process, meeting through an in-memory
//    store and talking over loopback TCP: the harness of our multi-rank tests (as Gloo's own).
//  * gloo_file_store(path, rank, size): ranks as processes meeting through files in a folder
//    they all see (a shared file system across machines). Remove the folder between runs.
//  * The TCP-store rendezvous from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun's
//    variables) is not built yet.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include "gradsync/comm/communicator.h"

namespace gradsync::comm {

bool gloo_available();

// Runs body(communicator) on `size` threads, one communicator per rank, and rethrows the
// first exception any rank raised (after all threads finished). Each thread is labelled with
// its rank for error messages. `interface_address` is the loopback address to bind.
void run_gloo_thread_group(int size, const std::function<void(Communicator&)>& body,
                           const CommOptions& options = {});

// A process's communicator, meeting the others through a folder.
std::unique_ptr<Communicator> gloo_file_store(const std::filesystem::path& folder, int rank, int size,
                                              const CommOptions& options = {});

}  // namespace gradsync::comm
