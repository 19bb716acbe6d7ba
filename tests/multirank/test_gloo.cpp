// Gloo with ranks as threads: every collective for every dtype at sizes 0, 1, odd and 1M on
// world sizes 1, 2, 3, 4 and 8; async ordering; the timeout path; the debug-mode mismatch
// path; argument errors; the file-store rendezvous.
#include "gradsync/comm/gloo/gloo.h"

#include <atomic>
#include <barrier>
#include <fstream>
#include <chrono>
#include <thread>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "collectives.h"
#include "expectations.h"
#include "gradsync/comm/agreement.h"
#include "gradsync/comm/connect.h"
#include "gradsync/comm/records/flight_recorder.h"

namespace gradsync {
namespace {

using comm::Communicator;
using comm::ReduceOp;
using namespace std::chrono_literals;

class GlooWorld : public ::testing::TestWithParam<int> {};

TEST_P(GlooWorld, EveryCollectiveEveryDType) {
  const int size = GetParam();
  // Large tensors on the biggest world would take minutes on two cores; world 8 covers the
  // small sizes, the others the 1M case too.
  const std::vector<std::int64_t> sizes = size >= 8 ? std::vector<std::int64_t>{0, 1, 7, 1001}
                                                    : std::vector<std::int64_t>{0, 1, 7, 1 << 20};
  comm::run_gloo_thread_group(size, [&](Communicator& comm) {
    EXPECT_EQ(comm.size(), size);
    EXPECT_STREQ(comm.backend(), "gloo");
    testing::check_collectives(comm, sizes);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooWorld, ::testing::Values(1, 2, 3, 4, 8));

TEST(GlooWorld8, OneMillionElementsF32) {
  comm::run_gloo_thread_group(8, [](Communicator& comm) {
    testing::check_collectives(comm, {1 << 20}, {DType::f32});
  });
}

TEST(Gloo, ManyInFlightOperationsCompleteInOrder) {
  comm::run_gloo_thread_group(3, [](Communicator& comm) {
    std::vector<Tensor> tensors;
    std::vector<comm::WorkHandle> works;
    for (int k = 0; k < 64; ++k) {
      tensors.push_back(testing::filled(1000 + k, DType::f32, [&](std::int64_t i) { return comm.rank() + k + i % 3; }));
      works.push_back(comm.allreduce_async(tensors.back(), ReduceOp::sum));
    }
    works.back()->wait();  // waiting on the last one first changes nothing
    for (int k = 0; k < 64; ++k) {
      EXPECT_TRUE(works[static_cast<std::size_t>(k)]->is_completed()) << "work " << k << " ran before the last";
      works[static_cast<std::size_t>(k)]->wait();
      const std::vector<double> values = tensors[static_cast<std::size_t>(k)].to_double_vector();
      for (std::size_t i = 0; i < values.size(); ++i) {
        ASSERT_EQ(values[i], 3.0 * (k + static_cast<double>(i % 3)) + 3.0) << "tensor " << k << " element " << i;
      }
    }
    EXPECT_NE(works[5]->description().find("allreduce #5 (sum)"), std::string::npos) << works[5]->description();
  });
}

TEST(Gloo, ARankThatSkipsACollectiveMakesTheOthersFailWithinTheTimeout) {
  std::atomic<bool> rank0_failed{false};
  std::string message;
  std::chrono::milliseconds elapsed{0};
  comm::run_gloo_thread_group(2, [&](Communicator& comm) {
    if (comm.rank() == 1) {
      std::this_thread::sleep_for(2500ms);  // alive, but never joins the allreduce
      return;
    }
    Tensor t = Tensor::zeros({16}, DType::f32);
    const auto start = std::chrono::steady_clock::now();
    try {
      comm.allreduce(t, ReduceOp::sum);
    } catch (const Error& error) {
      rank0_failed = true;
      message = error.what();
    }
    elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    // The communicator is broken now: the next operation fails at once.
    try {
      comm.barrier();
      ADD_FAILURE() << "a broken communicator must refuse new work";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("broken"), std::string::npos) << error.what();
    }
  }, {.timeout = 1000ms, .check_agreement = false});
  EXPECT_TRUE(rank0_failed) << "rank 0 must get an error, not hang";
  EXPECT_LT(elapsed.count(), 4000) << "the error must come within the timeout (plus a margin)";
  EXPECT_NE(message.find("rank 0"), std::string::npos) << message;
  EXPECT_NE(message.find("allreduce #0 (sum), f32 x 16"), std::string::npos) << message;
}

TEST(Gloo, DebugModeReportsTheFirstMismatchWithBothViews) {
  std::vector<std::string> messages(2);
  comm::run_gloo_thread_group(2, [&](Communicator& comm) {
    Tensor t = Tensor::zeros({comm.rank() == 0 ? 10 : 9}, DType::f32);
    try {
      comm.allreduce(t, ReduceOp::sum);
    } catch (const Error& error) {
      messages[static_cast<std::size_t>(comm.rank())] = error.what();
    }
  }, {.timeout = 5000ms, .check_agreement = true});
  EXPECT_NE(messages[0].find("collective mismatch: this rank (0) runs allreduce #0 (sum), f32 x 10, rank 1 runs "
                             "allreduce #0 (sum), f32 x 9"),
            std::string::npos)
      << messages[0];
  EXPECT_NE(messages[1].find("this rank (1) runs allreduce #0 (sum), f32 x 9, rank 0 runs allreduce #0 (sum), f32 x 10"),
            std::string::npos)
      << messages[1];

  std::vector<std::string> dtype_messages(2);
  comm::run_gloo_thread_group(2, [&](Communicator& comm) {
    Tensor t = Tensor::zeros({4}, comm.rank() == 0 ? DType::f32 : DType::bf16);
    try {
      comm.broadcast(t, 0);
    } catch (const Error& error) {
      dtype_messages[static_cast<std::size_t>(comm.rank())] = error.what();
    }
  }, {.timeout = 5000ms, .check_agreement = true});
  EXPECT_NE(dtype_messages[0].find("broadcast #0 root 0, f32 x 4, rank 1 runs broadcast #0 root 0, bf16 x 4"),
            std::string::npos)
      << dtype_messages[0];
}

TEST(Gloo, ArgumentErrorsNameTheOperation) {
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    // CUDA tensors are staged through host memory; on a machine without a usable device
    // that is an error naming the operation and the device (before anything is queued).
    if (cuda_device_count() == 0) {
      float host_memory[4] = {};
      Tensor pretend_cuda = Tensor::wrap(host_memory, {4}, DType::f32, Device::cuda(0));  // never touched
      EXPECT_GRADSYNC_ERROR(comm.allreduce(pretend_cuda, ReduceOp::sum), "allreduce", "f32[4] on cuda:0",
                            "is not usable");
      Tensor host_out = Tensor::zeros({8}, DType::f32);
      EXPECT_GRADSYNC_ERROR(comm.allgather(pretend_cuda, host_out), "allgather", "one device");
    }
    Tensor ints = Tensor::zeros({4}, DType::i32);
    EXPECT_GRADSYNC_ERROR(comm.allreduce(ints, ReduceOp::avg), "avg", "i32[4]");
    Tensor in = Tensor::zeros({4}, DType::f32);
    Tensor wrong_dtype = Tensor::zeros({8}, DType::f64);
    EXPECT_GRADSYNC_ERROR(comm.allgather(in, wrong_dtype), "allgather", "f64[8]");
    Tensor wrong_size = Tensor::zeros({7}, DType::f32);
    EXPECT_GRADSYNC_ERROR(comm.allgather(in, wrong_size), "allgather", "must hold 2 x f32[4]");
    EXPECT_GRADSYNC_ERROR(comm.broadcast(in, 5), "broadcast", "root 5");
    EXPECT_GRADSYNC_ERROR(comm.send(in, comm.rank()), "cannot exchange with itself");
    EXPECT_GRADSYNC_ERROR(comm.allgatherv(in, wrong_size, {4}), "1 counts for 2 ranks");
    comm.barrier();  // validation errors do not break the communicator
  });
}

// comm::agree: nothing when every rank succeeded; otherwise the same error on every rank, naming
// the lowest failing rank's reason (said once, without its own "rank R: ") and the others.
TEST(Gloo, AgreementRaisesTheSameErrorOnEveryRank) {
  std::vector<std::string> messages(4);
  comm::run_gloo_thread_group(4, [&](Communicator& comm) {
    comm::agree(comm, "checking", [] {});
    try {
      comm::agree(comm, "checking the files", [&] {
        GRADSYNC_CHECK(comm.rank() != 1 && comm.rank() != 3, "file", comm.rank(), " is damaged");
      });
    } catch (const Error& error) {
      messages[static_cast<std::size_t>(comm.rank())] = error.what();
    }
    EXPECT_GRADSYNC_ERROR(comm::agree(comm, "long", comm.rank() == 2 ? std::string(10000, 'x') : std::string()),
                          "long: rank 2: xxxx", "...");
  });
  for (const std::string& message : messages) {
    EXPECT_EQ(message, "checking the files: rank 1: file1 is damaged (rank 3 failed too)");
  }
}

// ---- The flight recorder (gradsync/comm/records/flight_recorder.h) ----------------------------------

nlohmann::json read_record(const std::filesystem::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// The ring keeps the last N operations, each with its issuer's label (the innermost), its
// state and times; p2p operations name their peer and tag; a dump is one file per rank.
TEST(FlightRecorder, KeepsTheLastOperationsWithTheirLabelsOneFilePerRank) {
  const testing::ScopedVariable entries("GRADSYNC_FLIGHT_RECORDER", "8");
  testing::TempDir folder;
  std::barrier both_done(2), dumped(2);
  comm::run_gloo_thread_group(2, [&](Communicator& comm) {
    const comm::OperationLabel outer("outer");
    for (int k = 0; k < 10; ++k) {
      const comm::OperationLabel label("op " + std::to_string(k));
      Tensor t = Tensor::from_vector(std::vector<float>(3, 1.0f), {3});
      comm.allreduce(t, comm::ReduceOp::sum);
    }
    Tensor x = Tensor::from_vector(std::vector<float>{1, 2}, {2});
    if (comm.rank() == 0) {
      comm.send(x, 1, 7);
    } else {
      comm.recv(x, 0, 7);
    }
    comm.barrier();  // labelled "outer": the inner labels have ended
    // Both threads are past their barrier (recorded as completed) before rank 0 dumps, and
    // neither leaves (ending its communicator) before the dump is written.
    both_done.arrive_and_wait();
    if (comm.rank() == 0) {
      EXPECT_EQ(comm::dump_flight_records(folder.path()).size(), 2u);
    }
    dumped.arrive_and_wait();
  });
  for (int rank = 0; rank < 2; ++rank) {
    const nlohmann::json dump = read_record(folder / ("rank" + std::to_string(rank) + ".json"));
    EXPECT_EQ(dump["rank"], rank);
    EXPECT_EQ(dump["reason"], "requested");
    ASSERT_EQ(dump["communicators"].size(), 1u);
    const nlohmann::json& record = dump["communicators"][0];
    EXPECT_EQ(record["backend"], "gloo");
    EXPECT_EQ(record["capacity"], 8);
    const nlohmann::json& entries = record["entries"];
    ASSERT_EQ(entries.size(), 8u) << record.dump(1);
    // Ops 0-3 have left the ring; 4-9, the p2p operation and the first barrier remain.
    EXPECT_EQ(entries[0]["seq"], 4);
    EXPECT_EQ(entries[0]["label"], "op 4");
    EXPECT_EQ(entries[0]["what"], "allreduce #4 (sum), f32 x 3");
    EXPECT_EQ(entries[5]["label"], "op 9");
    EXPECT_EQ(entries[6]["p2p"], rank == 0 ? "send" : "recv");
    EXPECT_EQ(entries[6]["peer"], 1 - rank);
    EXPECT_EQ(entries[6]["tag"], 7);
    EXPECT_EQ(entries[7]["op"], "barrier");
    EXPECT_EQ(entries[7]["label"], "outer");
    for (const nlohmann::json& entry : entries) {
      EXPECT_EQ(entry["state"], "completed") << entry.dump();
      EXPECT_LE(entry["issued_us"].get<std::int64_t>(), entry["started_us"].get<std::int64_t>());
      EXPECT_LE(entry["started_us"].get<std::int64_t>(), entry["ended_us"].get<std::int64_t>());
    }
  }
}

// A failure dumps the failing rank's record into GRADSYNC_FLIGHT_RECORDER_DIR, and the error
// says where; the operation that failed is marked so.
TEST(FlightRecorder, AFailureDumpsTheRecordAndTheErrorSaysWhere) {
  testing::TempDir folder;
  const testing::ScopedVariable dir("GRADSYNC_FLIGHT_RECORDER_DIR", folder.path().string());
  std::string message;
  comm::run_gloo_thread_group(
      2,
      [&](Communicator& comm) {
        Tensor t = Tensor::from_vector(std::vector<float>{1.0f}, {1});
        comm.allreduce(t, comm::ReduceOp::sum);
        if (comm.rank() == 1) return;  // skips the second allreduce, and leaves
        try {
          const comm::OperationLabel label("the one rank 1 skipped");
          comm.allreduce(t, comm::ReduceOp::sum);
        } catch (const Error& error) {
          message = error.what();
        }
      },
      {.timeout = std::chrono::milliseconds(500)});
  const auto path = folder / "rank0.json";
  EXPECT_NE(message.find("(flight record: " + path.string() + ")"), std::string::npos) << message;
  const nlohmann::json dump = read_record(path);
  const nlohmann::json& entries = dump["communicators"][0]["entries"];
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[1]["label"], "the one rank 1 skipped");
  EXPECT_TRUE(entries[1]["state"] == "failed" || entries[1]["state"] == "timed out") << entries[1].dump();
  EXPECT_FALSE(dump["communicators"][0]["broken"].get<std::string>().empty());
}

// A rank slowed on purpose is the one the others wait for; the summary names it.
TEST(FlightRecorder, TheStragglerMonitorNamesASlowedRank) {
  std::vector<comm::StragglerReport> reports(3);
  comm::run_gloo_thread_group(3, [&](Communicator& comm) {
    comm::StragglerMonitor monitor(comm);
    for (int step = 0; step < 8; ++step) {
      if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(40));
      Tensor t = Tensor::from_vector(std::vector<float>(1000, 1.0f), {1000});
      comm.allreduce(t, comm::ReduceOp::sum);
      monitor.step();
    }
    reports[static_cast<std::size_t>(comm.rank())] = monitor.collect();
  });
  for (const comm::StragglerReport& report : reports) {
    EXPECT_EQ(report.slowest, 1) << report.line();
    EXPECT_EQ(report.steps, 8);
    // 40 ms a step; the others' wait is most of it even on a loaded machine.
    EXPECT_GT(report.waited_ms_per_step, 20.0) << report.line();
    EXPECT_NE(report.line().find("slowest rank 1"), std::string::npos);
  }
}

