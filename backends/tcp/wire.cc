#include "backends/tcp/wire.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace rdma_agent::tcp {
namespace {

// Explicit byte order, so the wire format does not depend on the host's.
template <typename T>
void Put(std::byte*& out, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) {
    *out++ = static_cast<std::byte>((static_cast<uint64_t>(value) >> (8 * i)) &
                                    0xff);
  }
}

template <typename T>
T Get(const std::byte*& in) {
  uint64_t value = 0;
  for (size_t i = 0; i < sizeof(T); ++i) {
    value |= static_cast<uint64_t>(std::to_integer<uint8_t>(*in++)) << (8 * i);
  }
  return static_cast<T>(value);
}

}  // namespace

void EncodeServerHello(std::byte* out) {
  std::byte* p = out;
  Put<uint32_t>(p, kServerHelloMagic);
  Put<uint16_t>(p, kWireVersion);
  Put<uint16_t>(p, 0);  // reserved
  Put<uint64_t>(p, 0);  // reserved
}

absl::Status DecodeServerHello(const std::byte* in) {
  const std::byte* p = in;
  const auto magic = Get<uint32_t>(p);
  const auto version = Get<uint16_t>(p);
  if (magic != kServerHelloMagic) {
    return absl::InvalidArgumentError("not an rdma-agentd data port");
  }
  if (version != kWireVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported tcp data-plane version ", version));
  }
  return absl::OkStatus();
}

void EncodeRequestHeader(const RequestHeader& header, std::byte* out) {
  std::byte* p = out;
  Put<uint32_t>(p, kRequestMagic);
  Put<uint16_t>(p, kWireVersion);
  Put<uint16_t>(p, static_cast<uint16_t>(header.kind));
  Put<uint64_t>(p, header.request_id);
  Put<uint64_t>(p, header.epoch);
  Put<uint64_t>(p, header.buffer_id);
  Put<uint64_t>(p, header.offset);
  Put<uint64_t>(p, header.length);
  Put<uint32_t>(p, header.token_bytes);
  Put<uint32_t>(p, 0);  // reserved
}

absl::StatusOr<RequestHeader> DecodeRequestHeader(const std::byte* in) {
  const std::byte* p = in;
  const auto magic = Get<uint32_t>(p);
  const auto version = Get<uint16_t>(p);
  const auto kind = Get<uint16_t>(p);
  RequestHeader header;
  header.request_id = Get<uint64_t>(p);
  header.epoch = Get<uint64_t>(p);
  header.buffer_id = Get<uint64_t>(p);
  header.offset = Get<uint64_t>(p);
  header.length = Get<uint64_t>(p);
  header.token_bytes = Get<uint32_t>(p);
  if (magic != kRequestMagic) {
    return absl::InvalidArgumentError("not a tcp data-plane request");
  }
  if (version != kWireVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported tcp data-plane version ", version));
  }
  if (kind != static_cast<uint16_t>(RequestKind::kRead) &&
      kind != static_cast<uint16_t>(RequestKind::kWrite) &&
      kind != static_cast<uint16_t>(RequestKind::kNotify)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown request kind ", kind));
  }
  header.kind = static_cast<RequestKind>(kind);
  if (header.token_bytes > kMaxTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("token of ", header.token_bytes, " bytes is too long"));
  }
  if (header.length > kMaxPayloadBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("request of ", header.length, " bytes exceeds the ",
                     kMaxPayloadBytes, "-byte limit"));
  }
  if (header.kind == RequestKind::kNotify &&
      header.length > kMaxNotificationPayloadBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("notification of ", header.length, " bytes exceeds the ",
                     kMaxNotificationPayloadBytes, "-byte limit"));
  }
  return header;
}

std::string EncodeNotification(absl::string_view from_agent_id,
                               absl::string_view data) {
  const size_t id_bytes =
      std::min<size_t>(from_agent_id.size(), kMaxTokenBytes);
  std::string payload;
  payload.reserve(2 + id_bytes + data.size());
  payload.push_back(static_cast<char>(id_bytes & 0xff));
  payload.push_back(static_cast<char>(id_bytes >> 8));
  payload.append(from_agent_id.data(), id_bytes);
  payload.append(data.data(), data.size());
  return payload;
}

absl::StatusOr<DecodedNotification> DecodeNotification(
    absl::string_view payload) {
  if (payload.size() < 2) {
    return absl::InvalidArgumentError("notification payload is truncated");
  }
  const size_t id_bytes =
      static_cast<uint8_t>(payload[0]) |
      (static_cast<size_t>(static_cast<uint8_t>(payload[1])) << 8);
  if (id_bytes > kMaxTokenBytes || 2 + id_bytes > payload.size()) {
    return absl::InvalidArgumentError(
        "notification payload names a sender id that does not fit");
  }
  DecodedNotification decoded;
  decoded.from_agent_id = payload.substr(2, id_bytes);
  decoded.data = payload.substr(2 + id_bytes);
  return decoded;
}

void EncodeResponseHeader(const ResponseHeader& header, std::byte* out) {
  std::byte* p = out;
  Put<uint32_t>(p, kResponseMagic);
  Put<uint16_t>(p, kWireVersion);
  Put<uint16_t>(p, 0);  // reserved
  Put<uint64_t>(p, header.request_id);
  Put<uint32_t>(p, header.code);
  Put<uint32_t>(p, header.message_bytes);
  Put<uint64_t>(p, header.payload_bytes);
}

absl::StatusOr<ResponseHeader> DecodeResponseHeader(const std::byte* in) {
  const std::byte* p = in;
  const auto magic = Get<uint32_t>(p);
  const auto version = Get<uint16_t>(p);
  Get<uint16_t>(p);
  ResponseHeader header;
  header.request_id = Get<uint64_t>(p);
  header.code = Get<uint32_t>(p);
  header.message_bytes = Get<uint32_t>(p);
  header.payload_bytes = Get<uint64_t>(p);
  if (magic != kResponseMagic) {
    return absl::InvalidArgumentError("not a tcp data-plane response");
  }
  if (version != kWireVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported tcp data-plane version ", version));
  }
  if (header.code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown status code ", header.code));
  }
  if (header.message_bytes > kMaxMessageBytes ||
      header.payload_bytes > kMaxPayloadBytes) {
    return absl::InvalidArgumentError("oversized response");
  }
  return header;
}

}  // namespace rdma_agent::tcp
