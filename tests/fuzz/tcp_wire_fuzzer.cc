// Fuzz target: the tcp data plane's fixed-size headers, as read off a socket
// from a peer (DecodeRequestHeader, DecodeResponseHeader, DecodeServerHello).
// Every input goes through all three decoders.
//
// Oracle: no crash, no read outside the header (each decoder gets a heap copy
// of exactly its size); a refusal is INVALID_ARGUMENT; an accepted header
// stays within the documented limits and encodes back to the same bytes
// (except reserved ones).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

#include "backends/tcp/wire.h"
#include "tests/fuzz/fuzz_check.h"

namespace rdma_agent::tcp {
namespace {

// A heap copy of the first `n` bytes of the input (zero padded), so that
// ASan sees any read past the header.
std::unique_ptr<std::byte[]> Header(const uint8_t* data, size_t size,
                                    size_t n) {
  auto out = std::make_unique<std::byte[]>(n);
  std::memset(out.get(), 0, n);
  std::memcpy(out.get(), data, size < n ? size : n);
  return out;
}

void FuzzRequest(const uint8_t* data, size_t size) {
  auto in = Header(data, size, kRequestHeaderBytes);
  auto header = DecodeRequestHeader(in.get());
  if (!header.ok()) {
    FUZZ_CHECK(header.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  FUZZ_CHECK(header->kind == RequestKind::kRead ||
             header->kind == RequestKind::kWrite ||
             header->kind == RequestKind::kNotify);
  FUZZ_CHECK(header->token_bytes <= kMaxTokenBytes);
  FUZZ_CHECK(header->length <= kMaxPayloadBytes);
  FUZZ_CHECK(header->kind != RequestKind::kNotify ||
             header->length <= kMaxNotificationPayloadBytes);
  std::byte out[kRequestHeaderBytes];
  EncodeRequestHeader(*header, out);
  // The last 4 bytes are reserved and not read.
  FUZZ_CHECK(std::memcmp(out, in.get(), kRequestHeaderBytes - 4) == 0);
}

// A notification payload decodes to views inside it, or INVALID_ARGUMENT;
// what decodes encodes back to the same bytes.
void FuzzNotification(const uint8_t* data, size_t size) {
  const absl::string_view payload(reinterpret_cast<const char*>(data), size);
  auto decoded = DecodeNotification(payload);
  if (!decoded.ok()) {
    FUZZ_CHECK(decoded.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  FUZZ_CHECK(decoded->from_agent_id.size() <= kMaxTokenBytes);
  FUZZ_CHECK(EncodeNotification(decoded->from_agent_id, decoded->data) ==
             payload);
}

void FuzzResponse(const uint8_t* data, size_t size) {
  auto in = Header(data, size, kResponseHeaderBytes);
  auto header = DecodeResponseHeader(in.get());
  if (!header.ok()) {
    FUZZ_CHECK(header.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  FUZZ_CHECK(header->code <=
             static_cast<uint32_t>(absl::StatusCode::kUnauthenticated));
  FUZZ_CHECK(header->message_bytes <= kMaxMessageBytes);
  FUZZ_CHECK(header->payload_bytes <= kMaxPayloadBytes);
  std::byte out[kResponseHeaderBytes];
  EncodeResponseHeader(*header, out);
  // Bytes 6 and 7 are reserved and not read.
  FUZZ_CHECK(std::memcmp(out, in.get(), 6) == 0);
  FUZZ_CHECK(std::memcmp(out + 8, in.get() + 8, kResponseHeaderBytes - 8) == 0);
}

void FuzzHello(const uint8_t* data, size_t size) {
  auto in = Header(data, size, kServerHelloBytes);
  const absl::Status status = DecodeServerHello(in.get());
  std::byte ours[kServerHelloBytes];
  EncodeServerHello(ours);
  // Exactly the magic and the version decide.
  const bool same_prefix = std::memcmp(ours, in.get(), 6) == 0;
  FUZZ_CHECK(status.ok() == same_prefix);
  if (!status.ok()) {
    FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace rdma_agent::tcp

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  rdma_agent::tcp::FuzzRequest(data, size);
  rdma_agent::tcp::FuzzResponse(data, size);
  rdma_agent::tcp::FuzzHello(data, size);
  rdma_agent::tcp::FuzzNotification(data, size);
  return 0;
}
