#include "daemon/exe/systemd_notifier.h"

#include <stdlib.h>
#include <unistd.h>

#include <string>

#include "gtest/gtest.h"
#include "tests/testing/fake_service_manager.h"
#include "tests/testing/temp_dir.h"

namespace rdma_agent {
namespace {

using ::rdma_agent::testing::FakeServiceManager;

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
  auto manager = FakeServiceManager::Bind(path);
  ASSERT_TRUE(manager.ok()) << manager.status();
  ::setenv("NOTIFY_SOCKET", path.c_str(), 1);
  ::setenv("WATCHDOG_USEC", "2000000", 1);
  ::setenv("WATCHDOG_PID", std::to_string(::getpid()).c_str(), 1);
  SystemdNotifier notifier;
  EXPECT_TRUE(notifier.enabled());
  EXPECT_EQ(notifier.watchdog_interval(), absl::Seconds(2));
  notifier.Ready("serving unix:///run/x\nforged=1");
  EXPECT_EQ(manager->Next(absl::Seconds(5)).value_or(""),
            "READY=1\nSTATUS=serving unix:///run/x forged=1");
  notifier.Status("3 buffers");
  EXPECT_EQ(manager->Next(absl::Seconds(5)).value_or(""), "STATUS=3 buffers");
  notifier.WatchdogPing();
  EXPECT_EQ(manager->Next(absl::Seconds(5)).value_or(""), "WATCHDOG=1");
  notifier.Stopping("signal 15");
  EXPECT_EQ(manager->Next(absl::Seconds(5)).value_or(""),
            "STOPPING=1\nSTATUS=signal 15");
  // A watchdog meant for another process is not ours.
  ::setenv("WATCHDOG_PID", "1", 1);
  EXPECT_EQ(SystemdNotifier().watchdog_interval(), absl::ZeroDuration());
  // Without WATCHDOG_PID it is (what the daemon's process test relies on:
  // it cannot know the child's pid before starting it).
  ::unsetenv("WATCHDOG_PID");
  EXPECT_EQ(SystemdNotifier().watchdog_interval(), absl::Seconds(2));
  ::unsetenv("NOTIFY_SOCKET");
  testing::RemoveTree(*dir);
}

}  // namespace
}  // namespace rdma_agent
