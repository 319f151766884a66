#include "tests/testing/etcd_cluster.h"

#include <signal.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/testing/etcd_server.h"

namespace rdma_agent::testing {

namespace {

// etcd's own ports, free in a namespace of the member's own.
constexpr uint16_t kClientPort = 2379;
constexpr uint16_t kPeerPort = 2380;

// `argv` run inside `netns` unless it is empty.
std::vector<std::string> InNetns(const std::string& netns,
                                 std::vector<std::string> argv) {
  if (!netns.empty()) argv.insert(argv.begin(), {"ip", "netns", "exec", netns});
  return argv;
}

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdCluster>> EtcdCluster::Start(
    std::vector<Host> hosts) {
  std::unique_ptr<EtcdCluster> cluster(new EtcdCluster());
  cluster->dir_.emplace();
  std::vector<std::string> initial;
  for (size_t i = 0; i < hosts.size(); ++i) {
    uint16_t client_port = kClientPort;
    uint16_t peer_port = kPeerPort;
    if (hosts[i].netns.empty()) {
      auto free_client = FreeLoopbackPort();
      auto free_peer = FreeLoopbackPort();
      if (!free_client.ok()) return free_client.status();
      if (!free_peer.ok()) return free_peer.status();
      client_port = *free_client;
      peer_port = *free_peer;
    }
    Member member;
    member.name = absl::StrCat("m", i);
    member.netns = hosts[i].netns;
    member.endpoint = absl::StrCat(hosts[i].address, ":", client_port);
    member.peer_endpoint = absl::StrCat(hosts[i].address, ":", peer_port);
    initial.push_back(
        absl::StrCat(member.name, "=http://", member.peer_endpoint));
    cluster->members_.push_back(std::move(member));
  }
  // All members at once: none answers before a quorum has met.
  for (Member& member : cluster->members_) {
    Subprocess::Options options;
    options.argv = InNetns(
        member.netns,
        {"etcd", "--name=" + member.name,
         absl::StrCat("--data-dir=", cluster->dir_->path(), "/", member.name),
         "--listen-client-urls=http://" + member.endpoint,
         "--advertise-client-urls=http://" + member.endpoint,
         "--listen-peer-urls=http://" + member.peer_endpoint,
         "--initial-advertise-peer-urls=http://" + member.peer_endpoint,
         "--initial-cluster=" + absl::StrJoin(initial, ","),
         "--initial-cluster-state=new",
         "--initial-cluster-token=rdma-agentd-test", "--heartbeat-interval=50",
         "--election-timeout=500", "--logger=zap", "--log-level=error"});
    options.log_path =
        absl::StrCat(cluster->dir_->path(), "/", member.name, ".log");
    auto process = Subprocess::Spawn(std::move(options));
    if (!process.ok()) return process.status();
    member.process = std::move(*process);
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  absl::Status last;
  while (absl::Now() < deadline) {
    auto health =
        cluster->Etcdctl({"--command-timeout=1s", "endpoint", "health"});
    if (health.ok()) return cluster;
    last = health.status();
    absl::SleepFor(absl::Milliseconds(200));
  }
  return absl::UnavailableError(
      absl::StrCat("the etcd cluster did not answer: ", last.message(),
                   " (logs: ", cluster->dir_->path(), ")"));
}

EtcdCluster::~EtcdCluster() {
  for (int i = 0; i < size(); ++i) Kill(i);
}

std::string EtcdCluster::directory(std::vector<int> order) const {
  if (order.empty()) {
    for (int i = 0; i < size(); ++i) order.push_back(i);
  }
  std::vector<std::string> endpoints;
  for (int i : order) endpoints.push_back(members_[i].endpoint);
  return "etcd://" + absl::StrJoin(endpoints, ",");
}

absl::StatusOr<int> EtcdCluster::Leader() {
  // "endpoint, ID, version, DB size, is leader, ..." per line.
  auto status = Etcdctl({"endpoint", "status", "-w", "simple"});
  if (!status.ok()) return status.status();
  for (absl::string_view line : absl::StrSplit(*status, '\n')) {
    std::vector<std::string> fields = absl::StrSplit(line, ", ");
    if (fields.size() < 5 || fields[4] != "true") continue;
    for (int i = 0; i < size(); ++i) {
      if (members_[i].endpoint == fields[0]) return i;
    }
  }
  return absl::NotFoundError(
      absl::StrCat("no member of the cluster leads:\n", *status));
}

void EtcdCluster::Kill(int i) {
  std::optional<Subprocess>& process = members_[i].process;
  if (!process.has_value()) return;
  process->Signal(SIGKILL);
  (void)process->Wait(absl::Seconds(10));
  process.reset();
}

absl::StatusOr<std::string> EtcdCluster::Etcdctl(
    std::vector<std::string> args) {
  std::vector<std::string> running;
  const Member* first = nullptr;
  for (const Member& member : members_) {
    if (!member.process.has_value()) continue;
    running.push_back(member.endpoint);
    if (first == nullptr) first = &member;
  }
  std::vector<std::string> argv =
      InNetns(first == nullptr ? "" : first->netns,
              {"env", "ETCDCTL_API=3", "etcdctl",
               "--endpoints=" + absl::StrJoin(running, ",")});
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv);
}

}  // namespace rdma_agent::testing
