// The serving side's defences, driven by raw sockets on loopback: what a
// stranger or a stalling token holder can make a DataServer do.
#include "backends/tcp/data_server.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/buffer_table.h"
#include "backends/notification_sink.h"
#include "backends/registration.h"
#include "backends/tcp/socket_util.h"
#include "backends/tcp/wire.h"
#include "common/shared_memory.h"
#include "gtest/gtest.h"

namespace rdma_agent::tcp {
namespace {

constexpr uint64_t kEpoch = 9;

// True once `condition` holds, polled every 10 ms for at most `timeout`.
bool WaitFor(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

// A blocking TCP connection to 127.0.0.1:port from `source` (any 127/8
// address is this host's, and counts as its own source).
UniqueFd Connect(uint16_t port, const char* source = "127.0.0.1") {
  UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  EXPECT_TRUE(fd) << std::strerror(errno);
  sockaddr_in from{};
  from.sin_family = AF_INET;
  inet_pton(AF_INET, source, &from.sin_addr);
  EXPECT_EQ(bind(fd.get(), reinterpret_cast<sockaddr*>(&from), sizeof(from)), 0)
      << std::strerror(errno);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  EXPECT_EQ(connect(fd.get(), reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0)
      << std::strerror(errno);
  return fd;
}

// Everything `fd` receives until the server closes it. DEADLINE_EXCEEDED
// if it is still open after `timeout`.
absl::StatusOr<std::string> ReadUntilClosed(int fd, absl::Duration timeout) {
  std::string data;
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(
          absl::StrCat("still open; received ", data.size(), " bytes"));
    }
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <=
        0) {
      continue;
    }
    char buffer[4096];
    const ssize_t n = recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return data;
    if (n > 0) data.append(buffer, static_cast<size_t>(n));
  }
}

// Reads the server hello (bounded) and checks it.
absl::Status ReadHello(int fd) {
  SetIoTimeout(fd, /*receive=*/true, absl::Seconds(5));
  std::byte hello[kServerHelloBytes];
  if (absl::Status status = ReadFull(fd, hello, sizeof(hello)); !status.ok()) {
    return status;
  }
  return DecodeServerHello(hello);
}

std::string Header(RequestKind kind, uint64_t buffer_id, uint64_t offset,
                   uint64_t length, const std::string& token) {
  RequestHeader header;
  header.kind = kind;
  header.request_id = 42;
  header.epoch = kEpoch;
  header.buffer_id = buffer_id;
  header.offset = offset;
  header.length = length;
  header.token_bytes = static_cast<uint32_t>(token.size());
  std::string out(kRequestHeaderBytes, '\0');
  EncodeRequestHeader(header, reinterpret_cast<std::byte*>(out.data()));
  return out + token;
}

void SendAll(int fd, const std::string& bytes) {
  ASSERT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(bytes.size()));
}

// Open fds of this process.
int OpenFds() {
  int count = 0;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  while (readdir(dir) != nullptr) ++count;
  closedir(dir);
  return count - 3;  // ".", ".." and the directory's own fd
}

absl::Duration ProcessCpuTime() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return absl::DurationFromTimeval(usage.ru_utime) +
         absl::DurationFromTimeval(usage.ru_stime);
}

class DataServerTest : public ::testing::Test {
 protected:
  DataServerTest() : directory_(kEpoch) {}

  // Starts the server with `options` (long timeouts unless a test shortens
  // them, so only the limit under test acts).
  void StartServer(DataServerOptions options) {
    auto server =
        DataServer::Start({"127.0.0.1", 0}, &directory_, std::move(options));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }
  static DataServerOptions Patient() {
    DataServerOptions options;
    options.handshake_timeout = absl::Seconds(30);
    options.idle_timeout = absl::Seconds(30);
    options.request_timeout = absl::Seconds(30);
    return options;
  }

  // A registered READ_WRITE buffer of `size` bytes (pattern-filled).
  std::shared_ptr<Registration> Register(uint64_t id, uint64_t size) {
    auto memory = SharedMemory::Allocate(size, "data-server-test");
    EXPECT_TRUE(memory.ok()) << memory.status();
    auto registration = std::make_shared<Registration>(
        id, 0, v1::ACCESS_READ_WRITE, "test", absl::StrCat("token-", id),
        std::move(*memory), true);
    for (uint64_t i = 0; i < size; ++i) {
      registration->data()[i] = static_cast<std::byte>(i * 7 + id);
    }
    directory_.Add(registration);
    return registration;
  }