TEST(Gloo, FileStoreRendezvous) {
  testing::TempDir folder;
  std::vector<double> results(3);
  std::vector<std::thread> processes;  // threads standing in for processes: each meets via files only
  for (int rank = 0; rank < 3; ++rank) {
    processes.emplace_back([&, rank] {
      auto comm = comm::gloo_file_store(folder.path() / "store", rank, 3, {.timeout = 20000ms, .check_agreement = false});
      Tensor t = Tensor::from_vector(std::vector<double>{static_cast<double>(rank + 1)}, {1});
      comm->allreduce(t, ReduceOp::sum);
      results[static_cast<std::size_t>(rank)] = t.to_double_vector()[0];
    });
  }
  for (std::thread& process : processes) process.join();
  EXPECT_EQ(results, (std::vector<double>{6, 6, 6}));
}

// A TCP port nobody listens on right now: the kernel picks one, we release it.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  ::close(fd);
  return ntohs(address.sin_port);
}

TEST(Gloo, TcpStoreRendezvous) {
  for (const int size : {1, 2, 4}) {
    const int port = free_port();
    std::vector<double> results(static_cast<std::size_t>(size));
    std::vector<std::thread> processes;  // each meets the others only through rank 0's TCP store
    for (int rank = 0; rank < size; ++rank) {
      processes.emplace_back([&, rank] {
        auto comm = comm::gloo_tcp_store("127.0.0.1", port, rank, size, {.timeout = 20000ms, .check_agreement = false});
        EXPECT_EQ(comm->rank(), rank);
        EXPECT_EQ(comm->size(), size);
        Tensor t = Tensor::from_vector(std::vector<double>{static_cast<double>(rank + 1)}, {1});
        comm->allreduce(t, ReduceOp::sum);
        results[static_cast<std::size_t>(rank)] = t.to_double_vector()[0];
      });
    }
    for (std::thread& process : processes) process.join();
    EXPECT_EQ(results, std::vector<double>(static_cast<std::size_t>(size), size * (size + 1) / 2.0)) << "world " << size;
  }
}

