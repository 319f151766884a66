#include "daemon/systemd_notifier.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "common/unique_fd.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace rdma_agent {
namespace {

// A datagram socket standing in for systemd's notify socket.
class FakeServiceManager {
 public:
  explicit FakeServiceManager(const std::string& path) : path_(path) {
    fd_.reset(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    sockaddr_un address = {};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
    EXPECT_EQ(::bind(fd_.get(), reinterpret_cast<sockaddr*>(&address),
                     sizeof(address)),
              0);
    timeval timeout = {5, 0};
    ::setsockopt(fd_.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  }
  std::string Next() {
    char buffer[4096];
    const ssize_t n = ::recv(fd_.get(), buffer, sizeof(buffer), 0);
    return n > 0 ? std::string(buffer, static_cast<size_t>(n)) : "";
  }

 private:
  std::string path_;
  UniqueFd fd_;
};

TEST(SystemdNotifierTest, WithoutAServiceManagerEverythingIsANoOp) {
  ::unsetenv("NOTIFY_SOCKET");
  ::unsetenv("WATCHDOG_USEC");
  SystemdNotifier notifier;
  EXPECT_FALSE(notifier.enabled());
  EXPECT_EQ(notifier.watchdog_interval(), absl::ZeroDuration());
  notifier.Ready("serving");  // must not crash or block
}

TEST(SystemdNotifierTest, SendsReadyStatusWatchdogAndStopping) {
  auto dir = testing::MakeShortTempDir();
  ASSERT_TRUE(dir.ok()) << dir.status();
  const std::string path = *dir + "/notify";
  FakeServiceManager manager(path);
  ::setenv("NOTIFY_SOCKET", path.c_str(), 1);
  ::setenv("WATCHDOG_USEC", "2000000", 1);
  ::setenv("WATCHDOG_PID", std::to_string(::getpid()).c_str(), 1);
  SystemdNotifier notifier;
  EXPECT_TRUE(notifier.enabled());
  EXPECT_EQ(notifier.watchdog_interval(), absl::Seconds(2));
  notifier.Ready("serving unix:///run/x\nforged=1");
  EXPECT_EQ(manager.Next(), "READY=1\nSTATUS=serving unix:///run/x forged=1");
  notifier.Status("3 buffers");
  EXPECT_EQ(manager.Next(), "STATUS=3 buffers");
  notifier.WatchdogPing();
  EXPECT_EQ(manager.Next(), "WATCHDOG=1");
  notifier.Stopping("signal 15");
  EXPECT_EQ(manager.Next(), "STOPPING=1\nSTATUS=signal 15");
  // A watchdog meant for another process is not ours.
  ::setenv("WATCHDOG_PID", "1", 1);
  EXPECT_EQ(SystemdNotifier().watchdog_interval(), absl::ZeroDuration());
  ::unsetenv("NOTIFY_SOCKET");
  testing::RemoveTree(*dir);
}

}  // namespace
}  // namespace rdma_agent
