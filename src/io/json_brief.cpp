// A JSON value shown briefly in an error message (json_brief.h).
#include "json_brief.h"

namespace gradsync::io {

namespace {
std::string scalar(const nlohmann::json& value) {
  std::string text = value.dump();
  return text.size() > 80 ? text.substr(0, 77) + "..." : text;
}
}  // namespace

std::string brief(const nlohmann::json& value) {
  if (!value.is_array()) return value.is_structured() ? "an object" : scalar(value);
  std::string text = "[";
  std::size_t shown = 0;
  for (const nlohmann::json& element : value) {
    if (shown == 8) {
      text += ", ...";
      break;
    }
    text += (shown++ ? ", " : "") + (element.is_structured() ? std::string(element.is_array() ? "[...]" : "{...}")
                                                               : scalar(element));
  }
  return text + "]";
}

}  // namespace gradsync::io
