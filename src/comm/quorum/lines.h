// Internal: the coordinator's wire lines (coordinator.h): requests and answers are short text
// lines of "key=value" words, stored in the coordinator's TCP store under these keys. Shared by
// the coordinator (coordinator.cpp) and the groups' client (client.cpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace gradsync::comm::quorum_lines {

using Clock = std::chrono::steady_clock;
using Fields = std::map<std::string, std::string>;

inline Fields parse_fields(const std::string& line) {
  Fields fields;
  std::istringstream words(line);
  std::string word;
  while (words >> word) {
    const auto equals = word.find('=');
    if (equals != std::string::npos) fields[word.substr(0, equals)] = word.substr(equals + 1);
  }
  return fields;
}

inline std::int64_t field_int(const Fields& fields, const std::string& key, std::int64_t fallback = -1) {
  const auto found = fields.find(key);
  if (found == fields.end() || found->second.empty()) return fallback;
  try {
    return std::stoll(found->second);
  } catch (const std::exception&) {
    return fallback;
  }
}

inline std::string join_ints(const std::vector<int>& values) {
  std::string text;
  for (const int value : values) {
    if (!text.empty()) text += ',';
    text += std::to_string(value);
  }
  return text;
}

inline std::vector<int> split_ints(const std::string& text) {
  std::vector<int> values;
  std::istringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    if (!item.empty()) values.push_back(std::stoi(item));
  }
  return values;
}

// Errors travel in one word: spaces become '~' on the wire.
inline std::string encode_text(std::string text) {
  std::replace(text.begin(), text.end(), ' ', '~');
  return text;
}
inline std::string decode_text(std::string text) {
  std::replace(text.begin(), text.end(), '~', ' ');
  return text;
}

inline std::string request_key(int group) { return "ft/req/" + std::to_string(group); }
inline std::string answer_key(int group) { return "ft/ans/" + std::to_string(group); }
inline std::string heartbeat_key(int group) { return "ft/hb/" + std::to_string(group); }
// Rank R > 0 of a group beats here, with its leader's incarnation (liveness.h).
inline std::string rank_heartbeat_key(int group, int rank) {
  return heartbeat_key(group) + "/" + std::to_string(rank);
}
// The incarnations of a group that a newer one superseded: "newest=INC superseded=INC,INC".
inline std::string fence_key(int group) { return "ft/fence/" + std::to_string(group); }
// The quorum whose members the coordinator has lost while others still run its step:
// "quorum=ID lost=G,G" (one key, overwritten).
inline std::string broken_key() { return "ft/broken"; }

}  // namespace gradsync::comm::quorum_lines
