#include "backends/tcp/tcp_backend.h"

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "backends/tcp/socket_util.h"
#include "backends/testing/test_directory.h"
#include "backends/tcp/wire.h"
#include "common/shared_memory.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

using ::absl::StatusCode;

using ::rdma_agent::testing::TestDirectory;

// Fills `size` bytes with a pattern that differs per `seed` and position.
void Fill(std::byte* data, uint64_t size, uint8_t seed) {
  for (uint64_t i = 0; i < size; ++i) {
    data[i] = static_cast<std::byte>((i * 131 + seed * 17 + (i >> 12)) & 0xff);
  }
}

// Index of the first byte where a and b differ, or -1.
int64_t FirstDifference(const std::byte* a, const std::byte* b,
                        uint64_t size) {
  if (std::memcmp(a, b, size) == 0) return -1;
  for (uint64_t i = 0; i < size; ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

// One in-process "agent": a directory and a tcp backend on 127.0.0.1:port.
struct TestAgent {
  TestAgent(uint64_t epoch, uint16_t port = 0,
            tcp::DataClientOptions client = {})
      : directory(epoch) {
    BackendEnvironment env;
    env.identity.agent_id = absl::StrCat("agent-", epoch);
    env.identity.epoch = epoch;
    env.directory = &directory;
    env.advertise_host = "127.0.0.1";
    TcpOptions options;
    options.listen = absl::StrCat("127.0.0.1:", port);
    options.client = client;
    auto created = TcpBackend::Create(options, env);
    EXPECT_TRUE(created.ok()) << created.status();
    if (created.ok()) backend = std::move(*created);
  }

  // A registered buffer with a pattern and its remote context.
  struct Buffer {
    std::shared_ptr<Registration> registration;
    std::shared_ptr<v1::RemoteBuffer> context;
    std::vector<std::byte> expected;  // what the bytes should be
  };

  Buffer Register(uint64_t size, v1::Access access, uint8_t seed) {
    Buffer buffer;
    auto memory = SharedMemory::Allocate(size, "tcp-test");
    EXPECT_TRUE(memory.ok()) << memory.status();
    const uint64_t id = next_id++;
    buffer.registration = std::make_shared<Registration>(
        id, 0, access, "test", absl::StrCat("token-", id, "-x"),
        std::move(*memory), true);
    Fill(buffer.registration->data(), size, seed);
    buffer.expected.assign(buffer.registration->data(),
                           buffer.registration->data() + size);
    buffer.context = std::make_shared<v1::RemoteBuffer>();
    buffer.context->set_agent_id(absl::StrCat("agent-", directory.epoch()));
    buffer.context->set_agent_epoch(directory.epoch());
    buffer.context->set_buffer_id(buffer.registration->id());
    buffer.context->set_size_bytes(size);
    buffer.context->set_access(access);
    buffer.context->set_token(buffer.registration->token());
    v1::BackendEndpoint* endpoint = buffer.context->add_endpoints();
    auto state = backend->Register(*buffer.registration, endpoint);
    EXPECT_TRUE(state.ok()) << state.status();
    endpoint->set_backend("tcp");
    directory.Add(buffer.registration);
    return buffer;
  }

  TestDirectory directory;
  std::unique_ptr<TcpBackend> backend;
  uint64_t next_id = 1;
};

Op MakeOp(v1::OpType type, const TestAgent::Buffer& local,
          uint64_t local_offset, uint64_t length,
          const TestAgent::Buffer& remote, uint64_t remote_offset,
          size_t index = 0) {
  Op op;
  op.index = index;
  op.type = type;
  op.local = local.registration;
  op.local_offset = local_offset;
  op.length = length;
  op.remote = remote.context;
  op.remote_offset = remote_offset;
  // As BackendRegistry::Submit routes it.
  op.endpoint = FindEndpoint(*op.remote, "tcp");
  return op;
}

// Checks that `buffer` holds exactly `buffer.expected`, every byte.
void ExpectBytes(const TestAgent::Buffer& buffer, absl::string_view what) {
  const int64_t diff =
      FirstDifference(buffer.registration->data(), buffer.expected.data(),
                      buffer.expected.size());
  EXPECT_EQ(diff, -1) << what << ": first wrong byte at " << diff;
}

// Applies the effect of a successful op to the expected images.
void Apply(const Op& op, TestAgent::Buffer& local, TestAgent::Buffer& remote) {
  if (op.reads_into_local()) {
    std::memcpy(local.expected.data() + op.local_offset,
                remote.expected.data() + op.remote_offset, op.length);
  } else {
    std::memcpy(remote.expected.data() + op.remote_offset,
                local.expected.data() + op.local_offset, op.length);
  }
}

absl::Time In(absl::Duration d) { return absl::Now() + d; }

tcp::DataClientOptions ClientOptions(bool zero_copy_send) {
  tcp::DataClientOptions options;
  options.zero_copy_send = zero_copy_send;
  return options;
}

// Every case runs with payloads sent by send() and by vmsplice/splice.
class TcpBackendTest : public ::testing::TestWithParam<bool> {
 protected:
  TcpBackendTest()
      : a_(/*epoch=*/11, 0, ClientOptions(GetParam())),
        b_(/*epoch=*/22, 0, ClientOptions(GetParam())) {}
  TestAgent a_;
  TestAgent b_;
};

INSTANTIATE_TEST_SUITE_P(SendPaths, TcpBackendTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Splice" : "Send";
                         });

TEST_P(TcpBackendTest, AdvertisesHostAndBoundPort) {
  EXPECT_EQ(a_.backend->name(), "tcp");
  EXPECT_EQ(a_.backend->transport_level(), v1::TRANSPORT_LEVEL_TCP);
  EXPECT_NE(a_.backend->port(), 0);
  auto buffer = a_.Register(64, v1::ACCESS_READ_WRITE, 1);
  const v1::BackendEndpoint* endpoint = FindEndpoint(*buffer.context, "tcp");
  ASSERT_NE(endpoint, nullptr);
  ASSERT_TRUE(endpoint->has_tcp());
  EXPECT_EQ(endpoint->tcp().host(), "127.0.0.1");
  EXPECT_EQ(endpoint->tcp().port(), a_.backend->port());
  EXPECT_TRUE(b_.backend->CanReach(*buffer.context));
  v1::RemoteBuffer memory_only;
  memory_only.add_endpoints()->set_backend("memory");
  EXPECT_FALSE(b_.backend->CanReach(memory_only));
  EXPECT_EQ(a_.backend->transport_info().addresses(0),
            absl::StrCat("127.0.0.1:", a_.backend->port()));
}

TEST(TcpBackendCreateTest, NeverAdvertisesAWildcard) {
  TestDirectory directory(1);
  BackendEnvironment env;
  env.directory = &directory;
  TcpOptions options;
  options.listen = "127.0.0.1:0";
  options.advertise_host = "0.0.0.0";
  EXPECT_EQ(TcpBackend::Create(options, env).status().code(),
            StatusCode::kInvalidArgument);
  // Override honoured; environment used otherwise; listen host as last resort.
  options.advertise_host = "10.9.8.7";
  env.advertise_host = "10.1.1.1";
  auto overridden = TcpBackend::Create(options, env);
  ASSERT_TRUE(overridden.ok()) << overridden.status();
  EXPECT_EQ((*overridden)->advertise_host(), "10.9.8.7");
  options.advertise_host = "";
  auto from_env = TcpBackend::Create(options, env);
  ASSERT_TRUE(from_env.ok());
  EXPECT_EQ((*from_env)->advertise_host(), "10.1.1.1");
  env.advertise_host = "";
  auto fallback = TcpBackend::Create(options, env);
  ASSERT_TRUE(fallback.ok());
  EXPECT_EQ((*fallback)->advertise_host(), "127.0.0.1");
  options.listen = "127.0.0.1";
  EXPECT_EQ(TcpBackend::Create(options, env).status().code(),
            StatusCode::kInvalidArgument);
  options.listen = "127.0.0.1:0";
  options.client.chunk_bytes = tcp::kMaxPayloadBytes + 1;
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
  tcp::ConfigureDataSocket(fixed.get(), 96 << 10);
  EXPECT_EQ(read_sndbuf(fixed.get()), 2 * (96 << 10)) << "the kernel doubles it";
  UniqueFd autotuned(socket(AF_INET, SOCK_STREAM, 0));
  const int before = read_sndbuf(autotuned.get());
  tcp::ConfigureDataSocket(autotuned.get(), 0);
  EXPECT_EQ(read_sndbuf(autotuned.get()), before);
}

TEST_P(TcpBackendTest, WritesAndReadsOddOffsetsAndSizes) {
  constexpr uint64_t kMax = 64ull << 20;
  auto local = a_.Register(kMax + 64, v1::ACCESS_READ_WRITE, 3);
  auto remote = b_.Register(kMax + 64, v1::ACCESS_READ_WRITE, 200);
  for (uint64_t size : std::vector<uint64_t>{1, 7, 4095, 65537,
                                            (1ull << 20) + 3,
                                            (9ull << 20) + 5, kMax}) {
    SCOPED_TRACE(absl::StrCat("size ", size));
    const uint64_t local_offset = size % 13 + 1;
    const uint64_t remote_offset = size % 29 + 3;
    Op write = MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local, local_offset, size,
                      remote, remote_offset);
    auto results = a_.backend->Submit({write}, In(absl::Seconds(60)));
    ASSERT_EQ(results.size(), 1u);
    ASSERT_TRUE(results[0].ok()) << results[0];
    Apply(write, local, remote);
    ExpectBytes(remote, "remote after write");
    ExpectBytes(local, "local after write");

    // Read it back to a different place in the local buffer.
    Op read = MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, local, 64 - local_offset,
                     size, remote, remote_offset);
    results = a_.backend->Submit({read}, In(absl::Seconds(60)));
    ASSERT_TRUE(results[0].ok()) << results[0];
    Apply(read, local, remote);
    ExpectBytes(local, "local after read");
    ExpectBytes(remote, "remote after read");
  }
  EXPECT_GT(local.registration->bytes_moved(), 2 * kMax);
  EXPECT_EQ(remote.registration->bytes_served(),
            local.registration->bytes_moved());
}

