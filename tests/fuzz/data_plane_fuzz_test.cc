// Mutated TCP data-plane requests sent to a real TcpBackend's port: the
// server answers or closes, never crashes or hangs, never writes a READ-only
// buffer, and keeps serving well-formed requests afterwards.
#include <poll.h>
#include <sys/socket.h>

#include <cstring>
#include <memory>
#include <string>

#include "backends/buffer_table.h"
#include "backends/tcp/socket_util.h"
#include "backends/tcp/tcp_backend.h"
#include "backends/tcp/wire.h"
#include "common/shared_memory.h"
#include "gtest/gtest.h"
#include "tests/fuzz/fuzz_driver.h"

namespace rdma_agent {
namespace {

using ::rdma_agent::testing::Mutator;

constexpr uint64_t kSize = 4096;
constexpr uint64_t kEpoch = 77;
constexpr int kIterations = 1500;

std::string Request(tcp::RequestKind kind, uint64_t buffer_id,
                    const std::string& token, uint64_t offset,
                    uint64_t length) {
  tcp::RequestHeader header;
  header.kind = kind;
  header.request_id = 1;
  header.epoch = kEpoch;
  header.buffer_id = buffer_id;
  header.offset = offset;
  header.length = length;
  header.token_bytes = static_cast<uint32_t>(token.size());
  std::string out(tcp::kRequestHeaderBytes, '\0');
  tcp::EncodeRequestHeader(header, reinterpret_cast<std::byte*>(out.data()));
  out += token;
  if (kind == tcp::RequestKind::kWrite) out += std::string(length, 'W');
  return out;
}

// Sends `bytes` on a fresh connection, half-closes it and reads until the
// server closes (bounded). Returns false if the server never closed.
bool SendAndDrain(const HostPort& server, const std::string& bytes) {
  auto fd = tcp::DialTcp(server, absl::Now() + absl::Seconds(5));
  if (!fd.ok()) return false;
  (void)::send(fd->get(), bytes.data(), bytes.size(), MSG_NOSIGNAL);
  ::shutdown(fd->get(), SHUT_WR);
  char sink[65536];
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    pollfd p{fd->get(), POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd->get(), sink, sizeof(sink), 0);
    if (n <= 0) return true;  // closed (or reset) by the server
  }
  return false;
}

TEST(DataPlaneFuzzTest, MutatedRequestsAreRefusedOrServedSafely) {
  BufferTable directory(kEpoch);
  BackendEnvironment env;
  env.identity = {"agent-fuzz", kEpoch};
  env.directory = &directory;
  env.advertise_host = "127.0.0.1";
  tcp::TcpOptions options;
  options.listen = "127.0.0.1:0";
  auto backend = tcp::TcpBackend::Create(options, env);
  ASSERT_TRUE(backend.ok()) << backend.status();

  auto memory = SharedMemory::Allocate(kSize, "fuzz");
  ASSERT_TRUE(memory.ok());
  const std::string token(16, 'k');
  auto readonly = std::make_shared<Registration>(
      5, 0, v1::ACCESS_READ, "", token, std::move(*memory), true);
  for (uint64_t i = 0; i < kSize; ++i) {
    readonly->data()[i] = static_cast<std::byte>(i * 13);
  }
  v1::BackendEndpoint endpoint;
  auto state = (*backend)->Register(*readonly, &endpoint);
  ASSERT_TRUE(state.ok());
  readonly->AddBackend("tcp", std::move(*state));
  directory.Add(readonly);
  const std::string before(reinterpret_cast<const char*>(readonly->data()),
                           kSize);
  const HostPort server{endpoint.tcp().host(),
                        static_cast<uint16_t>(endpoint.tcp().port())};

  const std::string seeds[] = {
      Request(tcp::RequestKind::kRead, 5, token, 100, 200),
      Request(tcp::RequestKind::kWrite, 5, token, 0, 64),
      Request(tcp::RequestKind::kWrite, 5, token, 4000, 96),
  };
  Mutator mutator(7);
  for (int i = 0; i < kIterations; ++i) {
    const std::string& seed = seeds[mutator.Next() % 3];
    std::string input = mutator.Mutate(seed);
    // Sometimes several requests back to back on one connection.
    if (mutator.Next() % 4 == 0) input += mutator.Mutate(seed);
    ASSERT_TRUE(SendAndDrain(server, input))
        << "iteration " << i << ": the server did not close the connection";
  }
  EXPECT_EQ(std::memcmp(readonly->data(), before.data(), kSize), 0)
      << "a READ-only buffer was written";

  // Still serving: a well-formed READ gets the right bytes.
  auto fd = tcp::DialTcp(server, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(fd.ok());
  std::byte hello[tcp::kServerHelloBytes];  // the server speaks first
  ASSERT_TRUE(tcp::ReadFull(fd->get(), hello, sizeof(hello)).ok());
  ASSERT_TRUE(tcp::DecodeServerHello(hello).ok());
  const std::string request =
      Request(tcp::RequestKind::kRead, 5, token, 100, 200);
  ASSERT_EQ(::send(fd->get(), request.data(), request.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(request.size()));
  std::string response(tcp::kResponseHeaderBytes, '\0');
  ASSERT_EQ(::recv(fd->get(), response.data(), response.size(), MSG_WAITALL),
            static_cast<ssize_t>(response.size()));
  auto header = tcp::DecodeResponseHeader(
      reinterpret_cast<const std::byte*>(response.data()));
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->code, 0u);
  ASSERT_EQ(header->payload_bytes, 200u);
  std::string rest(header->message_bytes + 200, '\0');
  ASSERT_EQ(::recv(fd->get(), rest.data(), rest.size(), MSG_WAITALL),
            static_cast<ssize_t>(rest.size()));
  EXPECT_EQ(rest.substr(header->message_bytes), before.substr(100, 200));
}

}  // namespace
}  // namespace rdma_agent
