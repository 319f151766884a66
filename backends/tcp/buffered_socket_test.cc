#include "backends/tcp/buffered_socket.h"

#include <sys/socket.h>
#include <sys/time.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

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

std::string Pattern(size_t size, char seed) {
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>(seed + i * 7);
  return bytes;
}

TEST(BufferedSocketTest, ManySmallMessagesArriveInOneFillAndReadBackInOrder) {
  Pair pair = SocketPair();
  std::string sent;
  for (int i = 0; i < 10; ++i) sent += Pattern(100, static_cast<char>(i));
  ASSERT_EQ(::send(pair.b.get(), sent.data(), sent.size(), 0),
            static_cast<ssize_t>(sent.size()));
  BufferedSocket io(pair.a.get());
  ASSERT_TRUE(io.Fill().ok());
  EXPECT_EQ(io.buffered(), sent.size()) << "one recv took all of them";
  std::string got(sent.size(), '\0');
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(io.Read(got.data() + i * 100, 100).ok());
  }
  EXPECT_EQ(got, sent);
  EXPECT_EQ(io.buffered(), 0u);
}

TEST(BufferedSocketTest, LargeReadsAndSkipsCrossTheBufferIntact) {
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
  std::string head(4, '\0');
  ASSERT_TRUE(io.Read(head.data(), 4).ok());
  EXPECT_EQ(head, "head");
  std::string got(big.size(), '\0');
  ASSERT_TRUE(io.Read(got.data(), got.size()).ok());
  EXPECT_EQ(got, big);
  ASSERT_TRUE(io.Skip(5000).ok());
  std::string last(tail.size(), '\0');
  ASSERT_TRUE(io.Read(last.data(), last.size()).ok());
  EXPECT_EQ(last, tail);
  writer.join();
}

TEST(BufferedSocketTest, WritesWaitForFlushOrAFillAndLargeOnesKeepOrder) {
  Pair pair = SocketPair();
  BufferedSocket io(pair.a.get());
  ASSERT_TRUE(io.Write("one,", 4).ok());
  ASSERT_TRUE(io.Write("two,", 4).ok());
  EXPECT_EQ(io.unflushed(), 8u);
  char peek[16];
  EXPECT_EQ(::recv(pair.b.get(), peek, sizeof(peek), MSG_DONTWAIT), -1)
      << "nothing sent before a flush";
  // Waiting for the peer sends what is queued first (no deadlock with a
  // peer that waits for answers before asking more).
  std::thread peer([&] {
    char got[8];
    ASSERT_EQ(::recv(pair.b.get(), got, 8, MSG_WAITALL), 8);
    EXPECT_EQ(std::string(got, 8), "one,two,");
    ASSERT_EQ(::send(pair.b.get(), "!", 1, 0), 1);
  });
  ASSERT_TRUE(io.Fill().ok());
  peer.join();
  EXPECT_EQ(io.unflushed(), 0u);
  // A large write goes out after what was queued, in order.
  const std::string big = Pattern(BufferedSocket::kBufferBytes * 2, 'q');
  ASSERT_TRUE(io.Write("x", 1).ok());
  std::thread reader([&] {
    std::string got(big.size() + 1, '\0');
    ASSERT_EQ(::recv(pair.b.get(), got.data(), got.size(), MSG_WAITALL),
              static_cast<ssize_t>(got.size()));
    EXPECT_EQ(got, "x" + big);
  });
  ASSERT_TRUE(io.Write(big.data(), big.size()).ok());
  reader.join();
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
  // Header, a payload that goes direct, then two more such messages, all
  // sent before the reader starts.
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
    std::string got(payload.size(), '\0');
    size_t have = io.Take(got.data(), got.size());
    while (have < got.size()) {
      auto n = io.ReadSome(got.data() + have, got.size() - have, true);
      ASSERT_TRUE(n.ok()) << n.status();
      have += *n;
    }
    EXPECT_EQ(got, payload) << i;
  }
  writer.join();
}

TEST(BufferedSocketTest, ResetStartsOverOnAnotherSocket) {
  Pair first = SocketPair();
  Pair second = SocketPair();
  BufferedSocket io;
  io.Reset(first.a.get());
  ASSERT_EQ(::send(first.b.get(), "stale", 5, 0), 5);
  ASSERT_TRUE(io.Receive(/*wait=*/true).ok());
  ASSERT_TRUE(io.Write("queued", 6).ok());
  io.Reset(second.a.get());
  EXPECT_EQ(io.buffered(), 0u);
  EXPECT_EQ(io.unflushed(), 0u);
  ASSERT_EQ(::send(second.b.get(), "fresh", 5, 0), 5);
  char got[5];
  ASSERT_TRUE(io.Read(got, sizeof(got)).ok());
  EXPECT_EQ(std::string(got, 5), "fresh");
}

TEST(BufferedSocketTest, PeerClosingIsUnavailable) {
  Pair pair = SocketPair();
  BufferedSocket io(pair.a.get());
  pair.b.reset();
  EXPECT_EQ(io.Fill().code(), absl::StatusCode::kUnavailable);
  char byte;
  EXPECT_EQ(io.Read(&byte, 1).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(io.Receive(/*wait=*/false).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(io.ReadSome(&byte, 1, /*wait=*/true).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace rdma_agent::tcp