TEST_P(TcpBackendTest, PipelinesManyOpsInOneSubmit) {
  auto local = a_.Register(1 << 20, v1::ACCESS_READ_WRITE, 5);
  auto remote = b_.Register(1 << 20, v1::ACCESS_READ_WRITE, 6);
  std::vector<Op> ops;
  for (size_t i = 0; i < 300; ++i) {
    // Disjoint ranges, so order between ops does not matter.
    const uint64_t length = 1 + (i * 97) % 3000;
    ops.push_back(MakeOp(i % 2 ? v1::OP_TYPE_READ_INTO_LOCAL
                               : v1::OP_TYPE_WRITE_FROM_LOCAL,
                         local, i * 3400 + 1, length, remote, i * 3400 + 2,
                         i));
  }
  auto results = a_.backend->Submit(ops, In(absl::Seconds(30)));
  ASSERT_EQ(results.size(), ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << i << ": " << results[i];
    Apply(ops[i], local, remote);
  }
  ExpectBytes(local, "local");
  ExpectBytes(remote, "remote");
  // The connections went back to the pool for the next Submit.
  HostPort peer{"127.0.0.1", b_.backend->port()};
  EXPECT_GE(a_.backend->client().idle_connections(peer), 1u);
}

TEST_P(TcpBackendTest, LargeReadsAndWritesShareOneConnection) {
  // One connection, so READ payloads coming back and WRITE payloads going
  // out interleave on it: blocking the wrong way would deadlock until the
  // deadline.
  tcp::DataClientOptions options = ClientOptions(GetParam());
  options.connections_per_peer = 1;
  options.chunk_bytes = 3 << 20;
  TestAgent a(31, 0, options);
  TestAgent b(32, 0, options);
  constexpr uint64_t kOp = (9ull << 20) + 7;
  constexpr int kOps = 8;
  auto local = a.Register(kOps * kOp + 16, v1::ACCESS_READ_WRITE, 1);
  auto remote = b.Register(kOps * kOp + 16, v1::ACCESS_READ_WRITE, 2);
  std::vector<Op> ops;
  for (int i = 0; i < kOps; ++i) {
    ops.push_back(MakeOp(i % 2 ? v1::OP_TYPE_READ_INTO_LOCAL
                               : v1::OP_TYPE_WRITE_FROM_LOCAL,
                         local, i * kOp + 3, kOp, remote, i * kOp + 5, i));
  }
  const absl::Time start = absl::Now();
  auto results = a.backend->Submit(ops, start + absl::Seconds(60));
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  for (int i = 0; i < kOps; ++i) {
    ASSERT_TRUE(results[i].ok()) << i << ": " << results[i];
    Apply(ops[i], local, remote);
  }
  ExpectBytes(local, "local");
  ExpectBytes(remote, "remote");
}

