#include "backends/tcp/wire.h"

#include <cstring>

#include "backends/tcp/socket_util.h"
#include "gtest/gtest.h"

namespace rdma_agent::tcp {
namespace {

TEST(WireTest, RequestHeaderRoundTrips) {
  RequestHeader header;
  header.kind = RequestKind::kWrite;
  header.request_id = 0x0102030405060708;
  header.epoch = 0xfedcba9876543210;
  header.buffer_id = 42;
  header.offset = (1ull << 40) + 3;
  header.length = kMaxPayloadBytes;
  header.token_bytes = 32;
  std::byte bytes[kRequestHeaderBytes];
  EncodeRequestHeader(header, bytes);
  // Little-endian on the wire whatever the host.
  EXPECT_EQ(std::to_integer<int>(bytes[0]), 0x43);
  EXPECT_EQ(std::to_integer<int>(bytes[8]), 0x08);
  auto decoded = DecodeRequestHeader(bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->kind, RequestKind::kWrite);
  EXPECT_EQ(decoded->request_id, header.request_id);
  EXPECT_EQ(decoded->epoch, header.epoch);
  EXPECT_EQ(decoded->buffer_id, 42u);
  EXPECT_EQ(decoded->offset, header.offset);
  EXPECT_EQ(decoded->length, header.length);
  EXPECT_EQ(decoded->token_bytes, 32u);
}

TEST(WireTest, MalformedRequestsAreInvalidArgument) {
  RequestHeader header;
  header.length = 1;
  std::byte bytes[kRequestHeaderBytes];

  EncodeRequestHeader(header, bytes);
  bytes[0] = std::byte{0};  // magic
  EXPECT_EQ(DecodeRequestHeader(bytes).status().code(),
            absl::StatusCode::kInvalidArgument);

  EncodeRequestHeader(header, bytes);
  bytes[4] = std::byte{9};  // version
  EXPECT_EQ(DecodeRequestHeader(bytes).status().code(),
            absl::StatusCode::kInvalidArgument);

  EncodeRequestHeader(header, bytes);
  bytes[6] = std::byte{4};  // kind
  EXPECT_EQ(DecodeRequestHeader(bytes).status().code(),
            absl::StatusCode::kInvalidArgument);

  // A notification is bounded far below a data payload.
  RequestHeader notify = header;
  notify.kind = RequestKind::kNotify;
  notify.length = kMaxNotificationPayloadBytes;
  EncodeRequestHeader(notify, bytes);
  EXPECT_TRUE(DecodeRequestHeader(bytes).ok());
  notify.length = kMaxNotificationPayloadBytes + 1;
  EncodeRequestHeader(notify, bytes);
  EXPECT_EQ(DecodeRequestHeader(bytes).status().code(),
            absl::StatusCode::kInvalidArgument);

  header.length = kMaxPayloadBytes + 1;
  EncodeRequestHeader(header, bytes);
  EXPECT_EQ(DecodeRequestHeader(bytes).status().code(),
            absl::StatusCode::kInvalidArgument);

  header.length = 1;
  header.token_bytes = kMaxTokenBytes + 1;
  EncodeRequestHeader(header, bytes);
  EXPECT_EQ(DecodeRequestHeader(bytes).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, NotificationPayloadRoundTripsAndRejectsJunk) {
  const std::string data("data\0bytes", 10);
  const std::string payload = EncodeNotification("agent-1", data);
  auto decoded = DecodeNotification(payload);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->from_agent_id, "agent-1");
  EXPECT_EQ(decoded->data, data);
  // An empty id and empty data are fine.
  decoded = DecodeNotification(EncodeNotification("", ""));
  ASSERT_TRUE(decoded.ok());
  EXPECT_TRUE(decoded->from_agent_id.empty());
  EXPECT_TRUE(decoded->data.empty());
  // Truncated, and an id longer than the payload or than allowed.
  EXPECT_EQ(DecodeNotification("x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeNotification(std::string("\x09\x00"
                                           "abc",
                                           5))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  std::string huge = EncodeNotification(std::string(300, 'a'), "d");
  huge[0] = static_cast<char>(0x2c);  // 300: past kMaxTokenBytes
  huge[1] = static_cast<char>(0x01);
  EXPECT_EQ(DecodeNotification(huge).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, ResponseHeaderRoundTripsAndRejectsJunk) {
  ResponseHeader header;
  header.request_id = 77;
  header.code = static_cast<uint32_t>(absl::StatusCode::kPermissionDenied);
  header.message_bytes = 12;
  header.payload_bytes = 0;
  std::byte bytes[kResponseHeaderBytes];
  EncodeResponseHeader(header, bytes);
  auto decoded = DecodeResponseHeader(bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->request_id, 77u);
  EXPECT_EQ(decoded->code, header.code);
  EXPECT_EQ(decoded->message_bytes, 12u);

  header.code = 99;
  EncodeResponseHeader(header, bytes);
  EXPECT_EQ(DecodeResponseHeader(bytes).status().code(),
            absl::StatusCode::kInvalidArgument);
  header.code = 0;
  header.message_bytes = kMaxMessageBytes + 1;
  EncodeResponseHeader(header, bytes);
  EXPECT_EQ(DecodeResponseHeader(bytes).status().code(),
            absl::StatusCode::kInvalidArgument);
  header.message_bytes = 0;
  header.payload_bytes = kMaxPayloadBytes + 1;
  EncodeResponseHeader(header, bytes);
  EXPECT_EQ(DecodeResponseHeader(bytes).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SocketUtilTest, DialRefusedIsUnavailable) {
  uint16_t port = 0;
  auto listener = ListenTcp({"127.0.0.1", 0}, &port);
  ASSERT_TRUE(listener.ok()) << listener.status();
  listener->reset();  // nobody listens there any more
  auto fd = DialTcp({"127.0.0.1", port}, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace rdma_agent::tcp

namespace rdma_agent::tcp {
namespace {

TEST(WireTest, ServerHelloRoundTripsAndRejectsOtherServices) {
  std::byte hello[kServerHelloBytes];
  EncodeServerHello(hello);
  EXPECT_TRUE(DecodeServerHello(hello).ok());
  // What an HTTP or SMTP server says first is not a hello.
  const char banner[kServerHelloBytes + 1] = "220 smtp ready\r\n";
  EXPECT_TRUE(absl::IsInvalidArgument(
      DecodeServerHello(reinterpret_cast<const std::byte*>(banner))));
  std::byte wrong_version[kServerHelloBytes];
  EncodeServerHello(wrong_version);
  wrong_version[4] = std::byte{9};
  EXPECT_TRUE(absl::IsInvalidArgument(DecodeServerHello(wrong_version)));
}

}  // namespace
}  // namespace rdma_agent::tcp
