#include "backends/tcp/tcp_backend.h"

#include <sys/prctl.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "backends/buffer_table.h"
#include "backends/tcp/pool_probe.h"
#include "backends/tcp/socket_util.h"
#include "backends/tcp/test_agent.h"
#include "backends/tcp/wire.h"
#include "backends/testing/harness.h"
#include "common/shared_memory.h"
#include "common/stop_token.h"
#include "gtest/gtest.h"
#include "tests/testing/pattern.h"

namespace rdma_agent::tcp {
namespace {

using ::absl::StatusCode;

using ::rdma_agent::tcp::testing::PoolProbe;
using ::rdma_agent::testing::Apply;
using ::rdma_agent::testing::FindMismatch;
using ::rdma_agent::testing::FirstDifference;
using ::rdma_agent::testing::In;
using ::rdma_agent::testing::MakeOp;
using ::rdma_agent::testing::Snapshot;
using ::rdma_agent::testing::TestAgent;
using ::rdma_agent::testing::TestBuffer;

std::unique_ptr<TestAgent> Agent(uint64_t epoch, uint16_t port = 0,
                                 DataClientOptions client = {}) {
  return TcpTestAgent(epoch, port, client);
}

TcpBackend& Tcp(TestAgent& agent) { return agent.backend<TcpBackend>(); }

// Checks that `buffer` holds exactly `image`, every byte.
void ExpectBytes(const TestBuffer& buffer, const std::vector<uint8_t>& image,
                 absl::string_view what) {
  EXPECT_EQ(FirstDifference(buffer, image), std::nullopt) << what;
}

tcp::DataClientOptions ClientOptions(bool zero_copy_send) {
  DataClientOptions options;
  options.zero_copy_send = zero_copy_send;
  return options;
}

// Every case runs with payloads sent by send() and by vmsplice/splice.
class TcpBackendTest : public ::testing::TestWithParam<bool> {
 protected:
  TcpBackendTest()
      : a_(Agent(/*epoch=*/11, 0, ClientOptions(GetParam()))),
        b_(Agent(/*epoch=*/22, 0, ClientOptions(GetParam()))) {}
  std::unique_ptr<TestAgent> a_;
  std::unique_ptr<TestAgent> b_;
};

INSTANTIATE_TEST_SUITE_P(SendPaths, TcpBackendTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Splice" : "Send";
                         });

TEST_P(TcpBackendTest, AdvertisesHostAndBoundPort) {
  EXPECT_EQ(Tcp(*a_).name(), "tcp");
  EXPECT_EQ(Tcp(*a_).transport_level(), v1::TRANSPORT_LEVEL_TCP);
  EXPECT_NE(Tcp(*a_).port(), 0);
  auto buffer = a_->Register(64, v1::ACCESS_READ_WRITE, 1);
  const v1::BackendEndpoint* endpoint = FindEndpoint(*buffer.context, "tcp");
  ASSERT_NE(endpoint, nullptr);
  ASSERT_TRUE(endpoint->has_tcp());
  EXPECT_EQ(endpoint->tcp().host(), "127.0.0.1");
  EXPECT_EQ(endpoint->tcp().port(), Tcp(*a_).port());
  EXPECT_TRUE(Tcp(*b_).CanReach(*buffer.context));
  v1::RemoteBuffer memory_only;
  memory_only.add_endpoints()->set_backend("memory");
  EXPECT_FALSE(Tcp(*b_).CanReach(memory_only));
  EXPECT_EQ(Tcp(*a_).transport_info().addresses(0),
            absl::StrCat("127.0.0.1:", Tcp(*a_).port()));
  // Asked for port 0: GetInfo shows the port bound.
  EXPECT_NE(Tcp(*a_).port(), 0);
  EXPECT_EQ(Tcp(*a_).transport_info().attributes().at("listen"),
            absl::StrCat("127.0.0.1:", Tcp(*a_).port()));
}

TEST(TcpBackendCreateTest, NeverAdvertisesAWildcard) {
  BufferTable directory(1);
  BackendEnvironment env;
  env.directory = &directory;
  TcpOptions options;
  options.listen = "127.0.0.1:0";
  options.advertise_host = "0.0.0.0";
  EXPECT_EQ(TcpBackend::Create(options, env).status().code(),
            StatusCode::kInvalidArgument);
  // Override honoured; a listener bound to one address advertises it (the
  // agent's host would be a closed port); a wildcard listener advertises the
  // agent's host, else loopback.
  options.advertise_host = "10.9.8.7";
  env.advertise_host = "10.1.1.1";
  auto overridden = TcpBackend::Create(options, env);
  ASSERT_TRUE(overridden.ok()) << overridden.status();
  EXPECT_EQ((*overridden)->advertise_host(), "10.9.8.7");
  options.advertise_host = "";
  auto from_listen = TcpBackend::Create(options, env);
  ASSERT_TRUE(from_listen.ok());
  EXPECT_EQ((*from_listen)->advertise_host(), "127.0.0.1");
  env.advertise_host_explicit = true;  // an operator's choice wins (NAT)
  auto explicit_host = TcpBackend::Create(options, env);
  ASSERT_TRUE(explicit_host.ok());
  EXPECT_EQ((*explicit_host)->advertise_host(), "10.1.1.1");
  env.advertise_host_explicit = false;
  options.listen = "0.0.0.0:0";
  auto from_env = TcpBackend::Create(options, env);
  ASSERT_TRUE(from_env.ok());
  EXPECT_EQ((*from_env)->advertise_host(), "10.1.1.1");
  env.advertise_host = "";
  auto fallback = TcpBackend::Create(options, env);
  ASSERT_TRUE(fallback.ok());
  EXPECT_EQ((*fallback)->advertise_host(), "127.0.0.1");
  options.listen = "127.0.0.1:0";
  options.listen = "127.0.0.1";
  EXPECT_EQ(TcpBackend::Create(options, env).status().code(),
            StatusCode::kInvalidArgument);
  options.listen = "127.0.0.1:0";
  options.client.chunk_bytes = kMaxPayloadBytes + 1;
  EXPECT_EQ(TcpBackend::Create(options, env).status().code(),
            StatusCode::kInvalidArgument);
  options.client.chunk_bytes = 1 << 20;
  options.client.socket_buffer_bytes = -1;
  EXPECT_EQ(TcpBackend::Create(options, env).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(TcpSocketTest, SocketBufferSizeIsFixedOnlyWhenAsked) {
  auto read_sndbuf = [](int fd) {
    int bytes = 0;
    socklen_t len = sizeof(bytes);
    EXPECT_EQ(getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, &len), 0);
    return bytes;
  };
  UniqueFd fixed(socket(AF_INET, SOCK_STREAM, 0));
  ConfigureDataSocket(fixed.get(), 96 << 10);
  EXPECT_EQ(read_sndbuf(fixed.get()), 2 * (96 << 10))
      << "the kernel doubles it";
  UniqueFd autotuned(socket(AF_INET, SOCK_STREAM, 0));
  const int before = read_sndbuf(autotuned.get());
  ConfigureDataSocket(autotuned.get(), 0);
  EXPECT_EQ(read_sndbuf(autotuned.get()), before);
}

TEST_P(TcpBackendTest, PipelinesManyOpsInOneSubmit) {
  auto local = a_->Register(1 << 20, v1::ACCESS_READ_WRITE, 5);
  auto remote = b_->Register(1 << 20, v1::ACCESS_READ_WRITE, 6);
  auto local_image = Snapshot(local);
  auto remote_image = Snapshot(remote);
  std::vector<Op> ops;
  for (size_t i = 0; i < 300; ++i) {
    // Disjoint ranges, so order between ops does not matter.
    const uint64_t length = 1 + (i * 97) % 3000;
    ops.push_back(MakeOp(
        i, i % 2 ? v1::OP_TYPE_READ_INTO_LOCAL : v1::OP_TYPE_WRITE_FROM_LOCAL,
        local, i * 3400 + 1, length, remote, i * 3400 + 2));
  }
  auto results = Tcp(*a_).Submit(ops, In(absl::Seconds(30)));
  ASSERT_EQ(results.size(), ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << i << ": " << results[i];
    Apply(ops[i], local_image, remote_image);
  }
  ExpectBytes(local, local_image, "local");
  ExpectBytes(remote, remote_image, "remote");
  // The connections went back to the pool for the next Submit.
  HostPort peer{"127.0.0.1", Tcp(*b_).port()};
  EXPECT_GE(PoolProbe(Tcp(*a_)).idle_connections(peer), 1u);
}

TEST_P(TcpBackendTest, LargeReadsAndWritesShareOneConnection) {
  // One connection, so READ payloads coming back and WRITE payloads going
  // out interleave on it: blocking the wrong way would deadlock until the
  // deadline.
  DataClientOptions options = ClientOptions(GetParam());
  options.connections_per_peer = 1;
  options.chunk_bytes = 3 << 20;
  auto a = Agent(31, 0, options);
  auto b = Agent(32, 0, options);
  constexpr uint64_t kOp = (9ull << 20) + 7;
  constexpr int kOps = 8;
  auto local = a->Register(kOps * kOp + 16, v1::ACCESS_READ_WRITE, 1);
  auto remote = b->Register(kOps * kOp + 16, v1::ACCESS_READ_WRITE, 2);
  auto local_image = Snapshot(local);
  auto remote_image = Snapshot(remote);
  std::vector<Op> ops;
  for (int i = 0; i < kOps; ++i) {
    ops.push_back(MakeOp(
        i, i % 2 ? v1::OP_TYPE_READ_INTO_LOCAL : v1::OP_TYPE_WRITE_FROM_LOCAL,
        local, i * kOp + 3, kOp, remote, i * kOp + 5));
  }
  const absl::Time start = absl::Now();
  auto results = Tcp(*a).Submit(ops, start + absl::Seconds(60));
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  for (int i = 0; i < kOps; ++i) {
    ASSERT_TRUE(results[i].ok()) << i << ": " << results[i];
    Apply(ops[i], local_image, remote_image);
  }
  ExpectBytes(local, local_image, "local");
  ExpectBytes(remote, remote_image, "remote");
}

// Ops of every size around the buffered readers' thresholds (BufferedSocket:
// 64 KiB buffers, payloads from 32 KiB straight to memory, small fills
// after large payloads), READ and WRITE interleaved on one connection: the
// framing holds and every byte lands where it belongs, on both sides.
TEST_P(TcpBackendTest, MixedSizesKeepTheFramingThroughTheBuffers) {
  DataClientOptions options = ClientOptions(GetParam());
  options.connections_per_peer = 1;
  auto a = Agent(41, 0, options);
  auto b = Agent(42, 0, options);
  constexpr uint64_t kSizes[] = {1,     100,   4096,  32767,  32768, 65535,
                                 65536, 65537, 70000, 200000, 7,     1024};
  constexpr uint64_t kSlot = 256 << 10;
  constexpr size_t kOps = 48;
  auto local = a->Register(kOps * kSlot, v1::ACCESS_READ_WRITE, 1);
  auto remote = b->Register(kOps * kSlot, v1::ACCESS_READ_WRITE, 2);
  auto local_image = Snapshot(local);
  auto remote_image = Snapshot(remote);
  std::vector<Op> ops;
  for (size_t i = 0; i < kOps; ++i) {
    // Kinds in runs of 1, 2 and 3, so every transition occurs.
    const bool read = (i % 6) == 0 || (i % 6) == 3 || (i % 6) == 4;
    ops.push_back(MakeOp(
        i, read ? v1::OP_TYPE_READ_INTO_LOCAL : v1::OP_TYPE_WRITE_FROM_LOCAL,
        local, i * kSlot + 3, kSizes[(i * 5) % std::size(kSizes)], remote,
        i * kSlot + 1));
  }
  auto results = Tcp(*a).Submit(ops, In(absl::Seconds(60)));
  for (size_t i = 0; i < kOps; ++i) {
    ASSERT_TRUE(results[i].ok()) << i << ": " << results[i];
    Apply(ops[i], local_image, remote_image);
  }
  ExpectBytes(local, local_image, "local");
  ExpectBytes(remote, remote_image, "remote");
  HostPort peer{"127.0.0.1", Tcp(*b).port()};
  EXPECT_EQ(PoolProbe(Tcp(*a)).idle_connections(peer), 1u)
      << "the one connection is healthy and pooled";
}

// The codes themselves are the contract suite's; here: refusals between good
// ops in one Submit keep the connection's framing (a refused WRITE's payload
// is consumed).
TEST_P(TcpBackendTest, RefusalsBetweenGoodOpsKeepTheFraming) {
  auto local = a_->Register(4096, v1::ACCESS_READ_WRITE, 1);
  auto remote = b_->Register(4096, v1::ACCESS_READ_WRITE, 2);
  auto read_only = b_->Register(4096, v1::ACCESS_READ, 3);
  auto write_only = b_->Register(4096, v1::ACCESS_WRITE, 4);
  auto local_image = Snapshot(local);
  auto remote_image = Snapshot(remote);
  auto read_only_image = Snapshot(read_only);
  auto write_only_image = Snapshot(write_only);

  auto with = [](const TestBuffer& buffer, auto mutate) {
    return buffer.WithContext(mutate);
  };
  auto bad_token =
      with(remote, [](v1::RemoteBuffer& c) { c.set_token("token-nope-x"); });
  auto stale = with(remote, [](v1::RemoteBuffer& c) {
    c.set_agent_epoch(c.agent_epoch() + 1);
  });
  auto unknown =
      with(remote, [](v1::RemoteBuffer& c) { c.set_buffer_id(999); });

  struct Case {
    const char* name;
    Op op;
    StatusCode code;
  };
  const auto W = v1::OP_TYPE_WRITE_FROM_LOCAL;
  const auto R = v1::OP_TYPE_READ_INTO_LOCAL;
  std::vector<Case> cases = {
      {"bad token write", MakeOp(0, W, local, 0, 100, bad_token, 0),
       StatusCode::kNotFound},
      {"bad token read", MakeOp(0, R, local, 0, 100, bad_token, 0),
       StatusCode::kNotFound},
      {"write into read-only", MakeOp(0, W, local, 0, 100, read_only, 0),
       StatusCode::kPermissionDenied},
      {"read from write-only", MakeOp(0, R, local, 0, 100, write_only, 0),
       StatusCode::kPermissionDenied},
      {"write past the end", MakeOp(0, W, local, 0, 100, remote, 4000),
       StatusCode::kOutOfRange},
      {"read past the end", MakeOp(0, R, local, 0, 100, remote, 4000),
       StatusCode::kOutOfRange},
      {"stale epoch", MakeOp(0, W, local, 0, 100, stale, 0),
       StatusCode::kFailedPrecondition},
      {"unknown buffer", MakeOp(0, R, local, 0, 100, unknown, 0),
       StatusCode::kNotFound},
  };
  // All in one Submit, between good ops: refusals must not disturb the
  // connection's framing (a refused WRITE's payload is consumed).
  std::vector<Op> ops;
  for (size_t i = 0; i < cases.size(); ++i) {
    ops.push_back(MakeOp(0, W, local, 200 + i, 10, remote, 300 + i * 10));
    ops.push_back(cases[i].op);
  }
  auto results = Tcp(*a_).Submit(ops, In(absl::Seconds(10)));
  ASSERT_EQ(results.size(), ops.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_TRUE(results[2 * i].ok()) << results[2 * i];
    Apply(ops[2 * i], local_image, remote_image);
    EXPECT_EQ(results[2 * i + 1].code(), cases[i].code)
        << cases[i].name << ": " << results[2 * i + 1];
    EXPECT_FALSE(results[2 * i + 1].message().empty());
  }
  ExpectBytes(local, local_image, "local");
  ExpectBytes(remote, remote_image, "remote");
  ExpectBytes(read_only, read_only_image, "read-only");
  ExpectBytes(write_only, write_only_image, "write-only");
}

// A fake peer: accepts one connection and lets the test script it.
class FakePeer {
 public:
  FakePeer() {
    auto listener = ListenTcp({"127.0.0.1", 0}, &port_);
    EXPECT_TRUE(listener.ok()) << listener.status();
    listener_ = std::move(*listener);
  }
  uint16_t port() const { return port_; }
  // Accepts a connection, greets it as an agent would and reads one request
  // header (and token, payload).
  absl::StatusOr<RequestHeader> AcceptAndReadRequest() {
    conn_.reset(accept(listener_.get(), nullptr, nullptr));
    if (!conn_) return absl::InternalError("accept failed");
    std::byte hello[kServerHelloBytes];
    EncodeServerHello(hello);  // as a DataServer does at accept
    (void)send(conn_.get(), hello, sizeof(hello), MSG_NOSIGNAL);
    return ReadRequest();
  }
  // Reads the next request header (and token) on the accepted connection.
  absl::StatusOr<RequestHeader> ReadRequest() {
    std::byte bytes[kRequestHeaderBytes];
    if (auto s = ReadFull(conn_.get(), bytes, sizeof(bytes)); !s.ok()) {
      return s;
    }
    auto header = DecodeRequestHeader(bytes);
    if (!header.ok()) return header.status();
    std::string token(header->token_bytes, '\0');
    if (auto s = ReadFull(conn_.get(), token.data(), token.size()); !s.ok()) {
      return s;
    }
    return header;
  }
  int conn() const { return conn_.get(); }
  void Close() { conn_.reset(); }
  // Answers READ `request` with its header and the first `payload_bytes` of
  // a payload of 0xee bytes (all of it: a whole answer).
  void AnswerRead(const RequestHeader& request, uint64_t payload_bytes) {
    ResponseHeader response;
    response.request_id = request.request_id;
    response.payload_bytes = request.length;
    std::byte bytes[kResponseHeaderBytes];
    EncodeResponseHeader(response, bytes);
    std::vector<std::byte> payload(payload_bytes, std::byte{0xee});
    iovec iov[2] = {{bytes, sizeof(bytes)}, {payload.data(), payload.size()}};
    (void)WriteFull(conn_.get(), iov, 2);
  }
  // The peer dies: no more dials, and its connection is reset.
  void Die() {
    listener_.reset();
    const linger reset{1, 0};
    setsockopt(conn_.get(), SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
    conn_.reset();
  }

 private:
  uint16_t port_ = 0;
  UniqueFd listener_;
  UniqueFd conn_;
};

std::shared_ptr<v1::RemoteBuffer> ContextAt(uint16_t port, uint64_t size) {
  auto context = std::make_shared<v1::RemoteBuffer>();
  context->set_agent_epoch(5);
  context->set_buffer_id(1);
  context->set_size_bytes(size);
  context->set_access(v1::ACCESS_READ_WRITE);
  context->set_token("t");
  v1::BackendEndpoint* endpoint = context->add_endpoints();
  endpoint->set_backend("tcp");
  endpoint->mutable_tcp()->set_host("127.0.0.1");
  endpoint->mutable_tcp()->set_port(port);
  return context;
}

TEST_P(TcpBackendTest, SilentPeerGivesDeadlineExceededAndLateBytesAreDropped) {
  FakePeer peer;
  constexpr uint64_t kSize = 1 << 20;
  auto local = a_->Register(kSize + 32, v1::ACCESS_READ_WRITE, 7);
  auto local_image = Snapshot(local);
  TestBuffer remote;
  remote.context = ContextAt(peer.port(), kSize);
  Op read = MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 16, kSize, remote, 0);

  absl::StatusOr<RequestHeader> request;
  absl::Notification submitted;
  std::thread fake([&] {
    request = peer.AcceptAndReadRequest();
    // Answer only once Submit has returned: a perfectly valid, late response.
    submitted.WaitForNotification();
    if (!request.ok()) return;
    ResponseHeader response;
    response.request_id = request->request_id;
    response.payload_bytes = request->length;
    std::byte bytes[kResponseHeaderBytes];
    EncodeResponseHeader(response, bytes);
    std::vector<std::byte> payload(request->length, std::byte{0xee});
    iovec iov[2] = {{bytes, sizeof(bytes)}, {payload.data(), payload.size()}};
    (void)WriteFull(peer.conn(), iov, 2);
    // Wait until the client's side is gone for sure: EOF or reset.
    char c;
    (void)recv(peer.conn(), &c, 1, 0);
  });

  const absl::Time start = absl::Now();
  const absl::Duration timeout = absl::Milliseconds(400);
  auto results = Tcp(*a_).Submit({read}, start + timeout);
  const absl::Duration took = absl::Now() - start;
  submitted.Notify();
  fake.join();
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_EQ(results[0].code(), StatusCode::kDeadlineExceeded) << results[0];
  EXPECT_GE(took, timeout);
  EXPECT_LT(took, timeout + absl::Seconds(2));
  // The late response reached nothing.
  ExpectBytes(local, local_image, "local after a late response");
  EXPECT_EQ(local.registration->bytes_moved(), 0u);
}

TEST_P(TcpBackendTest, PeerClosingMidResponseIsUnavailableAtOnce) {
  FakePeer peer;
  constexpr uint64_t kSize = 1 << 20;
  auto local = a_->Register(kSize + 32, v1::ACCESS_READ_WRITE, 8);
  auto local_image = Snapshot(local);
  TestBuffer remote;
  remote.context = ContextAt(peer.port(), kSize);
  Op read = MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 16, kSize, remote, 0);

  std::thread fake([&] {
    auto request = peer.AcceptAndReadRequest();
    if (!request.ok()) return;
    // Half a response, then the peer "dies".
    ResponseHeader response;
    response.request_id = request->request_id;
    response.payload_bytes = request->length;
    std::byte bytes[kResponseHeaderBytes];
    EncodeResponseHeader(response, bytes);
    std::vector<std::byte> half(request->length / 2, std::byte{0xab});
    iovec iov[2] = {{bytes, sizeof(bytes)}, {half.data(), half.size()}};
    (void)WriteFull(peer.conn(), iov, 2);
    peer.Close();
  });
  const absl::Time start = absl::Now();
  auto results = Tcp(*a_).Submit({read}, start + absl::Seconds(30));
  const absl::Duration took = absl::Now() - start;
  fake.join();
  EXPECT_EQ(results[0].code(), StatusCode::kUnavailable) << results[0];
  EXPECT_LT(took, absl::Seconds(5));
  // Inside the op's range some bytes may have landed; none outside it.
  EXPECT_EQ(FindMismatch(local.span().subspan(0, 16), local.seed),
            std::nullopt);
  EXPECT_EQ(
      FindMismatch(local.span().subspan(16 + kSize), local.seed, 16 + kSize),
      std::nullopt);
}

TEST_P(TcpBackendTest, RefusedDialIsUnavailable) {
  FakePeer gone;
  const uint16_t port = gone.port();
  { FakePeer moved = std::move(gone); }  // closes the listener
  auto local = a_->Register(64, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote;
  remote.context = ContextAt(port, 64);
  auto results = Tcp(*a_).Submit(
      {MakeOp(0, v1::OP_TYPE_WRITE_FROM_LOCAL, local, 0, 64, remote, 0)},
      In(absl::Seconds(10)));
  EXPECT_EQ(results[0].code(), StatusCode::kUnavailable) << results[0];
}

TEST(TcpBackendShutdownTest, ServerGoingAwayMidTransferIsUnavailableAtOnce) {
  DataClientOptions options;
  options.chunk_bytes = 1 << 20;  // many requests: the transfer is cut mid-way
  auto a = Agent(41, 0, options);
  auto b = Agent(42, 0, options);
  constexpr uint64_t kSize = 32ull << 20;
  constexpr uint64_t kGuard = 4096;
  auto local = a->Register(kSize + 2 * kGuard, v1::ACCESS_READ_WRITE, 1);
  auto remote = b->Register(kSize, v1::ACCESS_READ_WRITE, 2);
  auto local_image = Snapshot(local);
  std::vector<Op> ops;
  for (int i = 0; i < 64; ++i) {  // 2 GiB of reads in all
    ops.push_back(MakeOp(i, v1::OP_TYPE_READ_INTO_LOCAL, local, kGuard, kSize,
                         remote, 0));
  }
  std::vector<absl::Status> results;
  absl::Notification done;
  std::thread submit([&] {
    results = Tcp(*a).Submit(ops, In(absl::Seconds(60)));
    done.Notify();
  });
  // Bounded wait until bytes flow, then the serving side goes away.
  for (int i = 0; i < 10000 && remote.registration->bytes_served() == 0 &&
                  !done.HasBeenNotified();
       ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_GT(remote.registration->bytes_served(), 0u);
  const absl::Time gone = absl::Now();
  b->DestroyBackend();  // cuts its connections, waits for its threads
  submit.join();
  EXPECT_LT(absl::Now() - gone, absl::Seconds(5));
  int unavailable = 0;
  for (const absl::Status& status : results) {
    if (status.code() == StatusCode::kUnavailable) {
      ++unavailable;
    } else {
      EXPECT_TRUE(status.ok()) << status;
    }
  }
  EXPECT_GT(unavailable, 0);
  // Only the ops' range may have changed.
  EXPECT_EQ(FindMismatch(local.span().subspan(0, kGuard), local.seed),
            std::nullopt);
  EXPECT_EQ(FindMismatch(local.span().subspan(kGuard + kSize), local.seed,
                         kGuard + kSize),
            std::nullopt);
}

TEST(TcpBackendRestartTest, ReconnectsToARestartedPeer) {
  auto a = Agent(1);
  auto b = Agent(2);
  const uint16_t port = Tcp(*b).port();
  auto local = a->Register(1 << 16, v1::ACCESS_READ_WRITE, 1);
  auto local_image = Snapshot(local);
  auto old_remote = b->Register(1 << 16, v1::ACCESS_READ_WRITE, 2);
  Op op =
      MakeOp(0, v1::OP_TYPE_WRITE_FROM_LOCAL, local, 1, 1000, old_remote, 2);
  ASSERT_TRUE(Tcp(*a).Submit({op}, In(absl::Seconds(10)))[0].ok());
  HostPort peer{"127.0.0.1", port};
  ASSERT_GE(PoolProbe(Tcp(*a)).idle_connections(peer), 1u);

  // The peer dies (its pooled connections with it) and comes back on the same
  // port with a new epoch.
  b.reset();
  auto restarted = Agent(3, port);
  ASSERT_NE(restarted, nullptr);
  auto results = Tcp(*a).Submit({op}, In(absl::Seconds(10)));
  EXPECT_EQ(results[0].code(), StatusCode::kFailedPrecondition) << results[0];

  auto new_remote = restarted->Register(1 << 16, v1::ACCESS_READ_WRITE, 9);
  auto new_remote_image = Snapshot(new_remote);
  Op fresh =
      MakeOp(0, v1::OP_TYPE_WRITE_FROM_LOCAL, local, 1, 1000, new_remote, 2);
  results = Tcp(*a).Submit({fresh}, In(absl::Seconds(10)));
  ASSERT_TRUE(results[0].ok()) << results[0];
  Apply(fresh, local_image, new_remote_image);
  ExpectBytes(new_remote, new_remote_image, "new remote");
}

// --- The asynchronous entry: Post returns at once, done comes later. ---

// What one Post delivered to its done: the statuses, and how often it ran.
struct Posted {
  std::atomic<int> calls{0};
  std::vector<absl::Status> statuses;
  absl::Notification done;
  absl::Time at;
  // The name of the thread that called done.
  std::string thread;
};

void PostTo(Backend& backend, absl::Span<const Op> ops, const StopToken& stop,
            Posted& posted) {
  backend.Post(ops, stop, [&posted](std::vector<absl::Status> statuses) {
    if (posted.calls.fetch_add(1) == 0) {
      posted.statuses = std::move(statuses);
      posted.at = absl::Now();
      char name[16] = {};
      prctl(PR_GET_NAME, name);
      posted.thread = name;
      posted.done.Notify();
    }
  });
}

// How long tests hold the serving side: below its handshake timeout (2 s),
// which would close the held connections.
constexpr absl::Duration kHeld = absl::Milliseconds(1500);

// Threads of this process now.
int ThreadCount() {
  int threads = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator("/proc/self/task")) {
    (void)entry;
    ++threads;
  }
  return threads;
}

// Threads of this process named `name` (the tcp client names its own).
int ThreadsNamed(absl::string_view name) {
  int threads = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(entry.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) ++threads;
  }
  return threads;
}

DataClientOptions Workers(int threads) {
  DataClientOptions options;
  options.threads = threads;
  options.connections_per_peer = 1;
  return options;
}

TEST(TcpBackendPostTest, PostReturnsWhileThePeerIsHeldAndDoneFollowsItsAnswer) {
  auto a = Agent(/*epoch=*/31);
  auto b = Agent(/*epoch=*/32);
  auto local = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  auto remote = b->Register(4096, v1::ACCESS_READ_WRITE, 2);
  auto local_image = Snapshot(local);
  auto remote_image = Snapshot(remote);
  const Op read =
      MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 100, 1000, remote, 7);

