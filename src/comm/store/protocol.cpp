// The rendezvous store's wire format (protocol.h). Standard library only: the fuzz target
// compiles this file on its own.
#include "protocol.h"

#include <cstring>

namespace gradsync::comm::store {

namespace {

std::uint32_t read_u32(const char* bytes) {
  const auto* b = reinterpret_cast<const unsigned char*>(bytes);
  return static_cast<std::uint32_t>(b[0]) | static_cast<std::uint32_t>(b[1]) << 8 |
         static_cast<std::uint32_t>(b[2]) << 16 | static_cast<std::uint32_t>(b[3]) << 24;
}

void write_u32(std::string& out, std::uint32_t value) {
  for (int shift = 0; shift < 32; shift += 8) out.push_back(static_cast<char>((value >> shift) & 0xFF));
}

Parsed malformed(std::string error) {
  Parsed parsed;
  parsed.status = Parsed::malformed;
  parsed.error = std::move(error);
  return parsed;
}

}  // namespace

Parsed parse_request(std::string_view buffer, bool authenticated) {
  if (buffer.empty()) return {};
  const char op = buffer[0];
  if (op != kHello && op != kSet && op != kGet && op != kDelete) {
    return malformed("unknown request type " + std::to_string(static_cast<unsigned char>(op)));
  }
  if (!authenticated && op != kHello) return malformed("a request before the job's token was presented");
  if (buffer.size() < kHeaderBytes) return {};
  const std::uint32_t key_length = read_u32(buffer.data() + 1);
  const std::uint32_t value_length = read_u32(buffer.data() + 5);
  // The header alone decides whether the request is acceptable, before any payload is kept.
  if (key_length == 0 || key_length > kMaxKeyBytes) {
    return malformed("a key of " + std::to_string(key_length) + " bytes (1 to " + std::to_string(kMaxKeyBytes) +
                     " allowed)");
  }
  if (value_length > kMaxValueBytes) {
    return malformed("a value of " + std::to_string(value_length) + " bytes (at most " + std::to_string(kMaxValueBytes) +
                     " allowed)");
  }
  if (op == kGet && value_length != 0) return malformed("a get carrying a value");
  if (op == kDelete && value_length != 0) return malformed("a delete carrying a value");
  if (op == kHello && kHeaderBytes + key_length + value_length > kMaxHelloBytes) {
    return malformed("a hello of " + std::to_string(kHeaderBytes + std::size_t{key_length} + value_length) +
                     " bytes (at most " + std::to_string(kMaxHelloBytes) + " allowed)");
  }
  const std::size_t total = kHeaderBytes + std::size_t{key_length} + value_length;
  if (buffer.size() < total) return {};
  Parsed parsed;
  parsed.status = Parsed::complete;
  parsed.consumed = total;
  parsed.request.op = op;
  parsed.request.key.assign(buffer.data() + kHeaderBytes, key_length);
  parsed.request.value.assign(buffer.data() + kHeaderBytes + key_length, value_length);
  if (op == kHello && parsed.request.key != kHelloKey) return malformed("not a gradsync store hello");
  return parsed;
}

std::string encode_request(char op, std::string_view key, std::string_view value) {
  std::string out;
  out.reserve(kHeaderBytes + key.size() + value.size());
  out.push_back(op);
  write_u32(out, static_cast<std::uint32_t>(key.size()));
  write_u32(out, static_cast<std::uint32_t>(value.size()));
  out.append(key);
  out.append(value);
  return out;
}

bool same_token(std::string_view a, std::string_view b) {
  // Every byte of the longer one is looked at whatever the contents; the difference accumulates.
  const std::size_t length = a.size() > b.size() ? a.size() : b.size();
  unsigned char difference = a.size() == b.size() ? 0 : 1;
  for (std::size_t i = 0; i < length; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    difference = static_cast<unsigned char>(difference | (x ^ y));
  }
  return difference == 0;
}

}  // namespace gradsync::comm::store