  uint16_t port() const { return server_->port(); }

  BufferTable directory_;
  std::unique_ptr<DataServer> server_;
};

TEST_F(DataServerTest, SendsTheHelloFirstThenServesRequests) {
  StartServer(Patient());
  auto buffer = Register(1, 4096);
  UniqueFd fd = Connect(port());
  // Before the client has sent a byte.
  ASSERT_TRUE(ReadHello(fd.get()).ok());
  SendAll(fd.get(), Header(RequestKind::kRead, 1, 100, 50, "token-1"));
  std::byte bytes[kResponseHeaderBytes];
  ASSERT_TRUE(ReadFull(fd.get(), bytes, sizeof(bytes)).ok());
  auto response = DecodeResponseHeader(bytes);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->code, 0u);
  ASSERT_EQ(response->payload_bytes, 50u);
  std::string payload(response->message_bytes + 50, '\0');
  ASSERT_TRUE(ReadFull(fd.get(), payload.data(), payload.size()).ok());
  EXPECT_EQ(std::memcmp(payload.data() + response->message_bytes,
                        buffer->data() + 100, 50),
            0);
}

TEST_F(DataServerTest, SilentConnectionIsClosedAfterTheHandshakeTimeout) {
  DataServerOptions options = Patient();
  options.handshake_timeout = absl::Milliseconds(300);
  StartServer(options);
  UniqueFd silent = Connect(port());
  // Half a valid header is not a request yet: it does not buy more time.
  UniqueFd partial = Connect(port());
  const absl::Time start = absl::Now();
  SendAll(partial.get(),
          Header(RequestKind::kRead, 1, 0, 1, "t").substr(0, 20));
  for (int fd : {silent.get(), partial.get()}) {
    auto received = ReadUntilClosed(fd, absl::Seconds(5));
    ASSERT_TRUE(received.ok()) << received.status();
    EXPECT_EQ(received->size(), kServerHelloBytes) << "only the hello";
  }
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));
  EXPECT_TRUE(
      WaitFor([&] { return server_->connections() == 0; }, absl::Seconds(2)));
}

// Well-formed requests are no key: until one names a registration with its
// token, a connection lives no more than the handshake timeout from its
// accept, however many refused requests it sends.
TEST_F(DataServerTest, RefusedRequestsDoNotBuyAStrangerTime) {
  DataServerOptions options = Patient();
  options.handshake_timeout = absl::Milliseconds(400);
  StartServer(options);
  Register(1, 4096);
  const absl::Time accepted = absl::Now();
  UniqueFd stranger = Connect(port());
  UniqueFd peer = Connect(port());
  ASSERT_TRUE(ReadHello(stranger.get()).ok());
  ASSERT_TRUE(ReadHello(peer.get()).ok());
  SendAll(stranger.get(), Header(RequestKind::kRead, 1, 0, 10, "guess"));
  SendAll(peer.get(), Header(RequestKind::kRead, 1, 0, 10, "token-1"));
  std::byte bytes[kResponseHeaderBytes];
  ASSERT_TRUE(ReadFull(stranger.get(), bytes, sizeof(bytes)).ok());
  auto refused = DecodeResponseHeader(bytes);
  ASSERT_TRUE(refused.ok()) << refused.status();
  // A wrong token is answered like an unknown id (token first).
  EXPECT_EQ(refused->code, static_cast<uint32_t>(absl::StatusCode::kNotFound));
  std::string rest(refused->message_bytes, '\0');
  ASSERT_TRUE(ReadFull(stranger.get(), rest.data(), rest.size()).ok());
  // More refused requests, spaced out: none of them extends the deadline.
  for (int i = 0; i < 3; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    if (send(stranger.get(),
             Header(RequestKind::kRead, 1, 0, 10, "guess").data(),
             kRequestHeaderBytes + 5, MSG_NOSIGNAL) < 0) {
      break;
    }
  }
  auto received = ReadUntilClosed(stranger.get(), absl::Seconds(5));
  ASSERT_TRUE(received.ok()) << received.status();
  const absl::Duration lasted = absl::Now() - accepted;
  EXPECT_GE(lasted, absl::Milliseconds(350));
  EXPECT_LT(lasted, absl::Milliseconds(1500));
  // The token holder's connection idles on (30 s idle timeout).
  ASSERT_TRUE(ReadFull(peer.get(), bytes, sizeof(bytes)).ok());
  auto served = DecodeResponseHeader(bytes);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ(served->code, 0u);
  std::string payload(served->message_bytes + 10, '\0');
  ASSERT_TRUE(ReadFull(peer.get(), payload.data(), payload.size()).ok());
  absl::SleepFor(absl::Milliseconds(600));
  pollfd p{peer.get(), POLLIN, 0};
  EXPECT_EQ(poll(&p, 1, 0), 0) << "the token holder's connection was closed";
  EXPECT_EQ(server_->connections(), 1u);
}

