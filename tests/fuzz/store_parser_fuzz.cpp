// libFuzzer target: the rendezvous store's request parser (src/comm/store/protocol.h), the code
// that reads whatever a stranger sends to rank 0's port. Every input is parsed as a connection
// that has and has not presented the token; a complete request must lie within the buffer and
// the caps, and must encode back to the bytes it was parsed from.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "comm/store/protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace store = gradsync::comm::store;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  for (const bool authenticated : {false, true}) {
    const store::Parsed parsed = store::parse_request(input, authenticated);
    if (parsed.status != store::Parsed::complete) continue;
    const store::Request& request = parsed.request;
    if (parsed.consumed > size || request.key.size() > store::kMaxKeyBytes ||
        request.value.size() > store::kMaxValueBytes || (!authenticated && request.op != store::kHello) ||
        store::encode_request(request.op, request.key, request.value) != input.substr(0, parsed.consumed)) {
      std::abort();
    }
  }
  return 0;
}
