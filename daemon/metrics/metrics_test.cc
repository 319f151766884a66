#include "daemon/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/unique_fd.h"
#include "daemon/metrics/metrics_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

namespace v1 = ::rdma::agent::v1;
using ::testing::HasSubstr;
using ::testing::Not;

// Sends `request` to 127.0.0.1:`port`; the whole HTTP response.
std::string Exchange(uint16_t port, const std::string& request) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&address),
                sizeof(address)) != 0) {
    return "";
  }
  if (::send(fd.get(), request.data(), request.size(), MSG_NOSIGNAL) < 0) {
    return "";
  }
  std::string response;
  char buffer[4096];
  ssize_t n;
  while ((n = ::recv(fd.get(), buffer, sizeof(buffer), 0)) > 0) {
    response.append(buffer, static_cast<size_t>(n));
  }
  return response;
}

// GET `path` from 127.0.0.1:`port`; the whole HTTP response.
std::string Get(uint16_t port, const std::string& path) {
  return Exchange(port,
                  absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: x\r\n\r\n"));
}

TEST(AgentMetricsTest, LabelledCountersExistAtZeroForKnownValues) {
  AgentMetrics metrics("x", "unknown");
  std::string text = metrics.Scrape();
  EXPECT_THAT(text, Not(HasSubstr("rdma_agentd_op_retries_total{")));
  metrics.DeclareBackends({"ibverbs", "tcp"});
  text = metrics.Scrape();
  for (const char* series : {
           "rdma_agentd_ops_total{backend=\"tcp\",code=\"OK\",op=\"read\"} 0",
           "rdma_agentd_ops_total{backend=\"ibverbs\",code=\"OK\",op=\"write\"}"
           " 0",
           "rdma_agentd_op_bytes_total{backend=\"tcp\",op=\"write\"} 0",
           "rdma_agentd_op_retries_total{from=\"ibverbs\",to=\"tcp\"} 0",
           "rdma_agentd_notifications_sent_total{backend=\"tcp\",code=\"OK\"} "
           "0",
           "rdma_agentd_refusals_total{reason=\"peer_not_found\"} 0",
       }) {
    EXPECT_THAT(text, HasSubstr(series));
  }
  // Falling back goes to a later backend only.
  EXPECT_THAT(text, Not(HasSubstr("{from=\"tcp\",to=\"ibverbs\"}")));
}

TEST(AgentMetricsTest, CallbackCountersAreCountersAndProcessMetricsAreThere) {
  AgentMetrics metrics("x", "unknown");
  metrics.AddCounter("rdma_agentd_things_total", "Things", [] {
    return std::vector<GaugeSample>{{{{"kind", "a"}}, 7}};
  });
  const std::string text = metrics.Scrape();
  EXPECT_THAT(text, HasSubstr("# TYPE rdma_agentd_things_total counter\n"));
  EXPECT_THAT(text, HasSubstr("rdma_agentd_things_total{kind=\"a\"} 7"));
  for (const char* family :
       {"process_cpu_seconds_total counter",
        "process_resident_memory_bytes gauge",
        "process_virtual_memory_bytes gauge", "process_open_fds gauge",
        "process_max_fds gauge", "process_start_time_seconds gauge",
        "process_threads gauge"}) {
    EXPECT_THAT(text, HasSubstr(absl::StrCat("# TYPE ", family, "\n")));
  }
}

TEST(AgentMetricsTest, CountsOpsBytesRetriesAndRefusals) {
  AgentMetrics metrics("1.2.3", "0123abc");
  metrics.RecordOp("tcp", v1::OP_TYPE_READ_INTO_LOCAL, absl::StatusCode::kOk,
                   4096, absl::Microseconds(50));
  metrics.RecordOp("tcp", v1::OP_TYPE_READ_INTO_LOCAL, absl::StatusCode::kOk,
                   100, absl::Microseconds(50));
  metrics.RecordOp("tcp", v1::OP_TYPE_WRITE_FROM_LOCAL,
                   absl::StatusCode::kNotFound, 7, absl::Milliseconds(2));
  metrics.RecordOp("", v1::OP_TYPE_WRITE_FROM_LOCAL,
                   absl::StatusCode::kUnavailable, 7, absl::ZeroDuration());
  metrics.RecordSubmit(absl::Milliseconds(3));
  metrics.RecordRetry("ibverbs", "tcp");
  metrics.RecordRefusal("max_rpcs_per_user");
  const std::string text = metrics.Scrape();
  EXPECT_THAT(
      text,
      HasSubstr(
          "rdma_agentd_build_info{revision=\"0123abc\",version=\"1.2.3\"} 1"));
  EXPECT_THAT(text,
              HasSubstr("rdma_agentd_ops_total{backend=\"tcp\",code=\"OK\","
                        "op=\"read\"} 2"));
  EXPECT_THAT(text,
              HasSubstr("rdma_agentd_ops_total{backend=\"tcp\",code=\"NOT_"
                        "FOUND\",op=\"write\"} 1"));
  EXPECT_THAT(text, HasSubstr("rdma_agentd_ops_total{backend=\"none\",code="
                              "\"UNAVAILABLE\",op=\"write\"} 1"));
  // Only successful ops move bytes.
  EXPECT_THAT(text, HasSubstr("rdma_agentd_op_bytes_total{backend=\"tcp\","
                              "op=\"read\"} 4196"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("op_bytes_total{backend=\"tcp\","
                                             "op=\"write\"}")));
  EXPECT_THAT(text, HasSubstr("rdma_agentd_submit_duration_seconds_count 1"));
  EXPECT_THAT(text, HasSubstr("rdma_agentd_op_retries_total{from=\"ibverbs\","
                              "to=\"tcp\"} 1"));
  EXPECT_THAT(text, HasSubstr("rdma_agentd_refusals_total{reason=\"max_rpcs_"
                              "per_user\"} 1"));
}

TEST(AgentMetricsTest, OpsRecordedTogetherCountAsManyObservations) {
  AgentMetrics metrics("x", "unknown");
  // 1000 ops of one 2 ms batch, as one call: the same as 1000 calls.
  metrics.RecordOps("tcp", v1::OP_TYPE_WRITE_FROM_LOCAL, absl::StatusCode::kOk,
                    1000, 4096000, absl::Milliseconds(2));
  metrics.RecordOp("tcp", v1::OP_TYPE_WRITE_FROM_LOCAL, absl::StatusCode::kOk,
                   4096, absl::Microseconds(20));
  const std::string text = metrics.Scrape();
  EXPECT_THAT(text, HasSubstr("rdma_agentd_ops_total{backend=\"tcp\",code="
                              "\"OK\",op=\"write\"} 1001"));
  EXPECT_THAT(text, HasSubstr("rdma_agentd_op_bytes_total{backend=\"tcp\","
                              "op=\"write\"} 4100096"));
  EXPECT_THAT(text, HasSubstr("rdma_agentd_op_duration_seconds_count{backend="
                              "\"tcp\"} 1001"));
  // Buckets are cumulative: 20 us is under 3e-05, 2 ms under 0.003 only.
  EXPECT_THAT(text, HasSubstr("rdma_agentd_op_duration_seconds_bucket{backend="
                              "\"tcp\",le=\"3e-05\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("rdma_agentd_op_duration_seconds_bucket{backend="
                              "\"tcp\",le=\"0.001\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("rdma_agentd_op_duration_seconds_bucket{backend="
                              "\"tcp\",le=\"0.003\"} 1001\n"));
  EXPECT_THAT(text, HasSubstr("rdma_agentd_op_duration_seconds_sum{backend="
                              "\"tcp\"} 2.00002"));
}

TEST(AgentMetricsTest, GaugesAreReadAtScrapeTime) {
  AgentMetrics metrics("x", "unknown");
  std::atomic<int> registrations{1};
  metrics.AddGauge("rdma_agentd_registrations", "Live registrations by owner",
                   [&] {
                     return std::vector<GaugeSample>{
                         {{{"uid", "1000"}}, double(registrations.load())}};
                   });
  EXPECT_THAT(metrics.Scrape(),
              HasSubstr("rdma_agentd_registrations{uid=\"1000\"} 1"));
  registrations = 5;
  EXPECT_THAT(metrics.Scrape(),
              HasSubstr("rdma_agentd_registrations{uid=\"1000\"} 5"));
}

TEST(MetricsServerTest, ServesMetricsAndHealth) {
  AgentMetrics metrics("x", "unknown");
  metrics.RecordRefusal("test");
  std::atomic<bool> serving{true};
  auto server = MetricsServer::Start("127.0.0.1:0", MetricsOptions(), &metrics,
                                     [&] { return serving.load(); });
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  ASSERT_NE(port, 0);
  const std::string scraped = Get(port, "/metrics");
  EXPECT_TRUE(absl::StartsWith(scraped, "HTTP/1.1 200")) << scraped;
  EXPECT_THAT(scraped,
              HasSubstr("rdma_agentd_refusals_total{reason=\"test\"} 1"));
  EXPECT_TRUE(absl::StartsWith(Get(port, "/healthz"), "HTTP/1.1 200"));
  serving = false;
  EXPECT_TRUE(absl::StartsWith(Get(port, "/healthz"), "HTTP/1.1 503"));
}

TEST(MetricsServerTest, AnswersWhatItDoesNotServeWithAStatus) {
  AgentMetrics metrics("x", "unknown");
  auto server = MetricsServer::Start("127.0.0.1:0", MetricsOptions(), &metrics,
                                     [] { return true; });
  ASSERT_TRUE(server.ok()) << server.status();
  const uint16_t port = (*server)->port();
  EXPECT_TRUE(absl::StartsWith(Get(port, "/nothing"), "HTTP/1.1 404"));
  EXPECT_TRUE(absl::StartsWith(Get(port, "/metrics?format=x"), "HTTP/1.1 200"));
  EXPECT_TRUE(absl::StartsWith(Exchange(port, "POST /metrics HTTP/1.1\r\n\r\n"),
                               "HTTP/1.1 405"));
  EXPECT_TRUE(absl::StartsWith(Exchange(port, "\x16\x03\x01 hello\r\n"),
                               "HTTP/1.1 400"));
  EXPECT_TRUE(absl::StartsWith(
      Exchange(port, "GET /metrics HTTP/1.1\r\nX: " + std::string(9000, 'a')),
      "HTTP/1.1 431"));
  // HEAD: the length of what GET would send, and no body.
  const std::string head = Exchange(port, "HEAD /healthz HTTP/1.0\r\n\r\n");
  EXPECT_TRUE(absl::StartsWith(head, "HTTP/1.1 200")) << head;
  EXPECT_THAT(head, HasSubstr("Content-Length: 3\r\n"));
  EXPECT_TRUE(absl::EndsWith(head, "\r\n\r\n")) << head;
}

TEST(MetricsServerTest, ClosesConnectionsPastTheirTimeout) {
  AgentMetrics metrics("x", "unknown");
  MetricsOptions options;
  options.request_timeout = absl::Milliseconds(200);
  auto server = MetricsServer::Start("127.0.0.1:0", options, &metrics,
                                     [] { return true; });
  ASSERT_TRUE(server.ok()) << server.status();
  // Half a request, then nothing: closed without an answer.
  EXPECT_EQ(Exchange((*server)->port(), "GET /healthz HTTP/1.1\r\n"), "");
}

TEST(CapLabelValuesTest, KeepsTheLargestAndSumsTheRestPerGroup) {
  std::vector<GaugeSample> samples;
  for (int i = 0; i < 5; ++i) {
    samples.push_back(
        {{{"peer", absl::StrCat("p", i)}, {"direction", "in"}}, double(i)});
  }
  samples.push_back({{{"peer", "q"}, {"direction", "out"}}, 7});
  samples.push_back({{{"kind", "x"}}, 1});  // no peer label: kept as is
  const std::vector<GaugeSample> capped =
      CapLabelValues(samples, "peer", /*max_values=*/2);
  std::map<std::string, double> by_series;
  for (const GaugeSample& sample : capped) {
    std::string series;
    for (const auto& [name, value] : sample.labels) {
      absl::StrAppend(&series, name, "=", value, ",");
    }
    by_series[series] = sample.value;
  }
  EXPECT_EQ(by_series, (std::map<std::string, double>{
                           {"direction=in,peer=p4,", 4},
                           {"direction=in,peer=p3,", 3},
                           {"direction=in,peer=other,", 0 + 1 + 2},
                           {"direction=out,peer=q,", 7},
                           {"kind=x,", 1},
                       }));
}

TEST(MetricsServerTest, BadOrBusyAddressesAreErrors) {
  AgentMetrics metrics("x", "unknown");
  EXPECT_TRUE(absl::IsInvalidArgument(
      MetricsServer::Start("no-port", MetricsOptions(), &metrics, [] {
        return true;
      }).status()));
  auto first = MetricsServer::Start("127.0.0.1:0", MetricsOptions(), &metrics,
                                    [] { return true; });
  ASSERT_TRUE(first.ok()) << first.status();
  auto second =
      MetricsServer::Start(absl::StrCat("127.0.0.1:", (*first)->port()),
                           MetricsOptions(), &metrics, [] { return true; });
  EXPECT_TRUE(absl::IsUnavailable(second.status())) << second.status();
}

}  // namespace
}  // namespace rdma_agent
