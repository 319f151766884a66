// Names on a real etcd (etcd-server on this machine) between real
// rdma-agentd processes: Resolve from the agent's cache and from etcd
// (p50/p99), N names published then resolved (total and per name), and the
// time from a publishing agent's SIGKILL to its names disappearing.
//
//   bazel run //bench:names_bench -- --names=10000 --lease_ttl=3s
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/rdma_agent_client.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/etcd_server.h"

ABSL_FLAG(int, names, 10000, "names published and resolved");
ABSL_FLAG(absl::Duration, lease_ttl, absl::Seconds(3),
          "the agents' --directory_lease_ttl");

namespace rdma_agent {
namespace {

namespace v1 = ::rdma::agent::v1;

using ::rdma_agent::testing::AgentProcess;
using ::rdma_agent::testing::EtcdServer;
using ::rdma_agent::testing::TcpAgentOptions;

// p50 and p99 of `samples`, in microseconds.
std::string Percentiles(std::vector<absl::Duration> samples) {
  std::sort(samples.begin(), samples.end());
  auto at = [&](double q) {
    return absl::ToDoubleMicroseconds(samples[std::min(
        samples.size() - 1, static_cast<size_t>(q * samples.size()))]);
  };
  return absl::StrCat("p50 ", at(0.50), " us, p99 ", at(0.99), " us");
}

// Resolves every name through `agent`: the latency of each; exits on an
// error.
std::vector<absl::Duration> ResolveAll(AgentProcess& agent,
                                       const std::vector<std::string>& names) {
  std::vector<absl::Duration> latencies;
  latencies.reserve(names.size());
  for (const std::string& name : names) {
    const absl::Time start = absl::Now();
    auto record = agent.client().Resolve(name);
    latencies.push_back(absl::Now() - start);
    if (!record.ok()) {
      std::fprintf(stderr, "resolve %s: %s\n", name.c_str(),
                   record.status().ToString().c_str());
      std::exit(1);
    }
  }
  return latencies;
}

absl::Duration Sum(const std::vector<absl::Duration>& samples) {
  absl::Duration total;
  for (absl::Duration sample : samples) total += sample;
  return total;
}

int Run() {
  const int count = absl::GetFlag(FLAGS_names);
  const absl::Duration ttl = absl::GetFlag(FLAGS_lease_ttl);
  auto etcd = EtcdServer::Start();
  if (!etcd.ok()) {
    std::fprintf(stderr, "etcd: %s\n", etcd.status().ToString().c_str());
    return 1;
  }
  auto start = [&](const std::string& id, std::vector<std::string> more) {
    std::vector<std::string> flags = {
        "--agent_id=" + id,
        "--directory=" + (*etcd)->directory(),
        "--directory_prefix=/bench",
        "--directory_lease_ttl=" + absl::FormatDuration(ttl),
        absl::StrCat("--max_names_per_user=", count),
        absl::StrCat("--max_names_total=", count)};
    flags.insert(flags.end(), more.begin(), more.end());
    auto agent =
        AgentProcess::Start(TcpAgentOptions("127.0.0.1", "", std::move(flags)));
    if (!agent.ok()) {
      std::fprintf(stderr, "agent %s: %s\n", id.c_str(),
                   agent.status().ToString().c_str());
      std::exit(1);
    }
    return std::move(*agent);
  };
  auto publisher = start("publisher", {});
  auto cached = start("resolver-cached", {});
  auto uncached =
      start("resolver-uncached", {"--directory_resolve_cache_entries=0"});

  auto buffer = publisher->client().AllocateUnmapped(4096, v1::ACCESS_READ);
  if (!buffer.ok()) return 1;
  std::vector<std::string> names;
  for (int i = 0; i < count; ++i) names.push_back(absl::StrCat("bench/", i));
  const absl::Time publish_start = absl::Now();
  for (const std::string& name : names) {
    absl::Status status = publisher->client().Publish(buffer->id, name);
    if (!status.ok()) {
      std::fprintf(stderr, "publish %s: %s\n", name.c_str(),
                   status.ToString().c_str());
      return 1;
    }
  }
  const absl::Duration publish = absl::Now() - publish_start;

  const std::vector<absl::Duration> cold = ResolveAll(*cached, names);
  const std::vector<absl::Duration> warm = ResolveAll(*cached, names);
  const std::vector<absl::Duration> from_etcd = ResolveAll(*uncached, names);

  std::printf("names: %d, etcd %s on this machine, lease TTL %s\n", count,
              (*etcd)->endpoint().c_str(), absl::FormatDuration(ttl).c_str());
  std::printf("publish %d names: %.3f s total, %.1f us per name\n", count,
              absl::ToDoubleSeconds(publish),
              absl::ToDoubleMicroseconds(publish) / count);
  auto row = [&](const char* what, const std::vector<absl::Duration>& samples) {
    const absl::Duration total = Sum(samples);
    std::printf("%-36s %.3f s total, %.1f us per name, %s\n", what,
                absl::ToDoubleSeconds(total),
                absl::ToDoubleMicroseconds(total) / samples.size(),
                Percentiles(samples).c_str());
  };
  row("resolve, cold cache (etcd asked):", cold);
  row("resolve, warm cache:", warm);
  row("resolve, cache off (etcd asked):", from_etcd);
  std::printf("warm cache / cache off (mean per name): %.2f\n",
              absl::FDivDuration(Sum(warm), Sum(from_etcd)));

  // SIGKILL the publisher: how long until etcd has dropped its names and
  // until a resolver's cache answers NOT_FOUND.
  const std::string probe = names.back();
  ::kill(publisher->pid(), SIGKILL);
  const absl::Time killed = absl::Now();
  absl::Duration gone_in_etcd = absl::InfiniteDuration();
  absl::Duration gone_at_resolver = absl::InfiniteDuration();
  while (absl::Now() - killed < ttl + absl::Seconds(30) &&
         (gone_in_etcd == absl::InfiniteDuration() ||
          gone_at_resolver == absl::InfiniteDuration())) {
    if (gone_in_etcd == absl::InfiniteDuration()) {
      auto value = (*etcd)->client().Get("/bench/names/" + probe,
                                         absl::Now() + absl::Seconds(2));
      if (value.ok() && !value->has_value())
        gone_in_etcd = absl::Now() - killed;
    }
    if (gone_at_resolver == absl::InfiniteDuration() &&
        cached->client().Resolve(probe).status().code() ==
            absl::StatusCode::kNotFound) {
      gone_at_resolver = absl::Now() - killed;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  std::printf(
      "SIGKILL to names gone (TTL %s): in etcd %s, at a resolver's cache %s\n",
      absl::FormatDuration(ttl).c_str(),
      absl::FormatDuration(gone_in_etcd).c_str(),
      absl::FormatDuration(gone_at_resolver).c_str());
  publisher->Kill();
  return 0;
}

}  // namespace
}  // namespace rdma_agent

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return rdma_agent::Run();
}