TEST_P(TcpBackendTest, ConcurrentSubmitsToOnePeer) {
  constexpr int kThreads = 6;
  auto remote = b_.Register(kThreads << 20, v1::ACCESS_READ_WRITE, 9);
  std::vector<TestAgent::Buffer> locals;
  for (int t = 0; t < kThreads; ++t) {
    locals.push_back(a_.Register(1 << 20, v1::ACCESS_READ_WRITE, 30 + t));
  }
  std::vector<std::thread> threads;
  std::vector<absl::Status> statuses(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5 && statuses[t].ok(); ++round) {
        Op op = MakeOp(round % 2 ? v1::OP_TYPE_READ_INTO_LOCAL
                                 : v1::OP_TYPE_WRITE_FROM_LOCAL,
                       locals[t], 0, 1 << 20, remote,
                       static_cast<uint64_t>(t) << 20);
        statuses[t] = a_.backend->Submit({op}, In(absl::Seconds(30)))[0];
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_TRUE(statuses[t].ok()) << t << ": " << statuses[t];
    // Written then read back: each slice of the remote now holds local t.
    EXPECT_EQ(FirstDifference(remote.registration->data() + (t << 20),
                              locals[t].expected.data(), 1 << 20),
              -1);
    ExpectBytes(locals[t], "local");
  }
}

