// The environment (src/core/environment.h): every GRADSYNC_* knob validated in one place, and
// docs/environment.md's table the same as the code's.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "core/environment.h"
#include "test_util.h"

namespace gradsync {
namespace {

using testing::ScopedVariable;

TEST(Environment, TheDocsTableIsTheCodesTable) {
  std::ifstream file(std::string(GRADSYNC_SOURCE_DIR) + "/docs/environment.md");
  ASSERT_TRUE(file.good()) << "docs/environment.md";
  std::stringstream text;
  text << file.rdbuf();
  for (const environment::Knob& knob : environment::knobs()) {
    const std::string row = std::string("| `") + knob.name + "` | " + knob.fallback + " | " + knob.meaning + " | " +
                            knob.reader + " |";
    EXPECT_NE(text.str().find(row), std::string::npos) << "docs/environment.md lacks the row\n" << row;
  }
}

TEST(Environment, MalformedKnobsAreErrorsNamingThem) {
  {
    ScopedVariable variable("GRADSYNC_DEBUG_COLLECTIVES", "yes");
    EXPECT_GRADSYNC_ERROR(environment::debug_collectives(), "GRADSYNC_DEBUG_COLLECTIVES", "'yes'");
  }
  {
    ScopedVariable variable("GRADSYNC_STAGING_POOL_MB", "4G");
    EXPECT_GRADSYNC_ERROR(environment::staging_pool_bytes(), "GRADSYNC_STAGING_POOL_MB", "'4G'");
  }
  {
    ScopedVariable variable("GRADSYNC_NUM_THREADS", "0");
    EXPECT_GRADSYNC_ERROR(environment::num_threads(), "GRADSYNC_NUM_THREADS", "'0'");
  }
  {
    ScopedVariable variable("GRADSYNC_CPU_ISA", "avx512");
    EXPECT_GRADSYNC_ERROR(environment::baseline_cpu_isa(), "GRADSYNC_CPU_ISA", "'avx512'");
  }
  {
    ScopedVariable variable("GRADSYNC_RENDEZVOUS_REPORT_MS", "");
    EXPECT_GRADSYNC_ERROR(environment::rendezvous_report_interval(), "GRADSYNC_RENDEZVOUS_REPORT_MS");
  }
  {
    ScopedVariable variable("WORLD_SIZE", "four");
    EXPECT_GRADSYNC_ERROR(environment::launcher_integer("WORLD_SIZE", 1), "WORLD_SIZE", "'four'");
  }
}

TEST(Environment, WellFormedKnobsAndDefaults) {
  {
    ScopedVariable variable("GRADSYNC_STAGING_POOL_MB", "16");
    EXPECT_EQ(environment::staging_pool_bytes(), std::size_t{16} << 20);
  }
  {
    ScopedVariable variable("GRADSYNC_VERIFY_COLLECTIVES", "0");
    EXPECT_FALSE(environment::verify_collectives());
  }
  {
    ScopedVariable variable("GRADSYNC_TIMELINE", "");  // empty text counts as unset
    EXPECT_FALSE(environment::timeline_path().has_value());
  }
  {
    ScopedVariable variable("LOCAL_WORLD_SIZE", "3");
    EXPECT_EQ(environment::local_world_size(), 3);
  }
  EXPECT_EQ(environment::rendezvous_report_interval(), std::chrono::milliseconds(10000));
}

}  // namespace
}  // namespace gradsync
