#include "common/revocable_callback.h"

#include <atomic>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

TEST(RevocableCallbackTest, RunsUntilRevoked) {
  int calls = 0;
  RevocableCallback callback([&] { ++calls; });
  callback.Run();
  callback.Run();
  EXPECT_EQ(calls, 2);
  callback.Revoke();
  callback.Run();
  EXPECT_EQ(calls, 2);
  callback.Revoke();  // idempotent
}

TEST(RevocableCallbackTest, RevokeWaitsForARunningCallback) {
  absl::Notification entered, release;
  std::atomic<bool> returned{false};
  RevocableCallback callback([&] {
    entered.Notify();
    release.WaitForNotification();
    returned = true;
  });
  std::thread runner([&] { callback.Run(); });
  entered.WaitForNotification();
  std::atomic<bool> revoked{false};
  std::thread revoker([&] {
    callback.Revoke();
    // Only once the callback has returned: its owner may go now.
    EXPECT_TRUE(returned);
    revoked = true;
  });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(revoked) << "Revoke returned while the callback ran";
  release.Notify();
  revoker.join();
  runner.join();
  EXPECT_TRUE(revoked);
}

}  // namespace
}  // namespace rdma_agent