// Takes notifications whose target the server has proven, counting them.
class CountingSink : public NotificationSink {
 public:
  absl::Status Deliver(const ServeRequest&, absl::string_view,
                       absl::string_view data) override {
    if (data.size() > max_bytes()) return absl::InvalidArgumentError("long");
    delivered.fetch_add(1);
    return absl::OkStatus();
  }
  size_t max_bytes() const override { return 64; }
  std::atomic<int> delivered{0};
};

// Answer `fd` has for its next request: its code (the message is read).
absl::StatusOr<uint32_t> ReadCode(int fd) {
  std::byte bytes[kResponseHeaderBytes];
  if (absl::Status read = ReadFull(fd, bytes, sizeof(bytes)); !read.ok()) {
    return read;
  }
  auto response = DecodeResponseHeader(bytes);
  if (!response.ok()) return response.status();
  std::string rest(response->message_bytes + response->payload_bytes, '\0');
  if (absl::Status read = ReadFull(fd, rest.data(), rest.size()); !read.ok()) {
    return read;
  }
  return response->code;
}

// A kNotify is checked on its header and token (epoch, id, token, then
// WRITE access) and its declared length, before a byte of its payload is
// read or kept: a stranger announcing a megabyte is answered and cut at
// once; a READ-only holder is refused; a token holder's over-long one is
// refused and dropped unread, its connection going on.
TEST_F(DataServerTest, NotificationsAreCheckedBeforeTheirPayload) {
  CountingSink sink;
  DataServerOptions options = Patient();
  options.notifications = &sink;
  StartServer(options);
  Register(1, 4096);
  auto memory = SharedMemory::Allocate(4096, "data-server-test");
  ASSERT_TRUE(memory.ok()) << memory.status();
  directory_.Add(std::make_shared<Registration>(
      2, 0, v1::ACCESS_READ, "test", "token-2", std::move(*memory), true));
  const std::string note = EncodeNotification("agent-a", "ready");

  UniqueFd stranger = Connect(port());
  ASSERT_TRUE(ReadHello(stranger.get()).ok());
  const absl::Time sent = absl::Now();
  SendAll(stranger.get(), Header(RequestKind::kNotify, 1, 0, 1 << 20, "") +
                              std::string(4096, 'n'));
  EXPECT_EQ(ReadCode(stranger.get()).value_or(0),
            static_cast<uint32_t>(absl::StatusCode::kNotFound));
  ASSERT_TRUE(ReadUntilClosed(stranger.get(), absl::Seconds(5)).ok());
  EXPECT_LT(absl::Now() - sent, absl::Seconds(5)) << "not cut at once";

  UniqueFd holder = Connect(port());
  ASSERT_TRUE(ReadHello(holder.get()).ok());
  SendAll(holder.get(),
          Header(RequestKind::kNotify, 2, 0, note.size(), "token-2") + note);
  EXPECT_EQ(ReadCode(holder.get()).value_or(0),
            static_cast<uint32_t>(absl::StatusCode::kPermissionDenied));
  const std::string long_note =
      EncodeNotification("agent-a", std::string(400, 'x'));
  SendAll(holder.get(),
          Header(RequestKind::kNotify, 1, 0, long_note.size(), "token-1") +
              long_note);
  EXPECT_EQ(ReadCode(holder.get()).value_or(0),
            static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
  SendAll(holder.get(),
          Header(RequestKind::kNotify, 1, 0, note.size(), "token-1") + note);
  EXPECT_EQ(ReadCode(holder.get()).value_or(99), 0u);
  EXPECT_EQ(sink.delivered.load(), 1);
}

TEST_F(DataServerTest, GarbageFirstBytesAreClosedAtOnce) {
  StartServer(Patient());  // a 30 s handshake: only the garbage can end it
  for (const std::string& garbage :
       {std::string("GET / HTTP/1.1\r\n"), std::string("\x16\x03\x01", 3),
        std::string("RATC")  // right magic, then a wrong version
            + std::string("\x07\x00", 2)}) {
    UniqueFd fd = Connect(port());
    const absl::Time start = absl::Now();
    SendAll(fd.get(), garbage);
    auto received = ReadUntilClosed(fd.get(), absl::Seconds(5));
    ASSERT_TRUE(received.ok()) << received.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  }
}

TEST_F(DataServerTest, ConnectionsOverTheSourceCapAreClosedAtAccept) {
  DataServerOptions options = Patient();
  options.max_connections_per_source = 3;
  StartServer(options);
  std::vector<UniqueFd> admitted;
  for (int i = 0; i < 3; ++i) {
    admitted.push_back(Connect(port()));
    ASSERT_TRUE(ReadHello(admitted.back().get()).ok()) << i;
  }
  // The fourth from the same address: closed without a hello.
  UniqueFd over = Connect(port());
  auto received = ReadUntilClosed(over.get(), absl::Seconds(5));
  ASSERT_TRUE(received.ok()) << received.status();
  EXPECT_EQ(*received, "");
  EXPECT_EQ(server_->connections(), 3u);
  // Another source is not affected.
  UniqueFd other = Connect(port(), "127.0.0.2");
  EXPECT_TRUE(ReadHello(other.get()).ok());
  // (The hello goes out just before the server counts the connection.)
  ASSERT_TRUE(
      WaitFor([&] { return server_->connections() == 4; }, absl::Seconds(5)));
  // A slot freed by the source is its again.
  admitted.pop_back();
  ASSERT_TRUE(
      WaitFor([&] { return server_->connections() == 3; }, absl::Seconds(5)));
  UniqueFd again = Connect(port());
  EXPECT_TRUE(ReadHello(again.get()).ok());
}

TEST_F(DataServerTest, ConnectionsOverTheTotalCapAreClosedAtAccept) {
  DataServerOptions options = Patient();
  options.max_connections = 2;
  StartServer(options);
  EXPECT_EQ(server_->options().max_connections, 2);
  UniqueFd a = Connect(port(), "127.0.0.2");
  UniqueFd b = Connect(port(), "127.0.0.3");
  ASSERT_TRUE(ReadHello(a.get()).ok());
  ASSERT_TRUE(ReadHello(b.get()).ok());
  UniqueFd c = Connect(port(), "127.0.0.4");
  auto received = ReadUntilClosed(c.get(), absl::Seconds(5));
  ASSERT_TRUE(received.ok()) << received.status();
  EXPECT_EQ(*received, "");
}

TEST(DataServerDefaultsTest, TotalCapIsAQuarterOfTheFdLimit) {
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit lowered = saved;
  lowered.rlim_cur = 1024;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
  EXPECT_EQ(DefaultMaxConnections(), 256);
  lowered.rlim_cur = std::min<rlim_t>(saved.rlim_max, 1 << 20);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
  EXPECT_EQ(DefaultMaxConnections(),
            std::min<int>(DataServer::kMaxConnectionsCeiling,
                          static_cast<int>(lowered.rlim_cur / 4)));
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  DataServerOptions options;
  EXPECT_EQ(options.max_connections_per_source, 64);
  EXPECT_EQ(options.handshake_timeout, absl::Seconds(2));
  EXPECT_EQ(options.idle_timeout, absl::Seconds(120));
  EXPECT_EQ(options.request_timeout, absl::Seconds(30));
}

TEST_F(DataServerTest, IdleConnectionIsClosedAfterTheIdleTimeout) {
  DataServerOptions options = Patient();
  options.idle_timeout = absl::Milliseconds(300);
  StartServer(options);
  Register(1, 4096);
  UniqueFd fd = Connect(port());
  ASSERT_TRUE(ReadHello(fd.get()).ok());
  SendAll(fd.get(), Header(RequestKind::kRead, 1, 0, 10, "token-1"));
  const absl::Time answered = absl::Now();
  auto received = ReadUntilClosed(fd.get(), absl::Seconds(5));
  ASSERT_TRUE(received.ok()) << received.status();
  EXPECT_EQ(received->size(), kResponseHeaderBytes + 10)
      << "the answer, then EOF";
  EXPECT_GE(absl::Now() - answered, absl::Milliseconds(250));
}

TEST_F(DataServerTest, StalledPartialWriteReleasesTheRegistration) {
  DataServerOptions options = Patient();
  options.request_timeout = absl::Milliseconds(500);
  StartServer(options);
  constexpr uint64_t kSize = 1 << 20;
  auto buffer = Register(1, kSize);
  std::weak_ptr<Registration> alive = buffer;
  UniqueFd fd = Connect(port());
  ASSERT_TRUE(ReadHello(fd.get()).ok());
  // A token holder sends a WRITE header and half the payload, then stalls.
  SendAll(fd.get(), Header(RequestKind::kWrite, 1, 0, kSize, "token-1") +
                        std::string(kSize / 2, 'w'));
  // The server resolved (pinned) the registration: ours, the directory's
  // and its own reference.
  ASSERT_TRUE(
      WaitFor([&] { return buffer.use_count() >= 3; }, absl::Seconds(5)));
  // The owner releases it; only the stalled request keeps it now.
  const absl::Time released = absl::Now();
  (void)directory_.Remove(1, /*caller=*/0);
  buffer.reset();
  EXPECT_FALSE(alive.expired());
  ASSERT_TRUE(WaitFor([&] { return alive.expired(); }, absl::Seconds(5)))
      << "the stalled WRITE still pins the released registration";
  EXPECT_GE(absl::Now() - released, absl::Milliseconds(300));
  auto received = ReadUntilClosed(fd.get(), absl::Seconds(5));
  ASSERT_TRUE(received.ok()) << received.status();
  EXPECT_EQ(*received, "") << "no response to a request cut short";
}

TEST_F(DataServerTest, EachPipelinedRequestGetsTheRequestTimeoutAnew) {
  // Requests that arrived together are served from the server's buffer; each
  // still gets its own request timeout, so a long pipelined stream whose
  // every request is prompt is never cut.
  DataServerOptions options = Patient();
  options.request_timeout = absl::Milliseconds(400);
  StartServer(options);
  constexpr uint64_t kSize = 1 << 20;
  constexpr int kRequests = 24;
  auto buffer = Register(1, kSize);
  UniqueFd fd = Connect(port());
  ASSERT_TRUE(ReadHello(fd.get()).ok());
  std::string requests;
  for (int i = 0; i < kRequests; ++i) {
    requests += Header(RequestKind::kRead, 1, 0, kSize, "token-1");
  }
  SendAll(fd.get(), requests);
  // Read each answer 100 ms apart: 2.4 s in all, each request 100 ms.
  std::string payload;
  for (int i = 0; i < kRequests; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    std::byte bytes[kResponseHeaderBytes];
    ASSERT_TRUE(ReadFull(fd.get(), bytes, sizeof(bytes)).ok())
        << "cut at request " << i;
    auto response = DecodeResponseHeader(bytes);
    ASSERT_TRUE(response.ok()) << response.status();
    ASSERT_EQ(response->code, 0u);
    payload.resize(response->message_bytes + response->payload_bytes);
    ASSERT_TRUE(ReadFull(fd.get(), payload.data(), payload.size()).ok())
        << "cut at request " << i;
    ASSERT_EQ(std::memcmp(payload.data() + response->message_bytes,
                          buffer->data(), kSize),
              0);
  }
}

TEST_F(DataServerTest, UnreadResponseReleasesTheRegistration) {
  DataServerOptions options = Patient();
  options.request_timeout = absl::Milliseconds(500);
  StartServer(options);
  constexpr uint64_t kSize = 32 << 20;  // far more than socket buffers hold
  auto buffer = Register(1, kSize);
  std::weak_ptr<Registration> alive = buffer;
  UniqueFd fd = Connect(port());
  ASSERT_TRUE(ReadHello(fd.get()).ok());
  // A READ whose response the requester never reads.
  SendAll(fd.get(), Header(RequestKind::kRead, 1, 0, kSize, "token-1"));
  ASSERT_TRUE(
      WaitFor([&] { return buffer.use_count() >= 3; }, absl::Seconds(5)));
  (void)directory_.Remove(1, /*caller=*/0);
  buffer.reset();
  ASSERT_TRUE(WaitFor([&] { return alive.expired(); }, absl::Seconds(5)))
      << "the unread response still pins the released registration";
  EXPECT_TRUE(
      WaitFor([&] { return server_->connections() == 0; }, absl::Seconds(2)));
}

// Accept failing with EMFILE must neither spin nor stop the server: once
// fds come back it serves again and holds no more fds than before.
TEST_F(DataServerTest, OutOfFdsBacksOffAndRecovers) {
  DataServerOptions options = Patient();
  options.max_connections = 100000;  // let fds, not the cap, run out
  options.max_connections_per_source = 100000;
  StartServer(options);
  const int baseline = OpenFds();

  // Client sockets are made first: connecting needs no new fd.
  constexpr int kClients = 64;
  std::vector<UniqueFd> clients;
  int highest = 0;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    ASSERT_TRUE(clients.back());
    highest = std::max(highest, clients.back().get());
  }
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit lowered = saved;
  lowered.rlim_cur = static_cast<rlim_t>(highest) + 1 + 8;  // 8 fds spare
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port());
  inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  for (auto& client : clients) {
    ASSERT_EQ(
        connect(client.get(), reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0)
        << std::strerror(errno);
  }
  // The server takes what fds there are, then accept fails with EMFILE
  // while the rest wait in the backlog.
  ASSERT_TRUE(
      WaitFor([&] { return server_->connections() > 0; }, absl::Seconds(5)));
  const absl::Duration cpu_before = ProcessCpuTime();
  absl::SleepFor(absl::Seconds(1));
  const absl::Duration cpu = ProcessCpuTime() - cpu_before;
  EXPECT_LT(server_->connections(), static_cast<size_t>(kClients));
  EXPECT_LT(cpu, absl::Milliseconds(300)) << "the accept loop spins";

  // The clients leave and fds come back.
  clients.clear();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  EXPECT_TRUE(
      WaitFor([&] { return server_->connections() == 0; }, absl::Seconds(10)));
  EXPECT_TRUE(WaitFor([&] { return OpenFds() <= baseline; }, absl::Seconds(10)))
      << OpenFds() << " fds open, " << baseline << " before";
  UniqueFd later = Connect(port());
  EXPECT_TRUE(ReadHello(later.get()).ok()) << "the server does not recover";
}

