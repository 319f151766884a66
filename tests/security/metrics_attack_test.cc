// Attacks on the metrics endpoint (--metrics_listen) of real rdma-agentd
// processes: what any local user (or host reaching the port) can read there,
// whether slow clients can silence /healthz, and whether callers can grow
// the label sets without bound. The per-user test needs root (a second
// user); the others run as anyone.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/unique_fd.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/impl/codegen/client_unary_call.h"
#include "grpcpp/impl/codegen/rpc_method.h"
#include "gtest/gtest.h"
#include "tests/security/local_harness.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/eventually.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;

// One sample of a scrape: its family, labels and value.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

std::vector<Sample> Parse(const std::string& text) {
  std::vector<Sample> samples;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    Sample sample;
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    (void)absl::SimpleAtod(line.substr(space + 1), &sample.value);
    absl::string_view series = line.substr(0, space);
    const size_t brace = series.find('{');
    sample.name = std::string(series.substr(0, brace));
    if (brace != absl::string_view::npos) {
      absl::string_view labels =
          series.substr(brace + 1, series.size() - brace - 2);
      for (absl::string_view pair :
           absl::StrSplit(labels, "\",", absl::SkipEmpty())) {
        const size_t eq = pair.find('=');
        std::string value(pair.substr(eq + 2));
        if (absl::EndsWith(value, "\"")) value.pop_back();
        sample.labels[std::string(pair.substr(0, eq))] = value;
      }
    }
    samples.push_back(std::move(sample));
  }
  return samples;
}

std::vector<Sample> Family(const std::vector<Sample>& samples,
                           absl::string_view name) {
  std::vector<Sample> family;
  for (const Sample& sample : samples) {
    if (sample.name == name) family.push_back(sample);
  }
  return family;
}

double Sum(const std::vector<Sample>& samples) {
  double sum = 0;
  for (const Sample& sample : samples) sum += sample.value;
  return sum;
}

std::string MetricsAddress(AgentProcess& agent) {
  auto info = agent.client().GetInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->metrics_address() : "";
}

uint16_t PortOf(const std::string& address) {
  uint32_t port = 0;
  (void)absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port);
  return static_cast<uint16_t>(port);
}

// A TCP connection to 127.0.0.1:`port` from `source` (any loopback address).
UniqueFd ConnectFrom(const std::string& source, uint16_t port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return fd;
  sockaddr_in from = {};
  from.sin_family = AF_INET;
  ::inet_pton(AF_INET, source.c_str(), &from.sin_addr);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0) {
    return UniqueFd();
  }
  sockaddr_in to = {};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
    return UniqueFd();
  }
  return fd;
}

// The body of GET `path` from the endpoint at `address` (127.0.0.1:PORT),
// on a plain socket: DEADLINE_EXCEEDED when the whole answer does not come
// within `timeout`, UNAVAILABLE when it is no 200.
absl::StatusOr<std::string> HttpGet(const std::string& address,
                                    const std::string& path,
                                    absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  UniqueFd fd = ConnectFrom("127.0.0.1", PortOf(address));
  if (!fd) return absl::UnavailableError(absl::StrCat("connect: ", errno));
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: ", address,
                   "\r\nConnection: close\r\n\r\n");
  if (::send(fd.get(), request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    return absl::UnavailableError(absl::StrCat("send: ", errno));
  }
  std::string answer;
  char chunk[65536];
  while (true) {
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    pollfd p = {fd.get(), POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("GET ", path, ": no whole answer within ",
                       absl::FormatDuration(timeout)));
    }
    const ssize_t got = ::recv(fd.get(), chunk, sizeof(chunk), 0);
    if (got < 0) return absl::UnavailableError(absl::StrCat("recv: ", errno));
    if (got == 0) break;
    answer.append(chunk, static_cast<size_t>(got));
  }
  const size_t end = answer.find("\r\n\r\n");
  if (!absl::StartsWith(answer, "HTTP/1.1 200 ") || end == std::string::npos) {
    return absl::UnavailableError(
        absl::StrCat("GET ", path, ": ", answer.substr(0, 100)));
  }
  return answer.substr(end + 4);
}

std::string ScrapeText(AgentProcess& agent) {
  auto text = HttpGet(MetricsAddress(agent), "/metrics", absl::Seconds(20));
  EXPECT_TRUE(text.ok()) << text.status();
  return text.ok() ? *text : "";
}

// Connections that send the first half of an HTTP request and then nothing.
std::vector<UniqueFd> HangOn(uint16_t port, int count) {
  std::vector<UniqueFd> hangers;
  const std::string half = "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-";
  for (int i = 0; i < count; ++i) {
    UniqueFd fd = ConnectFrom("127.0.0.1", port);
    if (!fd) break;
    if (::send(fd.get(), half.data(), half.size(), MSG_NOSIGNAL) !=
        static_cast<ssize_t>(half.size())) {
      break;
    }
    hangers.push_back(std::move(fd));
  }
  return hangers;
}

