// NetnsSwitch: real namespaces on a real bridge. Every host reaches every
// other over TCP, a downed link cuts just that host off, two switches live
// side by side, and nothing is left behind (the destructor, and the sweep of
// switches whose test process died). Needs root: it fails without it.
#include "tests/integration/netns.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/unique_fd.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"

namespace rdma_agent::testing {
namespace {

constexpr uint16_t kPort = 7000;

// A TCP socket of namespace `netns`: made by a thread that joined it (a
// socket stays in the namespace it was made in; this thread never moves).
absl::StatusOr<UniqueFd> SocketIn(const std::string& netns) {
  absl::StatusOr<UniqueFd> made;
  std::thread([&] {
    UniqueFd ns(
        open(("/var/run/netns/" + netns).c_str(), O_RDONLY | O_CLOEXEC));
    if (!ns || setns(ns.get(), CLONE_NEWNET) != 0) {
      made = absl::ErrnoToStatus(errno, "joining " + netns);
      return;
    }
    made = UniqueFd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!made->valid()) made = absl::ErrnoToStatus(errno, "socket");
  }).join();
  return made;
}

sockaddr_in Address(const std::string& address) {
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(kPort);
  inet_pton(AF_INET, address.c_str(), &to.sin_addr);
  return to;
}

// A listener on host i's address, in its namespace.
absl::StatusOr<UniqueFd> Listen(const NetnsSwitch& net, int i) {
  auto fd = SocketIn(net.netns(i));
  if (!fd.ok()) return fd.status();
  const sockaddr_in at = Address(net.address(i));
  if (bind(fd->get(), reinterpret_cast<const sockaddr*>(&at), sizeof(at)) !=
          0 ||
      listen(fd->get(), 16) != 0) {
    return absl::ErrnoToStatus(errno, "listening on " + net.address(i));
  }
  return fd;
}

// OK when a TCP connection from host `from` to host `to` is accepted within
// three seconds (a lost first SYN is sent again after one); else why not.
absl::Status Connect(const NetnsSwitch& net, int from, int to) {
  auto fd = SocketIn(net.netns(from));
  if (!fd.ok()) return fd.status();
  fcntl(fd->get(), F_SETFL, O_NONBLOCK);
  const sockaddr_in at = Address(net.address(to));
  if (connect(fd->get(), reinterpret_cast<const sockaddr*>(&at), sizeof(at)) ==
      0) {
    return absl::OkStatus();
  }
  if (errno != EINPROGRESS) return absl::ErrnoToStatus(errno, "connect");
  pollfd wait = {fd->get(), POLLOUT, 0};
  if (poll(&wait, 1, 3000) != 1) {
    return absl::DeadlineExceededError("no answer within three seconds");
  }
  int error = 0;
  socklen_t length = sizeof(error);
  getsockopt(fd->get(), SOL_SOCKET, SO_ERROR, &error, &length);
  return error == 0 ? absl::OkStatus() : absl::ErrnoToStatus(error, "connect");
}

// Whether `ip netns list` shows `name` ("name" or "name (id: N)" a line).
bool NetnsExists(const std::string& name) {
  auto list = RunCommand({"ip", "netns", "list"});
  if (!list.ok()) return false;
  for (absl::string_view line : absl::StrSplit(*list, '\n')) {
    if (line.substr(0, line.find(' ')) == name) return true;
  }
  return false;
}

class NetnsSwitchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Not root: fail loudly, never pass silently.
    ASSERT_TRUE(CheckNetnsPrivileges().ok()) << CheckNetnsPrivileges();
  }
};

TEST_F(NetnsSwitchTest, EveryHostReachesEveryOther) {
  auto net = NetnsSwitch::Create(3);
  ASSERT_TRUE(net.ok()) << net.status();
  ASSERT_EQ((*net)->size(), 3);
  UniqueFd listeners[3];
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(absl::StartsWith((*net)->address(i), "10.78."));
    auto listener = Listen(**net, i);
    ASSERT_TRUE(listener.ok()) << listener.status();
    listeners[i] = std::move(*listener);
  }
  for (int from = 0; from < 3; ++from) {
    for (int to = 0; to < 3; ++to) {
      if (from == to) continue;
      EXPECT_TRUE(Connect(**net, from, to).ok())
          << from << " -> " << to << ": " << Connect(**net, from, to);
    }
  }
}

TEST_F(NetnsSwitchTest, ALinkDownCutsOffThatHostOnly) {
  auto net = NetnsSwitch::Create(3);
  ASSERT_TRUE(net.ok()) << net.status();
  UniqueFd listeners[3];
  for (int i = 0; i < 3; ++i) {
    auto listener = Listen(**net, i);
    ASSERT_TRUE(listener.ok()) << listener.status();
    listeners[i] = std::move(*listener);
  }
  ASSERT_TRUE((*net)->SetLink(1, false).ok());
  EXPECT_FALSE(Connect(**net, 0, 1).ok());
  EXPECT_FALSE(Connect(**net, 1, 0).ok());
  EXPECT_FALSE(Connect(**net, 2, 1).ok());
  EXPECT_TRUE(Connect(**net, 0, 2).ok()) << Connect(**net, 0, 2);
  EXPECT_TRUE(Connect(**net, 2, 0).ok()) << Connect(**net, 2, 0);

  // Up again (SetLink returns once it is): reached and reaching again.
  ASSERT_TRUE((*net)->SetLink(1, true).ok());
  EXPECT_TRUE(Connect(**net, 0, 1).ok()) << Connect(**net, 0, 1);
  EXPECT_TRUE(Connect(**net, 1, 2).ok()) << Connect(**net, 1, 2);
}

TEST_F(NetnsSwitchTest, TwoSwitchesLiveSideBySide) {
  auto first = NetnsSwitch::Create(2);
  auto second = NetnsSwitch::Create(2);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE((*first)->netns(0), (*second)->netns(0));
  EXPECT_NE((*first)->address(0), (*second)->address(0));
  for (const auto* net : {&*first, &*second}) {
    auto listener = Listen(**net, 1);
    ASSERT_TRUE(listener.ok()) << listener.status();
    EXPECT_TRUE(Connect(**net, 0, 1).ok()) << Connect(**net, 0, 1);
  }
}

TEST_F(NetnsSwitchTest, TheDestructorDeletesEveryNamespace) {
  auto net = NetnsSwitch::Create(2);
  ASSERT_TRUE(net.ok()) << net.status();
  const std::string host0 = (*net)->netns(0);
  const std::string host1 = (*net)->netns(1);
  ASSERT_TRUE(NetnsExists(host0));
  ASSERT_TRUE(NetnsExists(host1));
  net->reset();
  EXPECT_FALSE(NetnsExists(host0));
  EXPECT_FALSE(NetnsExists(host1));
  auto list = RunCommand({"ip", "netns", "list"});
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_FALSE(absl::StrContains(*list, absl::StrCat("ratsw", getpid(), "x")))
      << *list;
}

TEST_F(NetnsSwitchTest, CreateSweepsSwitchesOfDeadProcesses) {
  // A pid that no longer runs: a child that has ended and been reaped.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  const std::string stale = absl::StrCat("ratsw", child, "x0hub");
  ASSERT_TRUE(RunCommand({"ip", "netns", "add", stale}).ok());
  auto net = NetnsSwitch::Create(1);
  ASSERT_TRUE(net.ok()) << net.status();
  EXPECT_FALSE(NetnsExists(stale));
  (void)RunCommand({"ip", "netns", "delete", stale});
}

}  // namespace
}  // namespace rdma_agent::testing
