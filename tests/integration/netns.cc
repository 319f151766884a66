#include "tests/integration/netns.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/testing/process.h"

namespace rdma_agent::testing {
namespace {

constexpr char kNetnsPrefix[] = "ratcp";
constexpr char kSwitchPrefix[] = "ratsw";
// Every host's end of its veth (alone in its namespace, so the same name).
constexpr char kHostLink[] = "eth0";
constexpr char kBridge[] = "br0";

bool ProcessAlive(pid_t pid) { return kill(pid, 0) == 0 || errno == EPERM; }

// Deletes namespaces named `prefix`<pid>x... of earlier test processes that
// died before cleaning up.
void SweepStaleNamespaces(absl::string_view prefix) {
  auto list = RunCommand({"ip", "netns", "list"});
  if (!list.ok()) return;
  for (absl::string_view line : absl::StrSplit(*list, '\n')) {
    const std::string name(line.substr(0, line.find(' ')));
    if (!absl::StartsWith(name, prefix)) continue;
    // <prefix><pid>x<n><side or host>
    const std::string rest = name.substr(prefix.size());
    int pid = 0;
    if (!absl::SimpleAtoi(rest.substr(0, rest.find('x')), &pid)) continue;
    if (pid > 0 && !ProcessAlive(pid)) {
      (void)RunCommand({"ip", "netns", "delete", name});
    }
  }
}

// Runs `commands` in order; the first failure ends it.
absl::Status RunAll(const std::vector<std::vector<std::string>>& commands) {
  for (const std::vector<std::string>& command : commands) {
    if (auto done = RunCommand(command); !done.ok()) return done.status();
  }
  return absl::OkStatus();
}

// Waits until `link` in `netns` is operationally up (a veth: both ends up),
// so that the first packets sent are not dropped.
absl::Status AwaitLinkUp(const std::string& netns, const std::string& link) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::string last;
  while (true) {
    auto shown = RunCommand({"ip", "-n", netns, "-o", "link", "show", link});
    if (!shown.ok()) return shown.status();
    if (absl::StrContains(*shown, " state UP ")) return absl::OkStatus();
    last = *shown;
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(link, " in ", netns, " is not up: ", last));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

}  // namespace

absl::Status CheckNetnsPrivileges() {
  if (geteuid() != 0) {
    return absl::FailedPreconditionError(
        "cross-host tcp tests need root (network namespaces and veth pairs); "
        "run them as root, e.g. in CI: sudo bazel test "
        "//tests/integration/...");
  }
  auto version = RunCommand({"ip", "-V"});
  if (!version.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the `ip` tool (iproute2) is needed: ", version.status().message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<NetnsPair>> NetnsPair::Create() {
  if (absl::Status status = CheckNetnsPrivileges(); !status.ok()) {
    return status;
  }
  SweepStaleNamespaces(kNetnsPrefix);
  static std::atomic<int> counter{0};
  const int n = counter.fetch_add(1);
  const std::string stem = absl::StrCat(kNetnsPrefix, getpid(), "x", n);
  std::unique_ptr<NetnsPair> pair(new NetnsPair());
  const char* const sides[2] = {"a", "b"};
  for (int side = 0; side < 2; ++side) {
    pair->netns_[side] = absl::StrCat(stem, sides[side]);
    // Interface names are at most 15 characters: keep them short.
    pair->link_[side] =
        absl::StrCat("v", getpid() % 1000000, "x", n % 100, sides[side]);
    pair->address_[side] = absl::StrCat("10.77.0.", side + 1);
  }
  for (int side = 0; side < 2; ++side) {
    auto made = RunCommand({"ip", "netns", "add", pair->netns_[side]});
    if (!made.ok()) return made.status();
    pair->created_[side] = true;
  }
  const std::vector<std::vector<std::string>> setup = {
      {"ip", "link", "add", pair->link_[0], "netns", pair->netns_[0], "type",
       "veth", "peer", "name", pair->link_[1], "netns", pair->netns_[1]},
  };
  for (const auto& command : setup) {
    if (auto done = RunCommand(command); !done.ok()) return done.status();
  }
  for (int side = 0; side < 2; ++side) {
    const std::string& ns = pair->netns_[side];
    for (const std::vector<std::string>& command :
         std::vector<std::vector<std::string>>{
             {"ip", "-n", ns, "link", "set", "lo", "up"},
             {"ip", "-n", ns, "addr", "add", pair->address_[side] + "/24",
              "dev", pair->link_[side]},
             {"ip", "-n", ns, "link", "set", pair->link_[side], "up"}}) {
      if (auto done = RunCommand(command); !done.ok()) return done.status();
    }
  }
  return pair;
}

NetnsPair::~NetnsPair() {
  for (int side = 0; side < 2; ++side) {
    if (created_[side])
      (void)RunCommand({"ip", "netns", "delete", netns_[side]});
  }
}

absl::Status NetnsPair::SetLink(int side, bool up) {
  auto done = RunCommand({"ip", "-n", netns_[side], "link", "set", link_[side],
                          up ? "up" : "down"});
  return done.status();
}

absl::Status NetnsPair::PinNeighbour(int side) {
  const int other = 1 - side;
  auto shown = RunCommand(
      {"ip", "-n", netns_[other], "-o", "link", "show", link_[other]});
  if (!shown.ok()) return shown.status();
  const size_t at = shown->find("link/ether ");
  if (at == std::string::npos) {
    return absl::InternalError(absl::StrCat("no MAC in: ", *shown));
  }
  const std::string mac = shown->substr(at + 11, 17);
  return RunCommand({"ip", "-n", netns_[side], "neigh", "replace",
                     address_[other], "lladdr", mac, "dev", link_[side], "nud",
                     "permanent"})
      .status();
}

absl::StatusOr<std::unique_ptr<NetnsSwitch>> NetnsSwitch::Create(int hosts) {
  if (absl::Status status = CheckNetnsPrivileges(); !status.ok()) {
    return status;
  }
  if (hosts < 1 || hosts > 250) {
    return absl::InvalidArgumentError(
        absl::StrCat("a switch has 1 to 250 hosts, not ", hosts));
  }
  SweepStaleNamespaces(kSwitchPrefix);
  static std::atomic<int> counter{0};
  const int n = counter.fetch_add(1);
  std::unique_ptr<NetnsSwitch> net(new NetnsSwitch());
  // Partly built: the destructor deletes what exists.
  absl::Status built =
      net->Build(absl::StrCat(kSwitchPrefix, getpid(), "x", n), n % 256, hosts);
  if (!built.ok()) return built;
  return net;
}

absl::Status NetnsSwitch::Build(const std::string& stem, int subnet,
                                int hosts) {
  hub_ = stem + "hub";
  if (auto made = RunCommand({"ip", "netns", "add", hub_}); !made.ok()) {
    return made.status();
  }
  hub_created_ = true;
  if (absl::Status done = RunAll({
          {"ip", "-n", hub_, "link", "set", "lo", "up"},
          // No STP: ports forward as soon as they are up.
          {"ip", "-n", hub_, "link", "add", kBridge, "type", "bridge",
           "stp_state", "0"},
          {"ip", "-n", hub_, "link", "set", kBridge, "up"},
      });
      !done.ok()) {
    return done;
  }
  hosts_.resize(hosts);
  for (int i = 0; i < hosts; ++i) {
    Host& host = hosts_[i];
    host.netns = absl::StrCat(stem, "h", i);
    host.address = absl::StrCat("10.78.", subnet, ".", i + 1);
    if (auto made = RunCommand({"ip", "netns", "add", host.netns});
        !made.ok()) {
      return made.status();
    }
    host.created = true;
    // The hub's end is created in the hub, the host's straight in its
    // namespace: neither name is ever seen by this namespace.
    const std::string port = absl::StrCat("p", i);
    if (absl::Status done = RunAll({
            {"ip", "-n", hub_, "link", "add", port, "type", "veth", "peer",
             "name", kHostLink, "netns", host.netns},
            {"ip", "-n", hub_, "link", "set", port, "master", kBridge},
            {"ip", "-n", hub_, "link", "set", port, "up"},
            {"ip", "-n", host.netns, "link", "set", "lo", "up"},
            {"ip", "-n", host.netns, "addr", "add", host.address + "/24", "dev",
             kHostLink},
            {"ip", "-n", host.netns, "link", "set", kHostLink, "up"},
        });
        !done.ok()) {
      return done;
    }
  }
  // Ready when Create returns: every host's link and its bridge port up.
  for (int i = 0; i < hosts; ++i) {
    if (absl::Status up = AwaitLinkUp(hosts_[i].netns, kHostLink); !up.ok()) {
      return up;
    }
    if (absl::Status up = AwaitLinkUp(hub_, absl::StrCat("p", i)); !up.ok()) {
      return up;
    }
  }
  return absl::OkStatus();
}

NetnsSwitch::~NetnsSwitch() {
  for (const Host& host : hosts_) {
    if (host.created) (void)RunCommand({"ip", "netns", "delete", host.netns});
  }
  if (hub_created_) (void)RunCommand({"ip", "netns", "delete", hub_});
}

absl::Status NetnsSwitch::SetLink(int i, bool up) {
  auto done = RunCommand({"ip", "-n", hosts_[i].netns, "link", "set", kHostLink,
                          up ? "up" : "down"});
  if (!done.ok() || !up) return done.status();
  return AwaitLinkUp(hosts_[i].netns, kHostLink);
}

}  // namespace rdma_agent::testing