// How long GET /healthz took, or InfiniteDuration when it failed.
absl::Duration TimeHealthz(const std::string& address) {
  const absl::Time start = absl::Now();
  auto body = HttpGet(address, "/healthz", absl::Seconds(5));
  if (!body.ok() || *body != "ok\n") {
    ADD_FAILURE() << "/healthz: "
                  << (body.ok() ? *body : body.status().ToString());
    return absl::InfiniteDuration();
  }
  return absl::Now() - start;
}

std::unique_ptr<AgentProcess> StartAgent(std::vector<std::string> flags,
                                         const std::string& backends) {
  AgentProcess::Options options;
  options.backends = backends;
  options.log_level = "info";
  options.extra_flags = {"--metrics_listen=127.0.0.1:0"};
  options.extra_flags.insert(options.extra_flags.end(), flags.begin(),
                             flags.end());
  auto agent = AgentProcess::Start(options);
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? std::move(*agent) : nullptr;
}

// (a) Per-user series name local users and what they hold: not served unless
// the operator asks for them.
TEST(MetricsAttackTest, OtherUsersUidsAndUsageAreNotServedByDefault) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a second user";
  auto agent = StartSharedAgent({"--metrics_listen=127.0.0.1:0"});
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto victim = LocalWorker::Start(**agent, kOtherUser);
  ASSERT_TRUE(victim.ok()) << victim.status();
  ASSERT_TRUE(absl::StartsWith(victim->Ask("allocate 12345"), "ok "));
  const std::string text = ScrapeText(**agent);
  const std::vector<Sample> samples = Parse(text);
  for (const Sample& sample : samples) {
    EXPECT_EQ(sample.labels.count("uid"), 0u)
        << "a per-user series anyone can read: " << sample.name << " uid "
        << sample.labels.at("uid");
  }
  EXPECT_FALSE(absl::StrContains(text, absl::StrCat(kOtherUser)));
  // The totals stay, for capacity dashboards.
  EXPECT_EQ(Sum(Family(samples, "rdma_agentd_registrations")), 1);
  EXPECT_GE(Sum(Family(samples, "rdma_agentd_registered_bytes")), 12345);
}

TEST(MetricsAttackTest, PerUserSeriesAreServedOnlyWhenTheOperatorAsks) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a second user";
  auto agent = StartSharedAgent(
      {"--metrics_listen=127.0.0.1:0", "--metrics_per_user=true"});
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto user = LocalWorker::Start(**agent, kOtherUser);
  ASSERT_TRUE(user.ok()) << user.status();
  ASSERT_TRUE(absl::StartsWith(user->Ask("allocate 12345"), "ok "));
  const std::vector<Sample> samples = Parse(ScrapeText(**agent));
  double by_uid = 0;
  for (const Sample& sample : Family(samples, "rdma_agentd_registrations")) {
    if (sample.labels.count("uid") &&
        sample.labels.at("uid") == absl::StrCat(kOtherUser)) {
      by_uid += sample.value;
    }
  }
  EXPECT_EQ(by_uid, 1);
}

// (b) Slow-loris: connections that send half a request and stay must not
// silence the probes.
TEST(MetricsAttackTest, HealthzAnswersWithinASecondWhile64SlowClientsHang) {
  auto agent = StartAgent({}, "memory");
  ASSERT_NE(agent, nullptr);
  const std::string address = MetricsAddress(*agent);
  std::vector<UniqueFd> hangers = HangOn(PortOf(address), 64);
  ASSERT_EQ(hangers.size(), 64u);
  // Several probes, spread over a few seconds: the hangers stay meanwhile.
  for (int probe = 0; probe < 3; ++probe) {
    EXPECT_LT(TimeHealthz(address), absl::Seconds(1)) << "probe " << probe;
    absl::SleepFor(absl::Milliseconds(500));
  }
  auto metrics = HttpGet(address, "/metrics", absl::Seconds(5));
  EXPECT_TRUE(metrics.ok()) << metrics.status();
}

TEST(MetricsAttackTest, MoreHangersThanConnectionsAllowedStillLetProbesIn) {
  auto agent = StartAgent(
      {"--metrics_max_connections=16", "--metrics_request_timeout=3s"},
      "memory");
  ASSERT_NE(agent, nullptr);
  const std::string address = MetricsAddress(*agent);
  std::vector<UniqueFd> hangers = HangOn(PortOf(address), 200);
  ASSERT_EQ(hangers.size(), 200u);
  EXPECT_LT(TimeHealthz(address), absl::Seconds(1));
  EXPECT_LT(TimeHealthz(address), absl::Seconds(1));
  // And nothing is held for ever: every hanger is closed by the request
  // timeout at the latest (EOF or reset on its side).
  const auto closed = [](int fd) {
    pollfd p = {fd, POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0) return false;
    char byte;
    return ::recv(fd, &byte, 1, MSG_DONTWAIT) <= 0;
  };
  EXPECT_TRUE(Eventually(
      [&] {
        for (const UniqueFd& fd : hangers) {
          if (!closed(fd.get())) return false;
        }
        return true;
      },
      absl::Seconds(20)));
}

