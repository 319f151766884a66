#ifndef RDMA_AGENTD_TESTS_INTEGRATION_NETNS_H_
#define RDMA_AGENTD_TESTS_INTEGRATION_NETNS_H_

// "Hosts" for cross-host tests: network namespaces joined by a veth pair
// (NetnsPair) or by a bridge (NetnsSwitch), each to run its own rdma-agentd
// (AgentProcess::Options::netns) or etcd member. Needs root (CAP_NET_ADMIN,
// CAP_SYS_ADMIN) and the `ip` tool.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rdma_agent::testing {

// OK when this process can create namespaces (euid 0 and `ip` works);
// otherwise a FAILED_PRECONDITION saying why, for the test to fail loudly.
absl::Status CheckNetnsPrivileges();

// Two namespaces joined by a veth pair: side 0 has 10.77.0.1/24, side 1
// 10.77.0.2/24 (addresses are per namespace, so concurrent pairs never
// clash); names embed the pid and a counter so they never collide. The
// destructor deletes both namespaces (and with them the veth pair). Create
// first deletes pairs left behind by test processes that no longer exist.
class NetnsPair {
 public:
  static absl::StatusOr<std::unique_ptr<NetnsPair>> Create();
  ~NetnsPair();
  NetnsPair(const NetnsPair&) = delete;
  NetnsPair& operator=(const NetnsPair&) = delete;

  const std::string& netns(int side) const { return netns_[side]; }
  const std::string& address(int side) const { return address_[side]; }
  const std::string& link(int side) const { return link_[side]; }
  // Sets side's veth end up or down (from inside its namespace).
  absl::Status SetLink(int side, bool up);
  // Makes `side` know the other side's MAC for good (a permanent neighbour
  // entry), so that when the other side goes silent, packets to it vanish
  // instead of failing neighbour resolution (EHOSTUNREACH): the peer "stops
  // answering" rather than becoming "unreachable".
  absl::Status PinNeighbour(int side);

 private:
  NetnsPair() = default;
  std::string netns_[2];
  std::string address_[2];
  std::string link_[2];
  bool created_[2] = {false, false};
};

// N namespaces ("hosts") on one Ethernet segment: each joined by a veth to a
// Linux bridge in one more (hub) namespace. Host i has 10.78.X.(i+1)/24 on
// its `eth0`, X the instance's number in this process modulo 256; addresses
// live inside the instance's own namespaces, so concurrent switches (other
// tests, other processes) never clash. Names embed the pid and a counter;
// the destructor deletes every namespace (and with them the veths and the
// bridge); Create first deletes switches left behind by test processes that
// no longer exist, and returns once every link is up.
class NetnsSwitch {
 public:
  static absl::StatusOr<std::unique_ptr<NetnsSwitch>> Create(int hosts);
  ~NetnsSwitch();
  NetnsSwitch(const NetnsSwitch&) = delete;
  NetnsSwitch& operator=(const NetnsSwitch&) = delete;

  int size() const { return static_cast<int>(hosts_.size()); }
  const std::string& netns(int i) const { return hosts_[i].netns; }
  const std::string& address(int i) const { return hosts_[i].address; }
  // Sets host i's link to the switch up (returning once it is) or down (from
  // inside its namespace): down cuts it off from every other host.
  absl::Status SetLink(int i, bool up);

 private:
  struct Host {
    std::string netns;
    std::string address;
    bool created = false;
  };
  NetnsSwitch() = default;
  absl::Status Build(const std::string& stem, int subnet, int hosts);

  std::string hub_;
  bool hub_created_ = false;
  std::vector<Host> hosts_;
};

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_INTEGRATION_NETNS_H_
