// The trainers' command line: --name value and --switch flags, each read once by name, and the
// rest refused by name (examples/common/, one idea a file: see trainer_support.h for the map).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>

namespace gradsync::examples {

// --name value and --switch flags. Reading a flag marks it known; finish() rejects the rest.
class Flags {
 public:
  Flags(int argc, char** argv);
  std::string text(const std::string& name, const std::string& fallback);
  std::int64_t integer(const std::string& name, std::int64_t fallback);
  // An integer that counts something: refused, naming the flag, below `minimum` (a negative
  // --epochs trained nothing and exited 0).
  std::int64_t count(const std::string& name, std::int64_t fallback, std::int64_t minimum = 1);
  double number(const std::string& name, double fallback);
  bool flag(const std::string& name);  // a switch without value
  bool given(const std::string& name) const;  // on the command line (not its fallback)
  // A flag of the form RANK:NUMBER (--delay-rank, --kill-rank); nullopt when it is not given.
  // `number` names the second part in the error.
  std::optional<std::pair<int, std::int64_t>> rank_and_number(const std::string& name, const char* number);
  // Throws naming unknown flags, each with the known flag nearest to it ("did you mean --epochs?").
  void finish() const;

 private:
  std::map<std::string, std::string> values_;
  std::set<std::string> switches_;
  std::set<std::string> known_;
};

}  // namespace gradsync::examples