TEST_P(TcpBackendTest, EveryRefusalHasItsCodeAndChangesNothing) {
  auto local = a_.Register(4096, v1::ACCESS_READ_WRITE, 1);
  auto remote = b_.Register(4096, v1::ACCESS_READ_WRITE, 2);
  auto read_only = b_.Register(4096, v1::ACCESS_READ, 3);
  auto write_only = b_.Register(4096, v1::ACCESS_WRITE, 4);

  auto with = [](const TestAgent::Buffer& buffer, auto mutate) {
    TestAgent::Buffer copy = buffer;
    copy.context = std::make_shared<v1::RemoteBuffer>(*buffer.context);
    mutate(*copy.context);
    return copy;
  };
  auto bad_token = with(remote, [](v1::RemoteBuffer& c) {
    c.set_token("token-nope-x");
  });
  auto stale = with(remote, [](v1::RemoteBuffer& c) {
    c.set_agent_epoch(c.agent_epoch() + 1);
  });
  auto unknown = with(remote, [](v1::RemoteBuffer& c) {
    c.set_buffer_id(999);
  });

  struct Case {
    const char* name;
    Op op;
    StatusCode code;
  };
  const auto W = v1::OP_TYPE_WRITE_FROM_LOCAL;
  const auto R = v1::OP_TYPE_READ_INTO_LOCAL;
  std::vector<Case> cases = {
      {"bad token write", MakeOp(W, local, 0, 100, bad_token, 0),
       StatusCode::kNotFound},
      {"bad token read", MakeOp(R, local, 0, 100, bad_token, 0),
       StatusCode::kNotFound},
      {"write into read-only", MakeOp(W, local, 0, 100, read_only, 0),
       StatusCode::kPermissionDenied},
      {"read from write-only", MakeOp(R, local, 0, 100, write_only, 0),
       StatusCode::kPermissionDenied},
      {"write past the end", MakeOp(W, local, 0, 100, remote, 4000),
       StatusCode::kOutOfRange},
      {"read past the end", MakeOp(R, local, 0, 100, remote, 4000),
       StatusCode::kOutOfRange},
      {"stale epoch", MakeOp(W, local, 0, 100, stale, 0),
       StatusCode::kFailedPrecondition},
      {"unknown buffer", MakeOp(R, local, 0, 100, unknown, 0),
       StatusCode::kNotFound},
  };
  // All in one Submit, between good ops: refusals must not disturb the
  // connection's framing (a refused WRITE's payload is consumed).
  std::vector<Op> ops;
  for (size_t i = 0; i < cases.size(); ++i) {
    ops.push_back(MakeOp(W, local, 200 + i, 10, remote, 300 + i * 10));
    ops.push_back(cases[i].op);
  }
  auto results = a_.backend->Submit(ops, In(absl::Seconds(10)));
  ASSERT_EQ(results.size(), ops.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_TRUE(results[2 * i].ok()) << results[2 * i];
    Apply(ops[2 * i], local, remote);
    EXPECT_EQ(results[2 * i + 1].code(), cases[i].code)
        << cases[i].name << ": " << results[2 * i + 1];
    EXPECT_FALSE(results[2 * i + 1].message().empty());
  }
  ExpectBytes(local, "local");
  ExpectBytes(remote, "remote");
  ExpectBytes(read_only, "read-only");
  ExpectBytes(write_only, "write-only");
}

