#include "tests/integration/netns.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tests/testing/process.h"

namespace rdma_agent::testing {
namespace {

constexpr char kNetnsPrefix[] = "ratcp";

bool ProcessAlive(pid_t pid) { return kill(pid, 0) == 0 || errno == EPERM; }

// Deletes namespaces of earlier test processes that died before cleaning up.
void SweepStaleNamespaces() {
  auto list = RunCommand({"ip", "netns", "list"});
  if (!list.ok()) return;
  for (absl::string_view line : absl::StrSplit(*list, '\n')) {
    const std::string name(line.substr(0, line.find(' ')));
    if (!absl::StartsWith(name, kNetnsPrefix)) continue;
    // ratcp<pid>x<n><side>
    const std::string rest = name.substr(strlen(kNetnsPrefix));
    int pid = 0;
    if (!absl::SimpleAtoi(rest.substr(0, rest.find('x')), &pid)) continue;
    if (pid > 0 && !ProcessAlive(pid)) {
      (void)RunCommand({"ip", "netns", "delete", name});
    }
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
  SweepStaleNamespaces();
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

}  // namespace rdma_agent::testing
