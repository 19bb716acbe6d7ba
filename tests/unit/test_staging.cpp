// What lets device tensors travel and device work fail safely, tested without a GPU:
//  * the operation ledger behind every NCCL Work: an operation that was in flight when its
//    communicator aborted is lost for good, whatever its CUDA event says afterwards; one
//    completed before the abort stays a success; the abort runs once; every later use names
//    the original failure (the completion query is a flag here, a CUDA event in NCCL);
//  * the staging pool (pooled by size class, bounded, safe across threads) that Gloo and MPI
//    stage device tensors through, and NCCL its small host collectives;
//  * the caller's stream bookkeeping (CudaStreamScope).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "comm/records/operation_ledger.h"
#include "core/staging.h"
#include "gradsync/core/stream.h"
#include "test_util.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using comm::OperationLedger;
using Verdict = OperationLedger::Verdict;

struct LedgerFixture {
  std::atomic<int> aborts{0};
  OperationLedger ledger{"nccl", [this] { ++aborts; }};
};

TEST(OperationLedger, AnOperationCompletedBeforeTheFailureStaysASuccess) {
  LedgerFixture f;
  std::atomic<bool> done{false};
  auto operation = f.ledger.track("allreduce #0 (sum), f32 x 4", [&] { return done.load(); });
  EXPECT_FALSE(f.ledger.settled(*operation));
  done = true;
  EXPECT_GRADSYNC_ERROR(f.ledger.fail("allreduce #1 timed out"), "nccl", "allreduce #1 timed out");
  EXPECT_EQ(f.ledger.poll(*operation), Verdict::succeeded);
  f.ledger.wait(*operation, 1000ms, nullptr);  // no throw: its data was reduced before the abort
  EXPECT_EQ(f.aborts.load(), 1);
}

TEST(OperationLedger, AnOperationInFlightAtTheAbortIsLostEvenWhenItsEventFiresLater) {
  LedgerFixture f;
  std::atomic<bool> done{false};
  auto operation = f.ledger.track("allreduce #3 (avg), bf16 x 1000", [&] { return done.load(); });
  EXPECT_GRADSYNC_ERROR(f.ledger.fail("broadcast #2 did not complete within 50 ms"), "broadcast #2");
  done = true;  // the abort ended its kernels: the event completes, the data was never reduced
  EXPECT_TRUE(f.ledger.settled(*operation));  // is_completed: yes, so a poll loop ends...
  EXPECT_EQ(f.ledger.poll(*operation), Verdict::lost);
  // ...and wait() says it failed, naming the original failure, every time it is asked.
  for (int attempt = 0; attempt < 2; ++attempt) {
    EXPECT_GRADSYNC_ERROR(f.ledger.wait(*operation, 1000ms, nullptr), "allreduce #3 (avg), bf16 x 1000", "was lost",
                          "broadcast #2 did not complete within 50 ms");
  }
}

TEST(OperationLedger, ATimedOutWaitAbortsOnceAndEverythingLaterNamesIt) {
  LedgerFixture f;
  auto stuck = f.ledger.track("allreduce #7 (sum), f32 x 8", [] { return false; });
  auto queued_behind = f.ledger.track("allgather #8, f32 x 16", [] { return false; });
  EXPECT_GRADSYNC_ERROR(f.ledger.wait(*stuck, 30ms, nullptr), "nccl", "allreduce #7", "did not complete within 30 ms",
                        "peer");
  EXPECT_EQ(f.aborts.load(), 1);
  EXPECT_GRADSYNC_ERROR(f.ledger.wait(*queued_behind, 1000ms, nullptr), "allgather #8", "was lost", "allreduce #7");
  EXPECT_GRADSYNC_ERROR(f.ledger.require_usable("reduce_scatter #9"), "reduce_scatter #9", "broken", "allreduce #7");
  auto later = f.ledger.track("barrier #10", [] { return true; });
  EXPECT_EQ(f.ledger.poll(*later), Verdict::lost);  // queued on an aborted communicator: never a success
  EXPECT_EQ(f.aborts.load(), 1);
  EXPECT_NE(f.ledger.broken_reason().find("allreduce #7"), std::string::npos);
}

// A device that errors when asked (a sticky CUDA error): the abort still runs, the operation is lost.
TEST(OperationLedger, AQueryThatThrowsDuringTheFailureStillAborts) {
  LedgerFixture f;
  auto operation = f.ledger.track("allreduce #4", [] () -> bool { throw Error("cudaErrorIllegalAddress"); });
  EXPECT_GRADSYNC_ERROR(f.ledger.fail("allreduce #3 failed asynchronously"), "allreduce #3");
  EXPECT_EQ(f.aborts.load(), 1);
  EXPECT_EQ(f.ledger.poll(*operation), Verdict::lost);
}

TEST(OperationLedger, TheProbeCanFailTheWait) {
  LedgerFixture f;
  auto operation = f.ledger.track("send p2p#0", [] { return false; });
  int probes = 0;
  EXPECT_GRADSYNC_ERROR(f.ledger.wait(*operation, 10000ms,
                                      [&] {
                                        if (++probes == 3) f.ledger.fail("send p2p#0 failed asynchronously: remote error");
                                      }),
                        "remote error");
  EXPECT_EQ(probes, 3);
  EXPECT_EQ(f.ledger.poll(*operation), Verdict::lost);
}