TEST(Gloo, TcpStoreRankThatNeverComesIsATimeoutNotAHang) {
  const int port = free_port();
  const auto start = std::chrono::steady_clock::now();
  // Rank 0 serves and waits for rank 1, which never starts.
  EXPECT_GRADSYNC_ERROR(comm::gloo_tcp_store("127.0.0.1", port, 0, 2, {.timeout = 1500ms, .check_agreement = false}),
                        "rendezvous of rank 0 of 2");
  // Rank 1 of a world whose rank 0 never starts: nobody serves the store.
  EXPECT_GRADSYNC_ERROR(comm::gloo_tcp_store("127.0.0.1", free_port(), 1, 2, {.timeout = 1000ms, .check_agreement = false}),
                        "cannot reach the rank-0 store");
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
}

TEST(Connect, BackendChoiceIsExplainedAndCheckedByName) {
  EXPECT_GRADSYNC_ERROR(comm::choose_backend("infiniband", Device::cpu()), "unknown backend 'infiniband'",
                        "auto, nccl, mpi, gloo");
  EXPECT_EQ(comm::choose_backend("gloo", Device::cpu()), "gloo");
  if (cuda_device_count() == 0) {
    // No GPU: CUDA tensors cannot get NCCL; auto falls back to a CPU backend, by name is an error.
    EXPECT_NE(comm::choose_backend("auto", Device::cuda(0)), "nccl");
    EXPECT_GRADSYNC_ERROR(comm::choose_backend("nccl", Device::cuda(0)), "backend nccl");
  }
  // Not started by mpirun and no RANK/WORLD_SIZE in the environment: a world of one.
  if (std::getenv("WORLD_SIZE") == nullptr && std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr) {
    auto comm = comm::connect();
    EXPECT_EQ(std::string(comm->backend()), "gloo");
    EXPECT_EQ(comm->size(), 1);
    Tensor t = Tensor::from_vector(std::vector<float>{3.0f}, {1});
    comm->allreduce(t, ReduceOp::avg);
    EXPECT_EQ(t.to_double_vector()[0], 3.0);
  }
}

}  // namespace
}  // namespace gradsync
