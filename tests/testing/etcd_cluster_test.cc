// EtcdCluster on loopback: three real members, their endpoints in the
// agent's --directory, a leader that, killed, gives way to another with the
// data kept, and no leader once the quorum is gone. (Members on
// network-namespace hosts: //tests/directory:names_cluster_test.)
#include "tests/testing/etcd_cluster.h"

#include <memory>
#include <set>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/testing/eventually.h"

namespace rdma_agent::testing {
namespace {

constexpr absl::Duration kPatience = absl::Seconds(20);

TEST(EtcdClusterTest, MembersOnLoopbackAreListedInTheDirectory) {
  auto cluster = EtcdCluster::Start(3);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_EQ((*cluster)->size(), 3);
  std::set<std::string> endpoints;
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(absl::StartsWith((*cluster)->endpoint(i), "127.0.0.1:"));
    endpoints.insert((*cluster)->endpoint(i));
  }
  EXPECT_EQ(endpoints.size(), 3u);
  EXPECT_EQ(
      (*cluster)->directory(),
      absl::StrCat("etcd://", (*cluster)->endpoint(0), ",",
                   (*cluster)->endpoint(1), ",", (*cluster)->endpoint(2)));
  EXPECT_EQ((*cluster)->directory({2, 0}),
            absl::StrCat("etcd://", (*cluster)->endpoint(2), ",",
                         (*cluster)->endpoint(0)));
}

TEST(EtcdClusterTest, AKilledLeaderGivesWayAndTheQuorumsLossLeavesNone) {
  auto cluster = EtcdCluster::Start(3);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<int> leader;
  ASSERT_TRUE(Eventually(
      [&] {
        leader = (*cluster)->Leader();
        return leader.ok();
      },
      kPatience))
      << leader.status();
  ASSERT_TRUE((*cluster)->Etcdctl({"put", "/k", "kept"}).ok());

  (*cluster)->Kill(*leader);
  absl::StatusOr<int> next;
  ASSERT_TRUE(Eventually(
      [&] {
        next = (*cluster)->Leader();
        return next.ok();
      },
      kPatience))
      << next.status();
  EXPECT_NE(*next, *leader);
  auto value = (*cluster)->Etcdctl({"get", "--print-value-only", "/k"});
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "kept\n");

  // One member of three left: it cannot lead.
  (*cluster)->Kill(*next);
  absl::StatusOr<int> alone;
  EXPECT_TRUE(Eventually(
      [&] {
        alone = (*cluster)->Leader();
        return !alone.ok();
      },
      kPatience))
      << *alone;
}

}  // namespace
}  // namespace rdma_agent::testing