  // Bounded, so that a Post that waits for the answer fails instead of
  // hanging (and below the serving side's 2 s handshake timeout).
  b->gate().Close(In(kHeld));
  Posted posted;
  const absl::Time start = absl::Now();
  PostTo(Tcp(*a), {&read, 1}, In(absl::Seconds(20)), posted);
  EXPECT_LT(absl::Now() - start, kHeld / 2) << "Post waited for the peer";
  ASSERT_TRUE(b->gate().AwaitArrivals(1, absl::Seconds(10)));
  EXPECT_FALSE(posted.done.HasBeenNotified())
      << "done before the peer answered";
  ExpectBytes(local, local_image, "local while the peer is held");

  b->gate().Open();
  ASSERT_TRUE(posted.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_EQ(posted.statuses.size(), 1u);
  EXPECT_TRUE(posted.statuses[0].ok()) << posted.statuses[0];
  Apply(read, local_image, remote_image);
  ExpectBytes(local, local_image, "local after the answer");
  EXPECT_EQ(local.registration->bytes_moved(), 1000u);
  EXPECT_EQ(posted.calls.load(), 1);
}

TEST(TcpBackendPostTest, RunQueuedBehindBusyWorkersEndsAtItsDeadline) {
  auto a = Agent(/*epoch=*/41, 0, Workers(2));
  auto b = Agent(/*epoch=*/42);
  auto local = a->Register(3 * 4096, v1::ACCESS_READ_WRITE, 1);
  auto remote = b->Register(3 * 4096, v1::ACCESS_READ_WRITE, 2);
  auto local_image = Snapshot(local);
  auto remote_image = Snapshot(remote);
  std::vector<Op> held;
  for (int i = 0; i < 2; ++i) {
    held.push_back(MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, i * 4096, 4096,
                          remote, i * 4096));
  }
  const Op late =
      MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 2 * 4096, 4096, remote, 0);

  // Both workers carry a held run; the third run can only queue.
  b->gate().Close(In(kHeld));
  Posted first, second, queued;
  PostTo(Tcp(*a), {&held[0], 1}, In(absl::Seconds(30)), first);
  PostTo(Tcp(*a), {&held[1], 1}, In(absl::Seconds(30)), second);
  ASSERT_TRUE(b->gate().AwaitArrivals(2, absl::Seconds(10)));
  const absl::Duration timeout = absl::Milliseconds(300);
  const absl::Time deadline = absl::Now() + timeout;
  PostTo(Tcp(*a), {&late, 1}, deadline, queued);

  ASSERT_TRUE(queued.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_GE(queued.at, deadline);
  EXPECT_LT(queued.at - deadline, absl::Milliseconds(250))
      << "the queued run ended late";
  EXPECT_EQ(queued.statuses[0].code(), StatusCode::kDeadlineExceeded)
      << queued.statuses[0];
  EXPECT_FALSE(first.done.HasBeenNotified());
  EXPECT_FALSE(second.done.HasBeenNotified());

  b->gate().Open();
  for (Posted* posted : {&first, &second}) {
    ASSERT_TRUE(posted->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    EXPECT_TRUE(posted->statuses[0].ok()) << posted->statuses[0];
  }
  for (const Op& op : held) Apply(op, local_image, remote_image);
  // The run that ended at its deadline never touched its range.
  ExpectBytes(local, local_image, "local");
  EXPECT_EQ(queued.calls.load(), 1);
}

TEST(TcpBackendPostTest, CancelledBeforePostEndsAtOnceWithTheReason) {
  auto a = Agent(/*epoch=*/51);
  auto b = Agent(/*epoch=*/52);
  auto local = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  auto remote = b->Register(4096, v1::ACCESS_READ_WRITE, 2);
  auto local_image = Snapshot(local);
  const Op read =
      MakeOp(3, v1::OP_TYPE_READ_INTO_LOCAL, local, 0, 512, remote, 0);
  Cancellation cancellation;
  cancellation.Cancel(absl::CancelledError("client went away"));
  Posted posted;
  PostTo(Tcp(*a), {&read, 1}, StopToken(In(absl::Seconds(20)), &cancellation),
         posted);
  ASSERT_TRUE(posted.done.WaitForNotificationWithTimeout(absl::Seconds(1)));
  EXPECT_EQ(posted.statuses[0].code(), StatusCode::kCancelled);
  EXPECT_NE(posted.statuses[0].message().find("op 3"), std::string::npos)
      << posted.statuses[0];
  EXPECT_NE(posted.statuses[0].message().find("client went away"),
            std::string::npos)
      << posted.statuses[0];
  ExpectBytes(local, local_image, "local");
  EXPECT_EQ(posted.calls.load(), 1);
}

TEST(TcpBackendPostTest, CancellingAQueuedRunEndsItWhileTheWorkersStayBusy) {
  auto a = Agent(/*epoch=*/61, 0, Workers(1));
  auto b = Agent(/*epoch=*/62);
  auto local = a->Register(2 * 4096, v1::ACCESS_READ_WRITE, 1);
  auto remote = b->Register(2 * 4096, v1::ACCESS_READ_WRITE, 2);
  auto local_image = Snapshot(local);
  auto remote_image = Snapshot(remote);
  const Op held =
      MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 0, 4096, remote, 0);
  const Op queued_op =
      MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 4096, 4096, remote, 4096);

  b->gate().Close(In(kHeld));
  Posted first, queued;
  PostTo(Tcp(*a), {&held, 1}, In(absl::Seconds(30)), first);
  ASSERT_TRUE(b->gate().AwaitArrivals(1, absl::Seconds(10)));
  Cancellation cancellation;
  PostTo(Tcp(*a), {&queued_op, 1},
         StopToken(In(absl::Seconds(30)), &cancellation), queued);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(queued.done.HasBeenNotified());
  const absl::Time cancelled_at = absl::Now();
  cancellation.Cancel(absl::CancelledError("transfer cancelled"));
  ASSERT_TRUE(queued.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_LT(queued.at - cancelled_at, absl::Milliseconds(200));
  EXPECT_EQ(queued.statuses[0].code(), StatusCode::kCancelled)
      << queued.statuses[0];
  EXPECT_FALSE(first.done.HasBeenNotified()) << "the held run ended too";

  b->gate().Open();
  ASSERT_TRUE(first.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(first.statuses[0].ok()) << first.statuses[0];
  Apply(held, local_image, remote_image);
  ExpectBytes(local, local_image, "local");
  EXPECT_EQ(queued.calls.load(), 1);
}

TEST(TcpBackendPostTest, AThousandSmallPostsFromOneThreadNeedNoMoreThreads) {
  constexpr int kPosts = 1000;
  constexpr uint64_t kLength = 40;
  auto a = Agent(/*epoch=*/71);
  auto b = Agent(/*epoch=*/72);
  // Every other 64-byte slot: the bytes between ops must stay as they were.
  auto local = a->Register(kPosts * 64, v1::ACCESS_READ_WRITE, 1);
  auto remote = b->Register(kPosts * 64, v1::ACCESS_READ_WRITE, 2);
  auto local_image = Snapshot(local);
  auto remote_image = Snapshot(remote);
  std::vector<Op> ops;
  ops.reserve(kPosts);
  for (int i = 0; i < kPosts; ++i) {
    const v1::OpType type =
        i % 2 == 0 ? v1::OP_TYPE_READ_INTO_LOCAL : v1::OP_TYPE_WRITE_FROM_LOCAL;
    ops.push_back(
        MakeOp(i, type, local, i * 64 + 3, kLength, remote, i * 64 + 11));
  }
  const int threads_before = ThreadCount();
  // Held, so that all of them are in flight at once.
  b->gate().Close(In(kHeld));
  std::vector<Posted> posted(kPosts);
  for (int i = 0; i < kPosts; ++i) {
    PostTo(Tcp(*a), {&ops[i], 1}, In(absl::Seconds(60)), posted[i]);
  }
  int done_early = 0;
  for (const Posted& p : posted) done_early += p.done.HasBeenNotified() ? 1 : 0;
  EXPECT_EQ(done_early, 0) << "posts ended before the peer answered";
  EXPECT_EQ(ThreadCount(), threads_before);
  // The clients' own (two agents here): each its workers and one
  // timekeeper, however many runs are in flight.
  EXPECT_EQ(ThreadsNamed("tcp-client"), 2 * DataClientOptions().threads);
  EXPECT_EQ(ThreadsNamed("tcp-timekeeper"), 2);
  b->gate().Open();
  for (int i = 0; i < kPosts; ++i) {
    ASSERT_TRUE(
        posted[i].done.WaitForNotificationWithTimeout(absl::Seconds(30)))
        << "post " << i;
    EXPECT_TRUE(posted[i].statuses[0].ok())
        << i << ": " << posted[i].statuses[0];
    EXPECT_EQ(posted[i].calls.load(), 1);
  }
  EXPECT_EQ(ThreadCount(), threads_before);
  for (const Op& op : ops) Apply(op, local_image, remote_image);
  ExpectBytes(local, local_image, "local");
  ExpectBytes(remote, remote_image, "remote");
}

TEST(TcpBackendPostTest, DestroyingTheBackendEndsThePostsInFlight) {
  auto a = Agent(/*epoch=*/75);
  auto b = Agent(/*epoch=*/76);
  auto local = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  auto remote = b->Register(4096, v1::ACCESS_READ_WRITE, 2);
  auto local_image = Snapshot(local);
  const Op read =
      MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 0, 2048, remote, 0);
  b->gate().Close(In(kHeld));
  Posted posted;
  PostTo(Tcp(*a), {&read, 1}, In(absl::Seconds(30)), posted);
  ASSERT_TRUE(b->gate().AwaitArrivals(1, absl::Seconds(10)));
  const absl::Time start = absl::Now();
  a->DestroyBackend();
  // The destructor returned after done, long before the peer answers.
  EXPECT_TRUE(posted.done.HasBeenNotified());
  EXPECT_LT(absl::Now() - start, kHeld / 2);
  ASSERT_TRUE(posted.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(posted.statuses[0].code(), StatusCode::kUnavailable)
      << posted.statuses[0];
  b->gate().Open();
  ASSERT_TRUE(b->gate().AwaitNoneHeld(absl::Seconds(5)));
  // The answer that came after found nothing to write into.
  absl::SleepFor(absl::Milliseconds(100));
  ExpectBytes(local, local_image, "local");
  EXPECT_EQ(posted.calls.load(), 1);
}

TEST(TcpBackendPostTest, DoneRunsOnceWhenCancellationRacesCompletion) {
  auto a = Agent(/*epoch=*/81);
  auto b = Agent(/*epoch=*/82);
  auto local = a->Register(4096, v1::ACCESS_READ_WRITE, 1);
  auto remote = b->Register(4096, v1::ACCESS_READ_WRITE, 2);
  const Op write =
      MakeOp(0, v1::OP_TYPE_WRITE_FROM_LOCAL, local, 0, 64, remote, 0);
  constexpr int kRounds = 200;
  std::vector<Posted> posted(kRounds);
  std::vector<std::unique_ptr<Cancellation>> cancellations;
  int cancelled = 0;
  for (int i = 0; i < kRounds; ++i) {
    cancellations.push_back(std::make_unique<Cancellation>());
    Cancellation& cancellation = *cancellations.back();
    // Cancelled from another thread at about the time the answer lands;
    // a varying head start moves the race across the run's life.
    std::thread canceller([&cancellation, i] {
      absl::SleepFor(absl::Microseconds((i % 20) * 10));
      cancellation.Cancel(absl::CancelledError("raced"));
    });
    PostTo(Tcp(*a), {&write, 1},
           StopToken(In(absl::Seconds(20)), &cancellation), posted[i]);
    canceller.join();
    ASSERT_TRUE(posted[i].done.WaitForNotificationWithTimeout(absl::Seconds(5)))
        << "round " << i;
    const absl::Status& status = posted[i].statuses[0];
    EXPECT_TRUE(status.ok() || status.code() == StatusCode::kCancelled)
        << status;
    cancelled += status.ok() ? 0 : 1;
  }
  // A late second call would show here.
  absl::SleepFor(absl::Milliseconds(100));
  for (int i = 0; i < kRounds; ++i) {
    EXPECT_EQ(posted[i].calls.load(), 1) << "round " << i;
  }
  std::printf("cancelled %d of %d\n", cancelled, kRounds);
}

// --- Small posted batches: sent by the posting thread, ended by a loop. ---

constexpr char kLoopThread[] = "tcp-client-loop";

// A pooled connection from `a` to `b`, so that the next small Post to b
// goes through a loop (the first to a peer is dialled by a worker).
void WarmPool(TestAgent& a, TestAgent& b) {
  auto local = a.Register(64, v1::ACCESS_READ_WRITE, 99);
  auto remote = b.Register(64, v1::ACCESS_READ_WRITE, 98);
  const Op op = MakeOp(0, v1::OP_TYPE_WRITE_FROM_LOCAL, local, 0, 8, remote, 0);
  ASSERT_TRUE(Tcp(a).Submit({op}, In(absl::Seconds(10)))[0].ok());
  ASSERT_GE(
      PoolProbe(Tcp(a)).idle_connections(HostPort{"127.0.0.1", Tcp(b).port()}),
      1u);
}

// Two agents whose pool already holds a connection from a to b (WarmPool),
// a buffer of `bytes` on each and their images.
struct WarmedPair {
  std::unique_ptr<TestAgent> a;
  std::unique_ptr<TestAgent> b;
  TestBuffer local;
  TestBuffer remote;
  std::vector<uint8_t> local_image;
  std::vector<uint8_t> remote_image;
};

// Agent a has epoch `epoch` and client `options`, agent b `epoch` + 1.
WarmedPair Warmed(uint64_t epoch, uint64_t bytes = 4096,
                  DataClientOptions options = {}) {
  WarmedPair pair;
  pair.a = Agent(epoch, 0, options);
  pair.b = Agent(epoch + 1);
  WarmPool(*pair.a, *pair.b);
  pair.local = pair.a->Register(bytes, v1::ACCESS_READ_WRITE, 1);
  pair.remote = pair.b->Register(bytes, v1::ACCESS_READ_WRITE, 2);
  pair.local_image = Snapshot(pair.local);
  pair.remote_image = Snapshot(pair.remote);
  return pair;
}

TEST(TcpBackendLoopTest, SmallPostedReadAndWriteEndOnTheClientLoop) {
  auto [a, b, local, remote, local_image, remote_image] = Warmed(/*epoch=*/111);
  const std::vector<Op> ops = {
      MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 100, 8, remote, 7),
      MakeOp(1, v1::OP_TYPE_WRITE_FROM_LOCAL, local, 1000, 8, remote, 2000),
      MakeOp(2, v1::OP_TYPE_READ_INTO_LOCAL, local, 3000, 1000, remote, 50)};
  // Held until Post has returned, so that the answer arrives on the loop
  // (one already there when the posting thread looks ends the batch in
  // Post, which loopback's synchronous delivery often makes it).
  for (const Op& op : ops) {
    b->gate().Close(In(kHeld));
    Posted posted;
    PostTo(Tcp(*a), {&op, 1}, In(absl::Seconds(10)), posted);
    ASSERT_TRUE(b->gate().AwaitArrivals(1, absl::Seconds(10)));
    EXPECT_FALSE(posted.done.HasBeenNotified());
    b->gate().Open();
    ASSERT_TRUE(posted.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_EQ(posted.statuses.size(), 1u);
    EXPECT_TRUE(posted.statuses[0].ok()) << posted.statuses[0];
    EXPECT_EQ(posted.thread, kLoopThread) << "op " << op.index;
    EXPECT_EQ(posted.calls.load(), 1);
    Apply(op, local_image, remote_image);
    // Every byte: the op's range changed, nothing around it.
    ExpectBytes(local, local_image, "local");
    ExpectBytes(remote, remote_image, "remote");
  }
  // Several ops in one small batch: one lane, one loop.
  b->gate().Close(In(kHeld));
  Posted batch;
  PostTo(Tcp(*a), ops, In(absl::Seconds(10)), batch);
  ASSERT_TRUE(b->gate().AwaitArrivals(1, absl::Seconds(10)));
  b->gate().Open();
  ASSERT_TRUE(batch.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  for (const absl::Status& status : batch.statuses) {
    EXPECT_TRUE(status.ok()) << status;
  }
  EXPECT_EQ(batch.thread, kLoopThread);
  for (const Op& op : ops) Apply(op, local_image, remote_image);
  ExpectBytes(local, local_image, "local after the batch");
  ExpectBytes(remote, remote_image, "remote after the batch");
}

TEST(TcpBackendLoopTest, BatchesOverTheLoopBytesGoToTheWorkers) {
  constexpr uint64_t kLength = DataClient::kLoopBatchBytes + 1;
  auto [a, b, local, remote, local_image, remote_image] =
      Warmed(/*epoch=*/113, 2 * kLength);
  const Op read =
      MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 5, kLength, remote, 9);
  Posted posted;
  PostTo(Tcp(*a), {&read, 1}, In(absl::Seconds(10)), posted);
  ASSERT_TRUE(posted.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(posted.statuses[0].ok()) << posted.statuses[0];
  EXPECT_NE(posted.thread, kLoopThread);
  Apply(read, local_image, remote_image);
  ExpectBytes(local, local_image, "local");
}

TEST(TcpBackendLoopTest, HeldPeerEndsALoopOpAtItsDeadlineAndAFreshOneWorks) {
  auto [a, b, local, remote, local_image, remote_image] = Warmed(/*epoch=*/121);
  const Op held =
      MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 0, 8, remote, 64);

  b->gate().Close(In(kHeld));
  const absl::Time deadline = absl::Now() + absl::Milliseconds(300);
  Posted posted;
  PostTo(Tcp(*a), {&held, 1}, deadline, posted);
  ASSERT_TRUE(b->gate().AwaitArrivals(1, absl::Seconds(10)));
  ASSERT_TRUE(posted.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_GE(posted.at, deadline);
  EXPECT_LT(posted.at - deadline, absl::Milliseconds(250))
      << "the loop's op ended late";
  EXPECT_EQ(posted.statuses[0].code(), StatusCode::kDeadlineExceeded)
      << posted.statuses[0];
  EXPECT_EQ(posted.thread, kLoopThread);
  b->gate().Open();
  ASSERT_TRUE(b->gate().AwaitNoneHeld(absl::Seconds(5)));
  // The late answer reached nothing: the connection was closed, not pooled.
  absl::SleepFor(absl::Milliseconds(50));
  ExpectBytes(local, local_image, "local after the deadline");
  EXPECT_EQ(PoolProbe(Tcp(*a)).idle_connections(
                HostPort{"127.0.0.1", Tcp(*b).port()}),
            0u);

  // Then a fresh connection (none is idle: a worker dials it), which is
  // pooled, and the next op goes through the loop on it.
  for (int round = 0; round < 2; ++round) {
    const Op op =
        MakeOp(0, v1::OP_TYPE_WRITE_FROM_LOCAL, local, 500, 8, remote, 700);
    b->gate().Close(In(kHeld));
    Posted next;
    PostTo(Tcp(*a), {&op, 1}, In(absl::Seconds(10)), next);
    ASSERT_TRUE(b->gate().AwaitArrivals(1, absl::Seconds(10)));
    b->gate().Open();
    ASSERT_TRUE(next.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    EXPECT_TRUE(next.statuses[0].ok()) << next.statuses[0];
    EXPECT_EQ(next.thread, round == 0 ? "tcp-client" : kLoopThread);
    EXPECT_EQ(PoolProbe(Tcp(*a)).idle_connections(
                  HostPort{"127.0.0.1", Tcp(*b).port()}),
              1u);
    Apply(op, local_image, remote_image);
  }
  ExpectBytes(local, local_image, "local");
  ExpectBytes(remote, remote_image, "remote");
  EXPECT_EQ(posted.calls.load(), 1);
}

TEST(TcpBackendLoopTest, CancellingALoopOpEndsItAtOnce) {
  auto [a, b, local, remote, local_image, remote_image] = Warmed(/*epoch=*/131);
  const Op held =
      MakeOp(4, v1::OP_TYPE_READ_INTO_LOCAL, local, 8, 8, remote, 64);

  b->gate().Close(In(kHeld));
  Cancellation cancellation;
  Posted posted;
  PostTo(Tcp(*a), {&held, 1}, StopToken(In(absl::Seconds(30)), &cancellation),
         posted);
  ASSERT_TRUE(b->gate().AwaitArrivals(1, absl::Seconds(10)));
  EXPECT_FALSE(posted.done.HasBeenNotified());
  const absl::Time cancelled_at = absl::Now();
  cancellation.Cancel(absl::CancelledError("transfer cancelled"));
  ASSERT_TRUE(posted.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_LT(posted.at - cancelled_at, absl::Milliseconds(200));
  EXPECT_EQ(posted.statuses[0].code(), StatusCode::kCancelled)
      << posted.statuses[0];
  EXPECT_NE(posted.statuses[0].message().find("op 4"), std::string::npos)
      << posted.statuses[0];
  EXPECT_EQ(posted.thread, kLoopThread);
  b->gate().Open();
  ASSERT_TRUE(b->gate().AwaitNoneHeld(absl::Seconds(5)));
  absl::SleepFor(absl::Milliseconds(50));
  ExpectBytes(local, local_image, "local after the cancellation");

  const Op op =
      MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 100, 8, remote, 9);
  Posted next;
  PostTo(Tcp(*a), {&op, 1}, In(absl::Seconds(10)), next);
  ASSERT_TRUE(next.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(next.statuses[0].ok()) << next.statuses[0];
  Apply(op, local_image, remote_image);
  ExpectBytes(local, local_image, "local");
  EXPECT_EQ(posted.calls.load(), 1);
}

TEST(TcpBackendLoopTest, AStalledLoopOpIsUnavailableLongBeforeItsDeadline) {
  DataClientOptions options;
  options.no_progress_timeout = absl::Milliseconds(200);
  auto [a, b, local, remote, local_image, remote_image] =
      Warmed(/*epoch=*/135, 4096, options);
  const Op held =
      MakeOp(2, v1::OP_TYPE_READ_INTO_LOCAL, local, 8, 8, remote, 64);

  b->gate().Close(In(kHeld));
  const absl::Time start = absl::Now();
  Posted posted;
  PostTo(Tcp(*a), {&held, 1}, In(absl::Seconds(30)), posted);
  ASSERT_TRUE(posted.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_GE(posted.at - start, options.no_progress_timeout);
  EXPECT_LT(posted.at - start,
            options.no_progress_timeout + absl::Milliseconds(250));
  EXPECT_EQ(posted.statuses[0].code(), StatusCode::kUnavailable)
      << posted.statuses[0];
  EXPECT_NE(posted.statuses[0].message().find("--tcp_no_progress_timeout"),
            std::string::npos)
      << posted.statuses[0];
  EXPECT_EQ(posted.thread, kLoopThread);
  b->gate().Open();
  ASSERT_TRUE(b->gate().AwaitNoneHeld(absl::Seconds(5)));
  absl::SleepFor(absl::Milliseconds(50));
  ExpectBytes(local, local_image, "local after the stall");
  EXPECT_EQ(posted.calls.load(), 1);
}

TEST(TcpBackendLoopTest, PeerDyingMidAnswerIsUnavailableFromTheLoop) {
  auto a = Agent(/*epoch=*/141);
  FakePeer peer;
  constexpr uint64_t kLength = 64;
  auto local = a->Register(1024, v1::ACCESS_READ_WRITE, 1);
  auto local_image = Snapshot(local);
  TestBuffer remote;
  remote.context = ContextAt(peer.port(), 4096);
  const Op warm =
      MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 0, kLength, remote, 0);
  const std::vector<Op> ops = {
      MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 200, kLength, remote, 0),
      MakeOp(1, v1::OP_TYPE_READ_INTO_LOCAL, local, 400, kLength, remote, 0)};

  absl::Notification answered_warm;
  std::thread fake([&] {
    auto request = peer.AcceptAndReadRequest();
    if (!request.ok()) return;
    peer.AnswerRead(*request, request->length);
    answered_warm.Notify();
    // The posted batch, on the pooled connection: the first op answered,
    // half of the second's payload, then the peer dies.
    auto first = peer.ReadRequest();
    auto second = peer.ReadRequest();
    if (!first.ok() || !second.ok()) return;
    peer.AnswerRead(*first, first->length);
    peer.AnswerRead(*second, second->length / 2);
    absl::SleepFor(absl::Milliseconds(20));
    peer.Die();
  });
  ASSERT_TRUE(Tcp(*a).Submit({warm}, In(absl::Seconds(10)))[0].ok());
  ASSERT_TRUE(answered_warm.WaitForNotificationWithTimeout(absl::Seconds(5)));
  Posted posted;
  const absl::Time start = absl::Now();
  PostTo(Tcp(*a), ops, In(absl::Seconds(30)), posted);
  ASSERT_TRUE(posted.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  fake.join();
  EXPECT_LT(posted.at - start, absl::Seconds(2));
  EXPECT_TRUE(posted.statuses[0].ok()) << posted.statuses[0];
  EXPECT_EQ(posted.statuses[1].code(), StatusCode::kUnavailable)
      << posted.statuses[1];
  EXPECT_NE(posted.statuses[1].message().find("op 1"), std::string::npos)
      << posted.statuses[1];
  EXPECT_EQ(posted.thread, kLoopThread);
  // The answered ranges hold the peer's bytes; nothing outside the ops'
  // ranges changed (part of the cut op's range may have).
  for (uint64_t offset : {0, 200}) {
    for (uint64_t i = 0; i < kLength; ++i) {
      ASSERT_EQ(local.span()[offset + i], std::byte{0xee}) << offset + i;
    }
  }
  const std::pair<uint64_t, uint64_t> untouched[] = {
      {kLength, 200}, {200 + kLength, 400}, {400 + kLength, 1024}};
  for (const auto& [from, to] : untouched) {
    EXPECT_EQ(
        FindMismatch(local.span().subspan(from, to - from), local.seed, from),
        std::nullopt)
        << from;
  }
  EXPECT_EQ(posted.calls.load(), 1);
}

TEST(TcpBackendLoopTest,
     AThousandSmallPostsEndInPlaceOrOnTheLoopWithNoNewThread) {
  constexpr int kPosts = 1000;
  constexpr uint64_t kLength = 8;
  auto [a, b, local, remote, local_image, remote_image] =
      Warmed(/*epoch=*/151, kPosts * 32);
  const int threads_before = ThreadCount();
  EXPECT_EQ(ThreadsNamed(kLoopThread), 2 * DataClientOptions().loops);
  char posting_thread[16] = {};
  prctl(PR_GET_NAME, posting_thread);
  int on_loop = 0;
  int in_place = 0;
  for (int i = 0; i < kPosts; ++i) {
    const Op op = MakeOp(
        i,
        i % 2 == 0 ? v1::OP_TYPE_READ_INTO_LOCAL : v1::OP_TYPE_WRITE_FROM_LOCAL,
        local, i * 32 + 3, kLength, remote, i * 32 + 11);
    Posted posted;
    PostTo(Tcp(*a), {&op, 1}, In(absl::Seconds(10)), posted);
    ASSERT_TRUE(posted.done.WaitForNotificationWithTimeout(absl::Seconds(10)))
        << "post " << i;
    ASSERT_TRUE(posted.statuses[0].ok()) << i << ": " << posted.statuses[0];
    // Never a worker's: the answer is read where it is found first.
    on_loop += posted.thread == kLoopThread ? 1 : 0;
    in_place += posted.thread == posting_thread ? 1 : 0;
    Apply(op, local_image, remote_image);
    if (i == kPosts / 2) {
      EXPECT_EQ(ThreadCount(), threads_before);
    }
  }
  std::printf("%d posts ended on the loop, %d in Post\n", on_loop, in_place);
  EXPECT_EQ(on_loop + in_place, kPosts);
  EXPECT_EQ(ThreadCount(), threads_before);
  ExpectBytes(local, local_image, "local");
  ExpectBytes(remote, remote_image, "remote");
}

}  // namespace
}  // namespace rdma_agent::tcp
