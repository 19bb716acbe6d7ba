// The timeline (core/timeline.h): off records nothing; on, a valid Chrome trace per rank with
// balanced spans, instants, thread names and escaped names.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <thread>

#include "gradsync/core/timeline.h"
#include "gradsync/optim/sgd.h"
#include "test_util.h"

namespace gradsync {
namespace {

TEST(Timeline, RecordsSpansInstantsAndThreadsAsAChromeTrace) {
  testing::TempDir folder;
  ASSERT_FALSE(timeline::enabled());
  timeline::instant("ready", "not recorded");  // off: nothing
  timeline::start((folder / "run.json").string(), 3);
  ASSERT_TRUE(timeline::enabled());
  EXPECT_EQ(timeline::path(), (folder / "run.rank3.json").string());
  {
    timeline::Span outer("step", "optimizer step");
    timeline::instant("ready", "ready \"quoted\"\n");
    timeline::Span inner("wire", [] { return std::string("allreduce #0"); }, 0);
  }
  std::thread worker([] {
    timeline::name_thread("communication 1 (test)");
    timeline::Span span("wire", "on another thread");
  });
  worker.join();
  ParameterRegistry registry;
  Parameter& w = registry.add("w", {2});
  registry.finalize();
  optim::SGD sgd(registry, optim::SGD::Options{.lr = 0.1});
  w.set_grad(Tensor::zeros({2}, DType::f32));
  registry.mark_ready(w);
  sgd.step();
  timeline::stop();
  EXPECT_FALSE(timeline::enabled());

  std::ifstream in(folder / "run.rank3.json");
  const nlohmann::json trace = nlohmann::json::parse(in);
  int begins = 0, ends = 0, instants = 0;
  bool process = false, thread = false, escaped = false, ready_w = false, step = false;
  for (const auto& e : trace["traceEvents"]) {
    EXPECT_EQ(e["pid"], 3);
    const std::string ph = e["ph"];
    begins += ph == "B";
    ends += ph == "E";
    instants += ph == "i";
    process |= ph == "M" && e["name"] == "process_name" && e["args"]["name"] == "rank 3";
    thread |= ph == "M" && e["name"] == "thread_name" && e["args"]["name"] == "communication 1 (test)";
    escaped |= ph == "i" && e["name"] == "ready \"quoted\"\n";
    ready_w |= ph == "i" && e["name"] == "ready w";
    step |= ph == "B" && e["cat"] == "step";
    EXPECT_NE(e.value("name", ""), "not recorded");
  }
  EXPECT_EQ(begins, ends);
  EXPECT_EQ(begins, 4);  // outer, inner, the other thread's span, the SGD step
  EXPECT_EQ(instants, 2);
  EXPECT_TRUE(process && thread && escaped && ready_w && step);
}

}  // namespace
}  // namespace gradsync

namespace gradsync {
namespace {

// A folder (GRADSYNC_TIMELINE=/tmp, say) means "inside it", not a file beside it.
TEST(Timeline, AFolderMeansInsideIt) {
  testing::TempDir folder;
  timeline::start(folder.path().string(), 2);
  EXPECT_EQ(timeline::path(), (folder / "timeline.rank2.json").string());
  timeline::stop();
  EXPECT_TRUE(std::filesystem::exists(folder / "timeline.rank2.json"));
  timeline::start((folder / "not_yet_made/").string(), 1);
  EXPECT_EQ(timeline::path(), (folder / "not_yet_made" / "timeline.rank1.json").string());
  timeline::stop();
}

}  // namespace
}  // namespace gradsync
