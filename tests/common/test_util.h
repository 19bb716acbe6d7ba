// Helpers shared by the test suites: fixture paths, temporary folders, seeded random and
// patterned data, and an assertion that an expression throws a gradsync::Error mentioning given
// words.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "gradsync/core/tensor.h"

namespace gradsync::testing {

// The fixtures folder: compiled in, or GRADSYNC_FIXTURE_DIR from the environment when the
// test binaries run elsewhere (the GPU bundle carries them to another machine).
inline std::filesystem::path fixture_path(const std::string& name) {
  const char* override_dir = std::getenv("GRADSYNC_FIXTURE_DIR");
  return std::filesystem::path(override_dir != nullptr ? override_dir : GRADSYNC_FIXTURE_DIR) / name;
}

// Sets an environment variable for a scope and restores what was there (gradsync reads its
// knobs when a communicator or a file is made, so a test sets them before).
class ScopedVariable {
 public:
  ScopedVariable(const char* name, const std::string& value) : name_(name) {
    if (const char* before = std::getenv(name)) previous_ = before;
    had_ = std::getenv(name) != nullptr;
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedVariable() {
    if (had_) {
      ::setenv(name_, previous_.c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedVariable(const ScopedVariable&) = delete;
  ScopedVariable& operator=(const ScopedVariable&) = delete;

 private:
  const char* name_;
  std::string previous_;
  bool had_ = false;
};

// A fresh folder under the system temp dir, removed with everything in it at scope exit.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string label = info ? std::string(info->test_suite_name()) + "." + info->name() : "gradsync";
    for (char& c : label) {
      if (c == '/') c = '_';
    }
    path_ = std::filesystem::temp_directory_path() /
            ("gradsync-test-" + label + "-" + std::to_string(std::random_device{}()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

// Seeded values in [-scale, scale], converted to `dtype`, as a CPU tensor.
inline Tensor random_tensor(std::int64_t numel, DType dtype, std::uint64_t seed, double scale = 4.0) {
  std::mt19937_64 generator(seed);
  std::uniform_real_distribution<double> distribution(-scale, scale);
  std::vector<double> values(static_cast<std::size_t>(numel));
  for (double& value : values) {
    value = distribution(generator);
    if (!is_floating(dtype)) value = std::round(value);
  }
  return Tensor::from_vector(values, {numel}).to(dtype);
}

// Every dtype, and sizes that catch vector-width and threading edges (0, 1, odd, large).
inline const std::vector<DType>& all_dtypes() {
  static const std::vector<DType> dtypes{DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64};
  return dtypes;
}

inline const std::vector<std::int64_t>& awkward_sizes() {
  static const std::vector<std::int64_t> sizes{0, 1, 7, 64, 1000, 100003};
  return sizes;
}

// n elements value(0), value(1), ... as `dtype` on `device`.
inline Tensor filled(std::int64_t n, DType dtype, const std::function<double(std::int64_t)>& value,
                     Device device = Device::cpu()) {
  std::vector<double> values(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) values[static_cast<std::size_t>(i)] = value(i);
  return Tensor::from_vector(values, {n}).to(dtype).to(device);
}

// Bytes of the whole pages inside a host tensor that are resident in memory now (mincore):
// what paged memory (Tensor::zeros_paged) costs, written pages counted, given-back ones not.
inline std::int64_t resident_bytes(const Tensor& tensor) {
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<std::uintptr_t>(tensor.data()) + page - 1) / page * page;
  const auto end = (reinterpret_cast<std::uintptr_t>(tensor.data()) + tensor.nbytes()) / page * page;
  if (begin >= end) return 0;
  std::vector<unsigned char> resident((end - begin) / page);
  EXPECT_EQ(mincore(reinterpret_cast<void*>(begin), end - begin, resident.data()), 0);
  std::int64_t pages = 0;
  for (const unsigned char flags : resident) pages += flags & 1;
  return pages * static_cast<std::int64_t>(page);
}

}  // namespace gradsync::testing

// EXPECT_GRADSYNC_ERROR(statement, "words", "more words"): the statement throws
// gradsync::Error and its message contains every given fragment.
#define EXPECT_GRADSYNC_ERROR(statement, ...)                                                   \
  do {                                                                                          \
    bool gradsync_threw_ = false;                                                               \
    try {                                                                                       \
      statement;                                                                                \
    } catch (const ::gradsync::Error& gradsync_error_) {                                        \
      gradsync_threw_ = true;                                                                   \
      const std::string gradsync_message_ = gradsync_error_.what();                             \
      for (const std::string& fragment : std::vector<std::string>{__VA_ARGS__}) {               \
        EXPECT_NE(gradsync_message_.find(fragment), std::string::npos)                          \
            << "message \"" << gradsync_message_ << "\" lacks \"" << fragment << "\"";         \
      }                                                                                         \
    }                                                                                           \
    EXPECT_TRUE(gradsync_threw_) << #statement " did not throw gradsync::Error";                \
  } while (0)
