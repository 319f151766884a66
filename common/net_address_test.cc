// host:port handling shared by the agent's listeners and the tcp backend.
#include "common/net_address.h"

#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

TEST(NetAddressTest, ParsesAndFormatsAddresses) {
  auto v4 = ParseHostPort("10.1.2.3:7471");
  ASSERT_TRUE(v4.ok());
  EXPECT_EQ(v4->host, "10.1.2.3");
  EXPECT_EQ(v4->port, 7471);
  auto v6 = ParseHostPort("[::1]:0");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->port, 0);
  EXPECT_EQ(JoinHostPort("::1", 5), "[::1]:5");
  EXPECT_EQ(JoinHostPort("h", 5), "h:5");
  for (const char* bad :
       {"nohost", "::1:5", "h:99999", "h:x", "[::1]5", "h:"}) {
    EXPECT_EQ(ParseHostPort(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_TRUE(IsWildcardHost("0.0.0.0"));
  EXPECT_TRUE(IsWildcardHost("::"));
  EXPECT_TRUE(IsWildcardHost(""));
  EXPECT_TRUE(IsWildcardHost("*"));
  EXPECT_FALSE(IsWildcardHost("127.0.0.1"));
}

TEST(NetAddressTest, AdvertisedHostPrefersTheChoiceThenTheBoundAddress) {
  // An operator's choice wins (NAT).
  EXPECT_EQ(AdvertisedHost("127.0.0.1", "10.9.8.7", "10.1.1.1"), "10.9.8.7");
  // A listener bound to one address is reachable only there.
  EXPECT_EQ(AdvertisedHost("127.0.0.1", "", "10.1.1.1"), "127.0.0.1");
  // A wildcard listener takes the detected host, else loopback.
  EXPECT_EQ(AdvertisedHost("0.0.0.0", "", "10.1.1.1"), "10.1.1.1");
  EXPECT_EQ(AdvertisedHost("::", "", ""), "127.0.0.1");
  // A wildcard is never advertised, whoever gave it.
  EXPECT_EQ(AdvertisedHost("10.2.2.2", "0.0.0.0", "10.1.1.1"), "10.2.2.2");
  EXPECT_EQ(AdvertisedHost("0.0.0.0", "0.0.0.0", "0.0.0.0"), "127.0.0.1");
}

TEST(NetAddressTest, DefaultAdvertiseHostIsNeverAWildcard) {
  EXPECT_FALSE(IsWildcardHost(DefaultAdvertiseHost()));
}

}  // namespace
}  // namespace rdma_agent