// A fake peer: accepts one connection and lets the test script it.
class FakePeer {
 public:
  FakePeer() {
    auto listener = tcp::ListenTcp({"127.0.0.1", 0}, &port_);
    EXPECT_TRUE(listener.ok()) << listener.status();
    listener_ = std::move(*listener);
  }
  uint16_t port() const { return port_; }
  // Accepts a connection, greets it as an agent would and reads one request
  // header (and token, payload).
  absl::StatusOr<tcp::RequestHeader> AcceptAndReadRequest() {
    conn_.reset(accept(listener_.get(), nullptr, nullptr));
    if (!conn_) return absl::InternalError("accept failed");
    std::byte hello[tcp::kServerHelloBytes];
    tcp::EncodeServerHello(hello);  // as a DataServer does at accept
    (void)send(conn_.get(), hello, sizeof(hello), MSG_NOSIGNAL);
    std::byte bytes[tcp::kRequestHeaderBytes];
    if (auto s = tcp::ReadFull(conn_.get(), bytes, sizeof(bytes)); !s.ok()) {
      return s;
    }
    auto header = tcp::DecodeRequestHeader(bytes);
    if (!header.ok()) return header.status();
    std::string token(header->token_bytes, '\0');
    if (auto s = tcp::ReadFull(conn_.get(), token.data(), token.size());
        !s.ok()) {
      return s;
    }
    return header;
  }
  int conn() const { return conn_.get(); }
  void Close() { conn_.reset(); }

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
  auto local = a_.Register(kSize + 32, v1::ACCESS_READ_WRITE, 7);
  TestAgent::Buffer remote;
  remote.context = ContextAt(peer.port(), kSize);
  Op read = MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, local, 16, kSize, remote, 0);

  absl::StatusOr<tcp::RequestHeader> request;
  absl::Notification submitted;
  std::thread fake([&] {
    request = peer.AcceptAndReadRequest();
    // Answer only once Submit has returned: a perfectly valid, late response.
    submitted.WaitForNotification();
    if (!request.ok()) return;
    tcp::ResponseHeader response;
    response.request_id = request->request_id;
    response.payload_bytes = request->length;
    std::byte bytes[tcp::kResponseHeaderBytes];
    tcp::EncodeResponseHeader(response, bytes);
    std::vector<std::byte> payload(request->length, std::byte{0xee});
    iovec iov[2] = {{bytes, sizeof(bytes)}, {payload.data(), payload.size()}};
    (void)tcp::WriteFull(peer.conn(), iov, 2);
    // Wait until the client's side is gone for sure: EOF or reset.
    char c;
    (void)recv(peer.conn(), &c, 1, 0);
  });

  const absl::Time start = absl::Now();
  const absl::Duration timeout = absl::Milliseconds(400);
  auto results = a_.backend->Submit({read}, start + timeout);
  const absl::Duration took = absl::Now() - start;
  submitted.Notify();
  fake.join();
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_EQ(results[0].code(), StatusCode::kDeadlineExceeded) << results[0];
  EXPECT_GE(took, timeout);
  EXPECT_LT(took, timeout + absl::Seconds(2));
  // The late response reached nothing.
  ExpectBytes(local, "local after a late response");
  EXPECT_EQ(local.registration->bytes_moved(), 0u);
}

