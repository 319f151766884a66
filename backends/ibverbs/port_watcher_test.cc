// PortWatcher over the software NIC: port events reach the callback in
// order, other devices' do not, and nothing is called after it is gone.
#include "backends/ibverbs/port_watcher.h"

#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "gtest/gtest.h"

namespace rdma_agent::ibverbs {
namespace {

using verbs::SoftDeviceConfig;
using verbs::SoftFabric;

// What a watcher reported, waited on by the test.
class Reports {
 public:
  void Add(uint8_t port, bool active) {
    absl::MutexLock lock(&mu_);
    got_.push_back({port, active});
  }
  // The reports once there are `n` (or after 5 s).
  std::vector<std::pair<int, bool>> Await(size_t n) {
    absl::MutexLock lock(&mu_);
    const auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return got_.size() >= n;
    };
    mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(5));
    return got_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<int, bool>> got_ ABSL_GUARDED_BY(mu_);
};

TEST(PortWatcherTest, HandsOnTheDevicesPortEventsInOrder) {
  SoftFabric fabric;
  for (const char* name : {"w0", "w1"}) {
    SoftDeviceConfig config;
    config.name = name;
    config.port_state = IBV_PORT_DOWN;
    ASSERT_TRUE(fabric.AddDevice(config).ok());
  }
  auto device = fabric.MakeVerbs()->OpenDevice("w0");
  ASSERT_TRUE(device.ok());
  Reports reports;
  auto watcher = std::make_unique<PortWatcher>(
      device->get(),
      [&](uint8_t port, bool active) { reports.Add(port, active); },
      absl::Milliseconds(10));
  ASSERT_TRUE(fabric.SetPortState("w1", IBV_PORT_ACTIVE).ok());  // not ours
  ASSERT_TRUE(fabric.SetPortState("w0", IBV_PORT_ACTIVE).ok());
  ASSERT_TRUE(fabric.Unplug("w0").ok());
  ASSERT_TRUE(fabric.Replug("w0").ok());
  EXPECT_EQ(reports.Await(3), (std::vector<std::pair<int, bool>>{
                                  {1, true}, {1, false}, {1, true}}));
  // Gone: later events reach nobody.
  watcher.reset();
  ASSERT_TRUE(fabric.Unplug("w0").ok());
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(reports.Await(0).size(), 3u);
}

}  // namespace
}  // namespace rdma_agent::ibverbs