// Threads of this process now.
int Threads() {
  int count = 0;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count;
}

// Reads one response (header, message, payload) from blocking `fd`.
absl::StatusOr<ResponseHeader> ReadResponse(int fd, std::string* payload) {
  std::byte bytes[kResponseHeaderBytes];
  if (absl::Status status = ReadFull(fd, bytes, sizeof(bytes)); !status.ok()) {
    return status;
  }
  auto response = DecodeResponseHeader(bytes);
  if (!response.ok()) return response.status();
  std::string rest(response->message_bytes + response->payload_bytes, '\0');
  if (absl::Status status = ReadFull(fd, rest.data(), rest.size());
      !status.ok()) {
    return status;
  }
  *payload = rest.substr(response->message_bytes);
  return response;
}

// Connections are served by the event loops: however many there are, the
// server runs no thread of its own for any of them.
TEST_F(DataServerTest, ConnectionsGetNoThreadsOfTheirOwn) {
  DataServerOptions options = Patient();
  options.threads = 2;
  StartServer(options);
  auto buffer = Register(1, 4096);
  const int threads = Threads();
  std::vector<UniqueFd> held;
  for (int i = 0; i < 32; ++i) {
    held.push_back(Connect(port()));
    ASSERT_TRUE(ReadHello(held.back().get()).ok());
    SendAll(held.back().get(), Header(RequestKind::kRead, 1, i, 8, "token-1"));
  }
  for (auto& fd : held) {
    std::string payload;
    auto response = ReadResponse(fd.get(), &payload);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->code, 0u);
  }
  EXPECT_EQ(server_->connections(), 32u);
  EXPECT_EQ(Threads(), threads);
}

