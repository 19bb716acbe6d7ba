// A fatal error, told to the launcher (gradsync/comm/connect.h: report_fatal_error).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <system_error>

#include "core/environment.h"
#include "gradsync/comm/connect.h"

namespace gradsync::comm {

int report_fatal_error(const char* program, const std::exception& error) {
  std::fprintf(stderr, "%s: %s\n", program, error.what());
  const auto path = environment::launcher("TORCHELASTIC_ERROR_FILE");
  if (!path) return 1;
  // torchelastic's format (torch/distributed/elastic/multiprocessing/errors): the summary shows
  // extraInfo.py_callstack, else message; the timestamp orders the ranks' failures, and the
  // earliest is reported as the root cause.
  const auto seconds =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  const std::string text = std::string(program) + ": " + error.what();
  const nlohmann::json data = {
      {"message",
       {{"message", text}, {"extraInfo", {{"py_callstack", text}, {"timestamp", std::to_string(seconds)}}}}}};
  // Written beside, then renamed into place: torchrun never reads half a file.
  const std::filesystem::path target(*path);
  const std::filesystem::path partial = target.string() + ".partial";
  {
    std::ofstream out(partial);
    out << data.dump() << "\n";
  }
  std::error_code ignored;
  std::filesystem::rename(partial, target, ignored);
  if (ignored) std::fprintf(stderr, "%s: could not write TORCHELASTIC_ERROR_FILE %s\n", program, path->c_str());
  return 1;
}

}  // namespace gradsync::comm