// Many threads fail at once (a timeout on one, an asynchronous error seen by another): the
// abort runs once, and everybody afterwards sees the same first reason. Run under TSan too.
TEST(OperationLedger, ConcurrentFailuresAbortOnceAndAgreeOnTheReason) {
  LedgerFixture f;
  std::atomic<bool> done{false};
  std::vector<std::shared_ptr<OperationLedger::Operation>> operations;
  for (int i = 0; i < 16; ++i) {
    operations.push_back(f.ledger.track("op " + std::to_string(i), [&, i] { return i % 2 == 0 && done.load(); }));
  }
  done = true;
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      try {
        f.ledger.fail("failure from thread " + std::to_string(t));
      } catch (const Error&) {
      }
      for (auto& operation : operations) f.ledger.poll(*operation);
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(f.aborts.load(), 1);
  const std::string reason = f.ledger.broken_reason();
  EXPECT_NE(reason.find("failure from thread"), std::string::npos);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(f.ledger.poll(*operations[static_cast<std::size_t>(i)]), i % 2 == 0 ? Verdict::succeeded : Verdict::lost) << i;
  }
}

TEST(StagingPool, LeasesAreReusedBySizeClassAndBounded) {
  detail::trim_staging_pool();
  const auto before = detail::staging_pool_stats();
  void* first = nullptr;
  {
    detail::PooledBuffer a = detail::lease_pinned(5000);
    EXPECT_GE(a.capacity(), 5000u);
    EXPECT_EQ(a.capacity(), 8192u);  // the next power of two
    EXPECT_TRUE(a.device().is_cpu());
    std::memset(a.data(), 0x5a, a.capacity());  // writable over its whole capacity (ASan checks)
    first = a.data();
    EXPECT_EQ(detail::staging_pool_stats().leased_bytes, before.leased_bytes + 8192);
  }
  EXPECT_EQ(detail::staging_pool_stats().cached_bytes, before.cached_bytes + 8192);
  {
    detail::PooledBuffer again = detail::lease_pinned(8000);  // same class: the same buffer, no allocation
    EXPECT_EQ(again.data(), first);
    detail::PooledBuffer bigger = detail::lease_pinned(9000);  // next class: a new one
    EXPECT_NE(bigger.data(), first);
    detail::PooledBuffer moved = std::move(bigger);
    EXPECT_EQ(bigger.data(), nullptr);
  }
  const auto after = detail::staging_pool_stats();
  EXPECT_EQ(after.allocations, before.allocations + 2);
  EXPECT_EQ(after.reuses, before.reuses + 1);
  EXPECT_EQ(after.leased_bytes, before.leased_bytes);
  EXPECT_LE(after.cached_bytes, detail::staging_pool_limit());
  detail::trim_staging_pool();
  EXPECT_EQ(detail::staging_pool_stats().cached_bytes, 0u);
  EXPECT_EQ(after.page_locked, cuda_device_count() > 0);
  EXPECT_GRADSYNC_ERROR(detail::lease_device(16, Device::cpu()), "lease_device", "CUDA device");
}

TEST(StagingPool, ThreadsLeaseAndReturnConcurrently) {
  std::vector<std::thread> threads;
  std::atomic<int> corrupted{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        detail::PooledBuffer buffer = detail::lease_pinned(static_cast<std::size_t>(1000 + 700 * (i % 5)));
        auto* bytes = static_cast<unsigned char*>(buffer.data());
        std::memset(bytes, t + 1, 1000);
        std::this_thread::yield();
        for (int k = 0; k < 1000; ++k) corrupted += bytes[k] != t + 1;  // nobody else holds it
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(corrupted.load(), 0);
  EXPECT_EQ(detail::staging_pool_stats().leased_bytes, 0u);
}

TEST(CudaStreamScope, NestsPerThreadAndDevice) {
  int a = 0, b = 0;
  void* const stream_a = &a;  // any pointer: the scope only records it (no CUDA needed)
  void* const stream_b = &b;
  EXPECT_EQ(current_cuda_stream(Device::cuda(1)), nullptr);
  {
    CudaStreamScope outer(Device::cuda(1), stream_a);
    EXPECT_EQ(current_cuda_stream(Device::cuda(1)), stream_a);
    EXPECT_EQ(current_cuda_stream(Device::cuda(0)), nullptr);
    {
      CudaStreamScope inner(Device::cuda(1), stream_b);
      EXPECT_EQ(current_cuda_stream(Device::cuda(1)), stream_b);
      std::thread([] { EXPECT_EQ(current_cuda_stream(Device::cuda(1)), nullptr); }).join();
    }
    EXPECT_EQ(current_cuda_stream(Device::cuda(1)), stream_a);
  }
  EXPECT_EQ(current_cuda_stream(Device::cuda(1)), nullptr);
  EXPECT_EQ(current_cuda_stream(Device::cpu()), nullptr);
  EXPECT_GRADSYNC_ERROR(CudaStreamScope(Device::cpu(), stream_a), "CUDA stream", "cpu");
}

}  // namespace
}  // namespace gradsync