// With one event loop, a peer stalled in the middle of a WRITE and one that
// does not read a large READ's answer hold nothing up: a third connection
// is served meanwhile.
TEST_F(DataServerTest, StalledPeersDoNotHoldUpTheLoop) {
  DataServerOptions options = Patient();
  options.threads = 1;
  StartServer(options);
  constexpr uint64_t kSize = 32 << 20;  // far more than socket buffers hold
  auto buffer = Register(1, kSize);
  UniqueFd half_write = Connect(port());
  UniqueFd unread = Connect(port());
  UniqueFd prompt = Connect(port());
  for (int fd : {half_write.get(), unread.get(), prompt.get()}) {
    ASSERT_TRUE(ReadHello(fd).ok());
  }
  SendAll(half_write.get(),
          Header(RequestKind::kWrite, 1, 0, kSize, "token-1") +
              std::string(1 << 20, 'w'));
  SendAll(unread.get(), Header(RequestKind::kRead, 1, 0, kSize, "token-1"));
  // Both are being served (their registrations pinned) before the third
  // asks.
  ASSERT_TRUE(
      WaitFor([&] { return buffer.use_count() >= 3; }, absl::Seconds(5)));
  for (int i = 0; i < 20; ++i) {
    SendAll(prompt.get(),
            Header(RequestKind::kRead, 1, 4096 * i, 100, "token-1"));
    std::string payload;
    auto response = ReadResponse(prompt.get(), &payload);
    ASSERT_TRUE(response.ok()) << response.status();
    ASSERT_EQ(response->code, 0u);
    EXPECT_EQ(std::memcmp(payload.data(), buffer->data() + 4096 * i, 100), 0);
  }
}