// (c) Labels from requests are bounded: invented gRPC method names share
// one series.
TEST(MetricsAttackTest, InventedMethodNamesShareOneSeries) {
  auto agent = StartAgent({}, "memory");
  ASSERT_NE(agent, nullptr);
  const std::string text_before = ScrapeText(*agent);
  const size_t size_before = text_before.size();
  // The agent's own methods have their series from the start.
  std::set<std::string> methods_before;
  for (const Sample& sample :
       Family(Parse(text_before), "rdma_agentd_rpcs_total")) {
    methods_before.insert(sample.labels.at("method"));
  }
  std::shared_ptr<grpc::Channel> channel = agent->client().channel();
  constexpr int kCalls = 3000;
  int unimplemented = 0;
  for (int i = 0; i < kCalls; ++i) {
    const std::string path =
        i % 2 == 0 ? absl::StrCat("/rdma.agent.v1.RdmaAgent/Invented", i)
                   : absl::StrCat("/evil", i, ".Service/Method");
    grpc::internal::RpcMethod method(path.c_str(),
                                     grpc::internal::RpcMethod::NORMAL_RPC);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::GetInfoRequest request;
    v1::AgentInfo response;
    const grpc::Status status = grpc::internal::BlockingUnaryCall(
        channel.get(), method, &context, request, &response);
    unimplemented += status.error_code() == grpc::StatusCode::UNIMPLEMENTED;
  }
  EXPECT_EQ(unimplemented, kCalls);
  ASSERT_TRUE(agent->client().GetInfo().ok());
  // Methods the agent has keep their names, services it links but does not
  // define included.
  {
    grpc::internal::RpcMethod check("/grpc.health.v1.Health/Check",
                                    grpc::internal::RpcMethod::NORMAL_RPC);
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    ASSERT_TRUE(grpc::internal::BlockingUnaryCall(channel.get(), check,
                                                  &context, request, &response)
                    .ok());
  }
  const std::string text = ScrapeText(*agent);
  const std::vector<Sample> samples =
      Family(Parse(text), "rdma_agentd_rpcs_total");
  std::set<std::string> methods;
  double unknown = 0;
  for (const Sample& sample : samples) {
    methods.insert(sample.labels.at("method"));
    if (sample.labels.at("method") == "unknown") unknown += sample.value;
  }
  EXPECT_EQ(unknown, kCalls);
  std::set<std::string> added;
  for (const std::string& method : methods) {
    if (methods_before.count(method) == 0) added.insert(method);
  }
  EXPECT_LE(added.size(), 2u)
      << "one series per invented method: " << added.size() << " added";
  EXPECT_EQ(methods.count("rdma.agent.v1.RdmaAgent/GetInfo"), 1u);
  EXPECT_EQ(methods.count("grpc.health.v1.Health/Check"), 1u);
  EXPECT_LT(text.size(), size_before + 4096)
      << "/metrics grew from " << size_before << " to " << text.size();
}

// (c) Peer labels come from whoever connects: capped, the rest summed under
// peer="other".
TEST(MetricsAttackTest, PeerLabelsAreCappedWithAnOtherBucket) {
  auto agent = StartAgent({"--tcp_handshake_timeout=60s"}, "tcp");
  ASSERT_NE(agent, nullptr);
  constexpr int kSources = 100;
  std::vector<UniqueFd> connections;
  for (int i = 0; i < kSources; ++i) {
    UniqueFd fd =
        ConnectFrom(absl::StrCat("127.0.", 1 + i / 200, ".", 10 + i % 200),
                    agent->tcp_port());
    ASSERT_TRUE(fd.valid()) << "connection " << i << ": " << errno;
    connections.push_back(std::move(fd));
  }
  std::vector<Sample> in;
  ASSERT_TRUE(Eventually(
      [&] {
        in.clear();
        for (const Sample& sample :
             Family(Parse(ScrapeText(*agent)), "rdma_agentd_peer_links")) {
          if (sample.labels.at("direction") == "in") in.push_back(sample);
        }
        return Sum(in) >= kSources;
      },
      absl::Seconds(20)))
      << "links seen: " << Sum(in);
  EXPECT_LE(in.size(), 65u) << "one series per source address";
  double other = 0;
  for (const Sample& sample : in) {
    if (sample.labels.at("peer") == "other") other += sample.value;
  }
  EXPECT_GE(other, kSources - 64);
}

}  // namespace
}  // namespace rdma_agent::testing
