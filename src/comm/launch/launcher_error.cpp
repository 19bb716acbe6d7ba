// A fatal error, told to the launcher (gradsync/comm/connect.h: report_fatal_error).
#include <chrono>
#include <string>
#include <string_view>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <system_error>

#include "core/environment.h"
#include "gradsync/comm/connect.h"

namespace gradsync::comm {

namespace {

// "program: message", unless the message names the program already (after gradsync's "rank R: "):
// an error raised as "digits_ddp: ..." is not printed as "digits_ddp: digits_ddp: ...".
std::string fatal_text(const char* program, const std::string& message) {
  std::string_view rest = message;
  if (rest.starts_with("rank ")) {
    const std::size_t colon = rest.find(": ");
    const std::string_view number = rest.substr(5, colon == std::string_view::npos ? 0 : colon - 5);
    if (!number.empty() && number.find_first_not_of("0123456789") == std::string_view::npos) rest.remove_prefix(colon + 2);
  }
  if (rest.starts_with(std::string(program) + ": ")) return message;
  return std::string(program) + ": " + message;
}

}  // namespace

int report_fatal_error(const char* program, const std::exception& error) {
  const std::string text = fatal_text(program, error.what());
  std::fprintf(stderr, "%s\n", text.c_str());
  const auto path = environment::launcher("TORCHELASTIC_ERROR_FILE");
  if (!path) return 1;
  // torchelastic's format (torch/distributed/elastic/multiprocessing/errors): the summary shows
  // extraInfo.py_callstack, else message; the timestamp orders the ranks' failures, and the
  // earliest is reported as the root cause.
  const auto seconds =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
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