// Large payloads (bulk threads) and small ones (event loops) alike: 8 MiB
// written in one request and read back, with and without bulk threads.
TEST_F(DataServerTest, LargePayloadsRoundTripWithAndWithoutBulkThreads) {
  for (const int bulk_threads : {0, 2}) {
    DataServerOptions options = Patient();
    options.bulk_threads = bulk_threads;
    server_.reset();
    StartServer(options);
    constexpr uint64_t kSize = 8 << 20;
    auto buffer = Register(10 + bulk_threads, kSize);
    const std::string token = absl::StrCat("token-", 10 + bulk_threads);
    UniqueFd fd = Connect(port());
    ASSERT_TRUE(ReadHello(fd.get()).ok());
    std::string written(kSize, '\0');
    for (uint64_t i = 0; i < kSize; ++i) {
      written[i] = static_cast<char>(i * 31 + bulk_threads);
    }
    std::thread writer([&] {
      SendAll(
          fd.get(),
          Header(RequestKind::kWrite, 10 + bulk_threads, 0, kSize, token) +
              written +
              Header(RequestKind::kRead, 10 + bulk_threads, 0, kSize, token));
    });
    std::string payload;
    auto first = ReadResponse(fd.get(), &payload);
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(first->code, 0u) << bulk_threads;
    auto second = ReadResponse(fd.get(), &payload);
    ASSERT_TRUE(second.ok()) << second.status();
    EXPECT_EQ(second->code, 0u) << bulk_threads;
    writer.join();
    EXPECT_TRUE(payload == written) << "bulk threads " << bulk_threads;
  }
}

