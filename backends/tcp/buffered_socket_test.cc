#include "backends/tcp/buffered_socket.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "backends/tcp/socket_util.h"
#include "common/unique_fd.h"
#include "gtest/gtest.h"

namespace rdma_agent::tcp {
namespace {

struct Pair {
  UniqueFd a;
  UniqueFd b;
};

Pair SocketPair() {
  int fds[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  return {UniqueFd(fds[0]), UniqueFd(fds[1])};
}

// A connected loopback TCP pair (splice needs a TCP socket).
Pair TcpPair() {
  uint16_t port = 0;
  auto listener = ListenTcp({"127.0.0.1", 0}, &port);
  EXPECT_TRUE(listener.ok()) << listener.status();
  auto client = DialTcp({"127.0.0.1", port}, absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(client.ok()) << client.status();
  UniqueFd server(::accept4(listener->get(), nullptr, nullptr, SOCK_CLOEXEC));
  EXPECT_TRUE(server);
  return {std::move(server), std::move(*client)};
}

void SetNonBlocking(int fd) {
  ASSERT_EQ(::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK), 0);
}

std::string Pattern(size_t size, char seed) {
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>(seed + i * 7);
  return bytes;
}

// Reads exactly `size` bytes through `io`, waiting as needed.
std::string ReadExactly(BufferedSocket& io, size_t size) {
  std::string got(size, '\0');
  size_t have = 0;
  while (have < size) {
    auto n = io.ReadSome(got.data() + have, size - have, /*wait=*/true);
    EXPECT_TRUE(n.ok()) << n.status();
    if (!n.ok()) break;
    have += *n;
  }
  return got;
}

// Everything `fd` receives until the peer closes.
std::string ReadToEnd(int fd) {
  std::string all;
  char chunk[65536];
  while (true) {
    const ssize_t n = ::recv(fd, chunk, sizeof(chunk), 0);
    if (n <= 0) return all;
    all.append(chunk, static_cast<size_t>(n));
  }
}

TEST(BufferedSocketTest, ManySmallMessagesArriveInOneReceiveAndComeOutInOrder) {
  Pair pair = SocketPair();
  std::string sent;
  for (int i = 0; i < 10; ++i) sent += Pattern(100, static_cast<char>(i));
  ASSERT_EQ(::send(pair.b.get(), sent.data(), sent.size(), 0),
            static_cast<ssize_t>(sent.size()));
  BufferedSocket io(pair.a.get());
  auto received = io.Receive(/*wait=*/true);
  ASSERT_TRUE(received.ok()) << received.status();
  EXPECT_EQ(*received, sent.size()) << "one recv took all of them";
  EXPECT_EQ(io.buffered(), sent.size());
  std::string got(sent.size(), '\0');
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(io.Take(got.data() + i * 100, 100), 100u);
  }
  EXPECT_EQ(got, sent);
  EXPECT_EQ(io.buffered(), 0u);
}

TEST(BufferedSocketTest, LargeAndSmallReadsCrossTheBufferIntact) {
  Pair pair = SocketPair();
  const std::string big = Pattern(3 * BufferedSocket::kBufferBytes + 17, 'a');
  const std::string tail = Pattern(40000, 'z');
  std::thread writer([&] {
    const std::string all = "head" + big + std::string(5000, 'x') + tail;
    size_t off = 0;
    while (off < all.size()) {
      const ssize_t n = ::send(pair.b.get(), all.data() + off,
                               std::min<size_t>(all.size() - off, 7000), 0);
      ASSERT_GT(n, 0);
      off += static_cast<size_t>(n);
    }
  });
  BufferedSocket io(pair.a.get());
  EXPECT_EQ(ReadExactly(io, 4), "head");
  io.ExpectPayload(big.size());
  EXPECT_EQ(ReadExactly(io, big.size()), big);
  EXPECT_EQ(ReadExactly(io, 5000), std::string(5000, 'x'));
  EXPECT_EQ(ReadExactly(io, tail.size()), tail);
  writer.join();
}

TEST(BufferedSocketTest, ReceivingWithoutWaitingSaysNothingArrivedWithZero) {
  Pair pair = SocketPair();
  BufferedSocket io(pair.a.get());
  auto nothing = io.Receive(/*wait=*/false);
  ASSERT_TRUE(nothing.ok()) << nothing.status();
  EXPECT_EQ(*nothing, 0u);
  ASSERT_EQ(::send(pair.b.get(), "abc", 3, 0), 3);
  auto some = io.Receive(/*wait=*/false);
  ASSERT_TRUE(some.ok()) << some.status();
  EXPECT_EQ(*some, 3u);
  char got[3];
  EXPECT_EQ(io.Take(got, sizeof(got)), 3u);
  EXPECT_EQ(std::string(got, 3), "abc");
  // A wait ended by the socket's receive timeout is "nothing yet" too.
  timeval short_wait{0, 20000};
  ASSERT_EQ(::setsockopt(pair.a.get(), SOL_SOCKET, SO_RCVTIMEO, &short_wait,
                         sizeof(short_wait)),
            0);
  auto timed_out = io.Receive(/*wait=*/true);
  ASSERT_TRUE(timed_out.ok()) << timed_out.status();
  EXPECT_EQ(*timed_out, 0u);
  char payload[BufferedSocket::kDirectBytes];
  auto none = io.ReadSome(payload, sizeof(payload), /*wait=*/false);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, 0u);
}

TEST(BufferedSocketTest, LargePayloadsGoDirectAndTheNextFillStaysSmall) {
  Pair pair = SocketPair();
  // Three messages of a header and a payload that goes direct, all sent
  // before the reader starts.
  const std::string payload = Pattern(BufferedSocket::kDirectBytes * 2, 'p');
  const std::string message = "HEADER--" + payload;
  std::thread writer([&] {
    const std::string all = message + message + message;
    size_t off = 0;
    while (off < all.size()) {
      const ssize_t n =
          ::send(pair.b.get(), all.data() + off, all.size() - off, 0);
      ASSERT_GT(n, 0);
      off += static_cast<size_t>(n);
    }
  });
  BufferedSocket io(pair.a.get());
  for (int i = 0; i < 3; ++i) {
    while (io.buffered() < 8) {
      auto received = io.Receive(/*wait=*/true);
      ASSERT_TRUE(received.ok()) << received.status();
    }
    if (i > 0) {
      // Right after a large payload: a small fill, so most of this payload
      // is still in the socket and can go direct.
      EXPECT_LE(io.buffered(), BufferedSocket::kHeaderFillBytes) << i;
    }
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(io.data()), 8),
              "HEADER--");
    io.Consume(8);
    io.ExpectPayload(payload.size());
    EXPECT_EQ(ReadExactly(io, payload.size()), payload) << i;
  }
  writer.join();
}