TEST_P(TcpBackendTest, PeerClosingMidResponseIsUnavailableAtOnce) {
  FakePeer peer;
  constexpr uint64_t kSize = 1 << 20;
  auto local = a_.Register(kSize + 32, v1::ACCESS_READ_WRITE, 8);
  TestAgent::Buffer remote;
  remote.context = ContextAt(peer.port(), kSize);
  Op read = MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, local, 16, kSize, remote, 0);

  std::thread fake([&] {
    auto request = peer.AcceptAndReadRequest();
    if (!request.ok()) return;
    // Half a response, then the peer "dies".
    tcp::ResponseHeader response;
    response.request_id = request->request_id;
    response.payload_bytes = request->length;
    std::byte bytes[tcp::kResponseHeaderBytes];
    tcp::EncodeResponseHeader(response, bytes);
    std::vector<std::byte> half(request->length / 2, std::byte{0xab});
    iovec iov[2] = {{bytes, sizeof(bytes)}, {half.data(), half.size()}};
    (void)tcp::WriteFull(peer.conn(), iov, 2);
    peer.Close();
  });
  const absl::Time start = absl::Now();
  auto results = a_.backend->Submit({read}, start + absl::Seconds(30));
  const absl::Duration took = absl::Now() - start;
  fake.join();
  EXPECT_EQ(results[0].code(), StatusCode::kUnavailable) << results[0];
  EXPECT_LT(took, absl::Seconds(5));
  // Inside the op's range some bytes may have landed; none outside it.
  EXPECT_EQ(FirstDifference(local.registration->data(), local.expected.data(),
                            16),
            -1);
  EXPECT_EQ(FirstDifference(local.registration->data() + 16 + kSize,
                            local.expected.data() + 16 + kSize, 16),
            -1);
}

TEST_P(TcpBackendTest, RefusedDialIsUnavailable) {
  FakePeer gone;
  const uint16_t port = gone.port();
  { FakePeer moved = std::move(gone); }  // closes the listener
  auto local = a_.Register(64, v1::ACCESS_READ_WRITE, 1);
  TestAgent::Buffer remote;
  remote.context = ContextAt(port, 64);
  auto results = a_.backend->Submit(
      {MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local, 0, 64, remote, 0)},
      In(absl::Seconds(10)));
  EXPECT_EQ(results[0].code(), StatusCode::kUnavailable) << results[0];
}

TEST_P(TcpBackendTest, PassedDeadlineIsDeadlineExceeded) {
  auto local = a_.Register(64, v1::ACCESS_READ_WRITE, 1);
  auto remote = b_.Register(64, v1::ACCESS_READ_WRITE, 2);
  auto results = a_.backend->Submit(
      {MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local, 0, 64, remote, 0)},
      absl::Now() - absl::Seconds(1));
  EXPECT_EQ(results[0].code(), StatusCode::kDeadlineExceeded) << results[0];
  ExpectBytes(remote, "remote");
}