// Bulk threads only speed large payloads up, they never gate them: with the
// one bulk thread held by a peer that reads its answer slowly, another
// peer's large READ still completes (moved by the event loops).
TEST_F(DataServerTest, ASlowPeerHoldingTheBulkThreadHoldsUpNoOne) {
  DataServerOptions options = Patient();
  options.bulk_threads = 1;
  StartServer(options);
  constexpr uint64_t kSize = 32 << 20;
  auto buffer = Register(1, kSize);
  UniqueFd slow = Connect(port());
  UniqueFd other = Connect(port());
  ASSERT_TRUE(ReadHello(slow.get()).ok());
  ASSERT_TRUE(ReadHello(other.get()).ok());
  SendAll(slow.get(), Header(RequestKind::kRead, 1, 0, kSize, "token-1"));
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    // 32 KiB every 5 ms: always some progress, never done in this test.
    char sink[32 << 10];
    while (!stop) {
      (void)recv(slow.get(), sink, sizeof(sink), MSG_DONTWAIT);
      absl::SleepFor(absl::Milliseconds(5));
    }
  });
  absl::SleepFor(absl::Milliseconds(100));  // the slow one takes the thread
  SendAll(other.get(), Header(RequestKind::kRead, 1, 0, 16 << 20, "token-1"));
  std::string payload;
  auto response = ReadResponse(other.get(), &payload);
  stop = true;
  trickle.join();
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->code, 0u);
  EXPECT_EQ(std::memcmp(payload.data(), buffer->data(), 16 << 20), 0);
}

