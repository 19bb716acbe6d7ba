// Internal: a JSON value shown briefly in an error message. Hostile files nest arrays a
// hundred thousand deep or hold megabytes of text; printing them whole would be slow, long
// and, for deep nesting, a stack overflow (nlohmann's dump() recurses).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace gradsync::io {

// A scalar as JSON (a string cut at 80 characters); a list by its first 8 elements, nested
// ones as [...] or {...}; an object as "an object".
std::string brief(const nlohmann::json& value);

}  // namespace gradsync::io
