#ifndef RDMA_AGENTD_BACKENDS_TCP_WIRE_H_
#define RDMA_AGENTD_BACKENDS_TCP_WIRE_H_

// The TCP data plane's framing. Every integer is little-endian.
//
// Connection = ServerHello (server -> client, sent at accept), then requests
//              and responses.
// Request  = RequestHeader (kRequestHeaderBytes) + token + payload (WRITE only)
// Response = ResponseHeader (kResponseHeaderBytes) + message + payload (READ
//            with status OK only)
//
// A server answers the requests of one connection in the order they arrived,
// so a client can pipeline any number of them on a connection.

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace rdma_agent::tcp {

inline constexpr uint32_t kRequestMagic = 0x52415443;      // "RATC"
inline constexpr uint32_t kResponseMagic = 0x52415452;     // "RATR"
inline constexpr uint32_t kServerHelloMagic = 0x52415448;  // "RATH"
inline constexpr size_t kServerHelloBytes = 16;
inline constexpr uint16_t kWireVersion = 1;
inline constexpr size_t kRequestHeaderBytes = 56;
inline constexpr size_t kResponseHeaderBytes = 32;
// Largest token a request may carry.
inline constexpr uint32_t kMaxTokenBytes = 256;
// Largest payload of one request: bounds what a server discards after
// refusing a WRITE and what one chunk may be. Longer ops are chunked.
inline constexpr uint64_t kMaxPayloadBytes = 64ull << 20;
// Payloads at least this long are sent with vmsplice/splice when zero-copy
// sending is on; shorter ones are cheaper batched into one sendmsg.
inline constexpr uint64_t kSpliceMinBytes = 64 << 10;
// Longest error message a response may carry.
inline constexpr uint32_t kMaxMessageBytes = 4096;

// What the requester does to the served buffer.
enum class RequestKind : uint16_t {
  kRead = 1,   // the requester reads: the response carries the payload
  kWrite = 2,  // the requester writes: the request carries the payload
  // A notification for the owner of the named buffer (offset ignored): the
  // payload is EncodeNotification's, the response carries no payload.
  kNotify = 3,
};

// Longest kNotify payload a server reads: the sender's agent id and up to
// 1 MiB of data (agents take at most 1 MiB, --max_notification_bytes).
inline constexpr uint64_t kMaxNotificationPayloadBytes = (1ull << 20) + 2 + 256;

// A kNotify payload: the sender's agent id (uint16 length, at most
// kMaxTokenBytes bytes) then the data.
std::string EncodeNotification(absl::string_view from_agent_id,
                               absl::string_view data);
struct DecodedNotification {
  absl::string_view from_agent_id;
  absl::string_view data;
};
// Views into `payload`. INVALID_ARGUMENT when the id does not fit.
absl::StatusOr<DecodedNotification> DecodeNotification(
    absl::string_view payload);

struct RequestHeader {
  RequestKind kind = RequestKind::kRead;
  uint64_t request_id = 0;
  uint64_t epoch = 0;
  uint64_t buffer_id = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint32_t token_bytes = 0;  // the token follows the header
};

struct ResponseHeader {
  uint64_t request_id = 0;
  uint32_t code = 0;           // absl::StatusCode (== gRPC code number)
  uint32_t message_bytes = 0;  // the message follows the header
  uint64_t payload_bytes = 0;  // then the payload (READ, OK only)
};

// The first bytes of every data connection, sent by the serving agent as
// soon as it accepts. A client sends nothing before it has read a valid
// hello, so an endpoint that is not an rdma-agentd (a forged remote context
// naming some other service) never receives a byte the caller chose.
// Layout: magic, version, 10 reserved zero bytes.
void EncodeServerHello(std::byte* out);
// Checks kServerHelloBytes bytes. INVALID_ARGUMENT when they are not an
// rdma-agentd hello of this wire version.
absl::Status DecodeServerHello(const std::byte* in);

// Serializes `header` into exactly kRequestHeaderBytes bytes at `out`.
void EncodeRequestHeader(const RequestHeader& header, std::byte* out);
// Parses kRequestHeaderBytes bytes. INVALID_ARGUMENT on a wrong magic,
// version, kind, a token longer than kMaxTokenBytes or a payload longer than
// kMaxPayloadBytes (kMaxNotificationPayloadBytes for kNotify).
absl::StatusOr<RequestHeader> DecodeRequestHeader(const std::byte* in);

// Serializes `header` into exactly kResponseHeaderBytes bytes at `out`.
void EncodeResponseHeader(const ResponseHeader& header, std::byte* out);
// Parses kResponseHeaderBytes bytes. INVALID_ARGUMENT on a wrong magic or
// version, an unknown code or oversized message or payload.
absl::StatusOr<ResponseHeader> DecodeResponseHeader(const std::byte* in);

}  // namespace rdma_agent::tcp

#endif  // RDMA_AGENTD_BACKENDS_TCP_WIRE_H_