TEST(BufferedSocketTest, ResetStartsOverOnAnotherSocketAndIdleBuffersGo) {
  Pair first = SocketPair();
  Pair second = SocketPair();
  BufferedSocket io;
  io.Reset(first.a.get());
  ASSERT_EQ(::send(first.b.get(), "stale", 5, 0), 5);
  ASSERT_TRUE(io.Receive(/*wait=*/true).ok());
  io.ReleaseIfEmpty();  // not empty: kept
  EXPECT_EQ(io.buffered(), 5u);
  io.Reset(second.a.get());
  EXPECT_EQ(io.buffered(), 0u);
  io.ReleaseIfEmpty();
  ASSERT_EQ(::send(second.b.get(), "fresh", 5, 0), 5);
  EXPECT_EQ(ReadExactly(io, 5), "fresh");
}

TEST(BufferedSocketTest, PeerClosingIsUnavailableAndSaysSo) {
  Pair pair = SocketPair();
  BufferedSocket io(pair.a.get());
  pair.b.reset();
  EXPECT_EQ(io.Receive(/*wait=*/false).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_TRUE(io.peer_closed());
  char byte;
  EXPECT_EQ(io.ReadSome(&byte, 1, /*wait=*/true).status().code(),
            absl::StatusCode::kUnavailable);
  // A failed socket is not a peer's clean close.
  Pair other = SocketPair();
  BufferedSocket failed(other.a.get());
  ::shutdown(other.a.get(), SHUT_RDWR);
  other.a.reset();
  EXPECT_FALSE(failed.Receive(/*wait=*/false).ok());
  EXPECT_FALSE(failed.peer_closed());
}

TEST(SendQueueTest, CopiesAndReferencesLeaveInOrderAndReferencesAreLetGo) {
  Pair pair = SocketPair();
  SetNonBlocking(pair.a.get());
  SendQueue queue;
  const std::string big = Pattern(4 << 20, 'r');  // far more than fits
  auto keep_alive = std::make_shared<int>(1);
  std::weak_ptr<int> watch = keep_alive;
  queue.Append("first,", 6);
  queue.Append("second,", 7);  // joins the first copy
  queue.EndMessage();
  queue.AppendReference(reinterpret_cast<const std::byte*>(big.data()),
                        big.size(), std::move(keep_alive), /*splice=*/false);
  queue.Append(",last", 5);
  queue.EndMessage();
  EXPECT_EQ(queue.copied_bytes(), 18u);
  EXPECT_TRUE(queue.holds_reference());
  std::string received;
  std::thread reader([&] { received = ReadToEnd(pair.b.get()); });
  // The socket takes part, then would block: Send returns with the rest
  // queued and the message half sent.
  ASSERT_TRUE(queue.Send(pair.a.get(), nullptr).ok());
  while (!queue.empty()) {
    EXPECT_TRUE(queue.holds_reference() || queue.copied_bytes() > 0);
    ASSERT_TRUE(queue.Send(pair.a.get(), nullptr).ok());
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_FALSE(queue.partly_sent());
  EXPECT_FALSE(queue.holds_reference());
  EXPECT_EQ(queue.copied_bytes(), 0u);
  EXPECT_TRUE(watch.expired()) << "the reference was kept after it was sent";
  ::shutdown(pair.a.get(), SHUT_WR);
  reader.join();
  EXPECT_EQ(received, "first,second," + big + ",last");
}

TEST(SendQueueTest, AMessageCutInTheMiddleIsReported) {
  Pair pair = SocketPair();
  SetNonBlocking(pair.a.get());
  SendQueue queue;
  const std::string big = Pattern(8 << 20, 'c');
  queue.Append("whole", 5);
  queue.EndMessage();
  EXPECT_FALSE(queue.partly_sent());
  queue.Append(big.data(), big.size());  // more than the socket takes
  queue.EndMessage();
  ASSERT_TRUE(queue.Send(pair.a.get(), nullptr).ok());
  EXPECT_FALSE(queue.empty());
  EXPECT_TRUE(queue.partly_sent());
  // The peer going away is an error, not "later".
  pair.b.reset();
  absl::Status status = absl::OkStatus();
  for (int i = 0; i < 100 && status.ok() && !queue.empty(); ++i) {
    status = queue.Send(pair.a.get(), nullptr);
  }
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
}

TEST(SendQueueTest, SplicedReferencesKeepTheirPlaceInTheStream) {
  Pair pair = TcpPair();
  SetNonBlocking(pair.a.get());
  auto pages = PageSender::Create();
  ASSERT_TRUE(pages.ok()) << pages.status();
  // More than the pipe and the socket hold at once.
  constexpr size_t kBig = 3 * PageSender::kPipeBytes + 4097;
  std::unique_ptr<std::byte[]> big(new std::byte[kBig]);
  for (size_t i = 0; i < kBig; ++i) big[i] = static_cast<std::byte>(i * 13);
  SendQueue queue;
  queue.Append("<", 1);
  queue.AppendReference(big.get(), kBig, nullptr, /*splice=*/true);
  queue.Append(">", 1);
  queue.EndMessage();
  std::string received;
  std::thread reader([&] { received = ReadToEnd(pair.b.get()); });
  while (!queue.empty()) {
    ASSERT_TRUE(queue.Send(pair.a.get(), &*pages).ok());
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(pages->pending(), 0u);
  ::shutdown(pair.a.get(), SHUT_WR);
  reader.join();
  ASSERT_EQ(received.size(), kBig + 2);
  EXPECT_EQ(received.front(), '<');
  EXPECT_EQ(received.back(), '>');
  EXPECT_EQ(std::memcmp(received.data() + 1, big.get(), kBig), 0);
}

}  // namespace
}  // namespace rdma_agent::tcp
