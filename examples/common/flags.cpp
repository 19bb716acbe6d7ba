// The trainers' command line (flags.h).
#include "flags.h"

#include <algorithm>
#include <vector>

#include "gradsync/core/error.h"

namespace gradsync::examples {

Flags::Flags(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string name = argv[i];
    GRADSYNC_CHECK(name.rfind("--", 0) == 0, "unexpected argument '", name, "' (flags are --name [value])");
    if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
      values_[name] = argv[++i];
    } else {
      switches_.insert(name);
    }
  }
}

std::string Flags::text(const std::string& name, const std::string& fallback) {
  known_.insert(name);
  GRADSYNC_CHECK(!switches_.count(name), "flag ", name, " needs a value");
  const auto found = values_.find(name);
  return found == values_.end() ? fallback : found->second;
}

std::int64_t Flags::integer(const std::string& name, std::int64_t fallback) {
  const std::string value = text(name, "");
  if (value.empty()) return fallback;
  try {
    return std::stoll(value);
  } catch (const std::exception&) {
    detail::throw_error("flag ", name, " wants an integer, got '", value, "'");
  }
}

std::int64_t Flags::count(const std::string& name, std::int64_t fallback, std::int64_t minimum) {
  const std::int64_t value = integer(name, fallback);
  GRADSYNC_CHECK(value >= minimum, "flag ", name, " counts something: ",
                 minimum == 0 ? std::string("it cannot be negative") : "at least " + std::to_string(minimum), ", got ",
                 value);
  return value;
}

double Flags::number(const std::string& name, double fallback) {
  const std::string value = text(name, "");
  if (value.empty()) return fallback;
  try {
    return std::stod(value);
  } catch (const std::exception&) {
    detail::throw_error("flag ", name, " wants a number, got '", value, "'");
  }
}

bool Flags::given(const std::string& name) const { return values_.count(name) > 0 || switches_.count(name) > 0; }

bool Flags::flag(const std::string& name) {
  known_.insert(name);
  GRADSYNC_CHECK(!values_.count(name), "flag ", name, " takes no value");
  return switches_.count(name) > 0;
}

namespace {

// Edits (insert, delete, replace a character) from `a` to `b`: Levenshtein's distance.
std::size_t edits(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

}  // namespace

void Flags::finish() const {
  std::string unknown;
  const auto name_it = [&](const std::string& name) {
    // The nearest known flag, when it is near (a typo, a missing or extra letter or two).
    std::string nearest;
    std::size_t best = 3;
    for (const std::string& known : known_) {
      const std::size_t distance = edits(name, known);
      if (distance < best) {
        best = distance;
        nearest = known;
      }
    }
    unknown += " " + name + (nearest.empty() ? "" : " (did you mean " + nearest + "?)");
  };
  for (const auto& [name, value] : values_) {
    if (!known_.count(name)) name_it(name);
  }
  for (const std::string& name : switches_) {
    if (!known_.count(name)) name_it(name);
  }
  if (!unknown.empty()) {
    std::string list;
    for (const std::string& name : known_) list += " " + name;
    detail::throw_error("unknown flag(s):", unknown, "; known:", list);
  }
}

std::optional<std::pair<int, std::int64_t>> Flags::rank_and_number(const std::string& flag, const char* number) {
  const std::string value = text(flag, "");
  if (value.empty()) return std::nullopt;
  const std::size_t colon = value.find(':');
  try {
    GRADSYNC_CHECK(colon != std::string::npos, "");
    return std::pair<int, std::int64_t>(std::stoi(value.substr(0, colon)), std::stoll(value.substr(colon + 1)));
  } catch (const std::exception&) {
    detail::throw_error(flag, " wants RANK:", number, ", got '", value, "'");
  }
}


}  // namespace gradsync::examples
