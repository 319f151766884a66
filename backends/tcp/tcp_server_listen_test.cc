// Where the tcp data plane listens: by default on the agent's advertise host
// (not on every interface), on any interface only when asked.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "backends/buffer_table.h"
#include "backends/tcp/flags.h"
#include "backends/tcp/socket_util.h"
#include "backends/tcp/tcp_backend.h"
#include "backends/tcp/wire.h"
#include "gtest/gtest.h"

namespace rdma_agent::tcp {
namespace {

// True when `host:port` accepts a connection and greets it with the hello.
bool Greets(const std::string& host, uint16_t port) {
  auto fd = DialTcp({host, port}, absl::Now() + absl::Seconds(5));
  if (!fd.ok()) return false;
  SetIoTimeout(fd->get(), /*receive=*/true, absl::Seconds(5));
  std::byte hello[kServerHelloBytes];
  return ReadFull(fd->get(), hello, sizeof(hello)).ok() &&
         DecodeServerHello(hello).ok();
}

TEST(TcpServerListenTest, DefaultsToTheAdvertiseHostOnPort7471) {
  BufferTable directory(1);
  BackendEnvironment env;
  env.directory = &directory;
  // A loopback address of its own: reachable here, and distinct from
  // 127.0.0.1, where a wildcard listener would also answer.
  env.advertise_host = "127.0.0.5";
  // The factory the daemon uses, with the flags' defaults.
  auto backend = MakeTcpBackendFactoryFromFlags()(env);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto* tcp = static_cast<TcpBackend*>(backend->get());
  EXPECT_EQ(tcp->port(), TcpOptions::kDefaultPort);
  EXPECT_EQ(tcp->transport_info().attributes().at("listen"), "127.0.0.5:7471");
  EXPECT_TRUE(Greets("127.0.0.5", TcpOptions::kDefaultPort));
  EXPECT_FALSE(Greets("127.0.0.1", TcpOptions::kDefaultPort))
      << "the data plane listens on more than the advertise host";
}

TEST(TcpServerListenTest, AnAdvertiseHostNotOfThisHostSaysWhatToSet) {
  BufferTable directory(1);
  BackendEnvironment env;
  env.directory = &directory;
  env.advertise_host = "192.0.2.1";  // TEST-NET-1: never this host's (NAT)
  auto backend = TcpBackend::Create(TcpOptions(), env);
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(backend.status().message(), "--tcp_listen"))
      << backend.status();
}

TEST(TcpServerListenTest, EveryInterfaceWhenAskedExplicitly) {
  BufferTable directory(1);
  BackendEnvironment env;
  env.directory = &directory;
  env.advertise_host = "127.0.0.6";
  TcpOptions options;
  options.listen = "0.0.0.0:0";
  auto backend = TcpBackend::Create(options, env);
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_TRUE(Greets("127.0.0.1", (*backend)->port()));
  EXPECT_TRUE(Greets("127.0.0.6", (*backend)->port()));
  EXPECT_EQ((*backend)->advertise_host(), "127.0.0.6");
}

}  // namespace
}  // namespace rdma_agent::tcp