// A peer that sends requests without reading the answers: the server stops
// reading its requests once a buffer of answers waits, instead of queueing
// answers without bound; it reads on once the peer drains them.
TEST_F(DataServerTest, UndrainedAnswersStopTheReading) {
  DataServerOptions options = Patient();
  options.socket_buffer_bytes = 64 << 10;  // keep the kernel's share small
  StartServer(options);
  auto buffer = Register(1, 1 << 20);
  UniqueFd fd = Connect(port());
  const int small = 64 << 10;
  ASSERT_EQ(setsockopt(fd.get(), SOL_SOCKET, SO_RCVBUF, &small, sizeof(small)),
            0);
  ASSERT_TRUE(ReadHello(fd.get()).ok());
  // 2000 answers of 4 KiB (8 MiB) asked for in ~130 KB of requests.
  constexpr int kRequests = 2000;
  std::string requests;
  for (int i = 0; i < kRequests; ++i) {
    requests +=
        Header(RequestKind::kRead, 1, (i % 256) * 4096, 4096, "token-1");
  }
  std::thread sender([&] { SendAll(fd.get(), requests); });
  ASSERT_TRUE(
      WaitFor([&] { return buffer->bytes_served() > 0; }, absl::Seconds(5)));
  absl::SleepFor(absl::Milliseconds(300));
  // What the server answered so far fits the socket buffers of both ends
  // (the kernel doubles them and grants some slack) and its own queue.
  EXPECT_LT(buffer->bytes_served(), 2u << 20)
      << "answers were queued without bound";
  for (int i = 0; i < kRequests; ++i) {
    std::string payload;
    auto response = ReadResponse(fd.get(), &payload);
    ASSERT_TRUE(response.ok()) << i << ": " << response.status();
    ASSERT_EQ(response->code, 0u) << i;
    ASSERT_EQ(
        std::memcmp(payload.data(), buffer->data() + (i % 256) * 4096, 4096), 0)
        << i;
  }
  sender.join();
  EXPECT_EQ(buffer->bytes_served(), uint64_t{kRequests} * 4096);
}

TEST_F(DataServerTest, RejectsLimitsOutOfRange) {
  for (auto mutate : std::vector<std::function<void(DataServerOptions&)>>{
           [](DataServerOptions& o) {
             o.handshake_timeout = absl::ZeroDuration();
           },
           [](DataServerOptions& o) { o.idle_timeout = -absl::Seconds(1); },
           [](DataServerOptions& o) {
             o.request_timeout = absl::ZeroDuration();
           },
           [](DataServerOptions& o) { o.max_connections_per_source = 0; },
           [](DataServerOptions& o) { o.max_connections = -1; },
           [](DataServerOptions& o) { o.threads = 0; },
           [](DataServerOptions& o) { o.bulk_threads = -1; }}) {
    DataServerOptions options;
    mutate(options);
    EXPECT_EQ(DataServer::Start({"127.0.0.1", 0}, &directory_, options)
                  .status()
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace rdma_agent::tcp