TEST(TcpBackendShutdownTest, ServerGoingAwayMidTransferIsUnavailableAtOnce) {
  tcp::DataClientOptions options;
  options.chunk_bytes = 1 << 20;  // many requests: the transfer is cut mid-way
  TestAgent a(41, 0, options);
  auto b = std::make_unique<TestAgent>(42, 0, options);
  constexpr uint64_t kSize = 32ull << 20;
  constexpr uint64_t kGuard = 4096;
  auto local = a.Register(kSize + 2 * kGuard, v1::ACCESS_READ_WRITE, 1);
  auto remote = b->Register(kSize, v1::ACCESS_READ_WRITE, 2);
  std::vector<Op> ops;
  for (int i = 0; i < 64; ++i) {  // 2 GiB of reads in all
    ops.push_back(MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, local, kGuard, kSize,
                         remote, 0, i));
  }
  std::vector<absl::Status> results;
  absl::Notification done;
  std::thread submit([&] {
    results = a.backend->Submit(ops, In(absl::Seconds(60)));
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
  b->backend.reset();  // cuts its connections, waits for its threads
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
  EXPECT_EQ(FirstDifference(local.registration->data(), local.expected.data(),
                            kGuard),
            -1);
  EXPECT_EQ(FirstDifference(local.registration->data() + kGuard + kSize,
                            local.expected.data() + kGuard + kSize, kGuard),
            -1);
}

TEST(TcpBackendRestartTest, ReconnectsToARestartedPeer) {
  TestAgent a(1);
  auto b = std::make_unique<TestAgent>(2);
  const uint16_t port = b->backend->port();
  auto local = a.Register(1 << 16, v1::ACCESS_READ_WRITE, 1);
  auto old_remote = b->Register(1 << 16, v1::ACCESS_READ_WRITE, 2);
  Op op = MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local, 1, 1000, old_remote, 2);
  ASSERT_TRUE(a.backend->Submit({op}, In(absl::Seconds(10)))[0].ok());
  HostPort peer{"127.0.0.1", port};
  ASSERT_GE(a.backend->client().idle_connections(peer), 1u);

  // The peer dies (its pooled connections with it) and comes back on the same
  // port with a new epoch.
  b.reset();
  auto restarted = TestAgent(3, port);
  ASSERT_NE(restarted.backend, nullptr);
  auto results = a.backend->Submit({op}, In(absl::Seconds(10)));
  EXPECT_EQ(results[0].code(), StatusCode::kFailedPrecondition) << results[0];

  auto new_remote = restarted.Register(1 << 16, v1::ACCESS_READ_WRITE, 9);
  Op fresh = MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local, 1, 1000, new_remote, 2);
  results = a.backend->Submit({fresh}, In(absl::Seconds(10)));
  ASSERT_TRUE(results[0].ok()) << results[0];
  Apply(fresh, local, new_remote);
  ExpectBytes(new_remote, "new remote");
}

TEST_P(TcpBackendTest, ReleaseDuringInFlightOpsIsSafe) {
  constexpr uint64_t kSize = 48ull << 20;
  auto local = a_.Register(kSize, v1::ACCESS_READ_WRITE, 1);
  auto remote = b_.Register(kSize, v1::ACCESS_READ_WRITE, 2);
  Op write = MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local, 0, kSize, remote, 0);
  Op read = MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, local, 0, kSize, remote, 0);
  std::weak_ptr<Registration> remote_alive = remote.registration;
  std::weak_ptr<Registration> local_alive = local.registration;

  std::vector<absl::Status> results;
  std::thread submit([&, ops = std::vector<Op>{write, read}] {
    results = a_.backend->Submit(ops, In(absl::Seconds(60)));
  });
  // Release both sides while the ops run: only the ops pin them now.
  b_.directory.Remove(remote.registration->id());
  a_.directory.Remove(local.registration->id());
  remote.registration.reset();
  local.registration.reset();
  write.local.reset();
  read.local.reset();
  submit.join();
  ASSERT_EQ(results.size(), 2u);
  // Each op either got its bytes through before the release reached the peer
  // or was refused as unknown; nothing else.
  for (const absl::Status& status : results) {
    EXPECT_TRUE(status.ok() || status.code() == StatusCode::kNotFound)
        << status;
  }
  // Once Submit has returned, the last pins are gone: memory is unmapped.
  EXPECT_TRUE(remote_alive.expired());
  EXPECT_TRUE(local_alive.expired());
}

}  // namespace
}  // namespace rdma_agent
