// The metrics endpoint of real rdma-agentd processes, scraped around real
// tcp transfers between two agents: counters, histograms and gauges move by
// what the transfers did, and the logs name who did what (failed ops with
// the caller's uid/pid, refused peer requests with the peer's address,
// every RPC at debug), without flooding when a client loops.

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/internal/http_get.h"
#include "client/rdma_agent_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/process.h"

namespace rdma_agent::testing {
namespace {

using ::testing::HasSubstr;
namespace v1 = ::rdma::agent::v1;

// One scrape, parsed: series name, its labels and value.
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
    EXPECT_TRUE(absl::SimpleAtod(line.substr(space + 1), &sample.value))
        << line;
    absl::string_view series = line.substr(0, space);
    const size_t brace = series.find('{');
    sample.name = std::string(series.substr(0, brace));
    if (brace != absl::string_view::npos) {
      absl::string_view labels =
          series.substr(brace + 1, series.size() - brace - 2);
      for (absl::string_view pair : absl::StrSplit(labels, "\",")) {
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

// The sum of `name` over the series whose labels include `labels`.
double Sum(const std::vector<Sample>& samples, const std::string& name,
           const std::map<std::string, std::string>& labels = {}) {
  double sum = 0;
  for (const Sample& sample : samples) {
    if (sample.name != name) continue;
    bool match = true;
    for (const auto& [key, value] : labels) {
      auto it = sample.labels.find(key);
      if (it == sample.labels.end() || it->second != value) match = false;
    }
    if (match) sum += sample.value;
  }
  return sum;
}

// Whether a series of `name` with `labels` among its labels is exposed.
bool Has(const std::vector<Sample>& samples, const std::string& name,
         const std::map<std::string, std::string>& labels) {
  for (const Sample& sample : samples) {
    if (sample.name != name) continue;
    bool match = true;
    for (const auto& [key, value] : labels) {
      auto it = sample.labels.find(key);
      if (it == sample.labels.end() || it->second != value) match = false;
    }
    if (match) return true;
  }
  return false;
}

class MetricsScrapeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    AgentProcess::Options options;
    // memory too: a fallback pair (memory -> tcp) exists for the retries.
    options.backends = "memory,tcp";
    options.extra_flags = {"--metrics_listen=127.0.0.1:0"};
    auto a = AgentProcess::Start(options);
    ASSERT_TRUE(a.ok()) << a.status();
    a_ = std::move(*a);
    auto b = AgentProcess::Start(options);
    ASSERT_TRUE(b.ok()) << b.status();
    b_ = std::move(*b);
  }

  static std::string MetricsAddress(AgentProcess& agent) {
    auto info = agent.client().GetInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->metrics_address() : "";
  }

  static std::string ScrapeText(AgentProcess& agent) {
    auto text =
        client::HttpGet(MetricsAddress(agent), "/metrics", absl::Seconds(10));
    EXPECT_TRUE(text.ok()) << text.status();
    return text.ok() ? *text : "";
  }
  static std::vector<Sample> Scrape(AgentProcess& agent) {
    return Parse(ScrapeText(agent));
  }

  std::unique_ptr<AgentProcess> a_;
  std::unique_ptr<AgentProcess> b_;
};

TEST_F(MetricsScrapeTest, ValuesMoveWithRealTransfersAndLogsNameTheCallers) {
  constexpr uint64_t kBytes = 3 << 20;
  const std::string address = MetricsAddress(*a_);
  ASSERT_TRUE(absl::StartsWith(address, "127.0.0.1:")) << address;
  auto healthz = client::HttpGet(address, "/healthz", absl::Seconds(10));
  ASSERT_TRUE(healthz.ok()) << healthz.status();
  EXPECT_EQ(*healthz, "ok\n");

  const std::vector<Sample> before = Scrape(*a_);
  const std::vector<Sample> b_before = Scrape(*b_);
  EXPECT_EQ(Sum(before, "rdma_agentd_build_info", {{"revision", "unknown"}}),
            1);
  // Series exist before their first event, so that rate() sees them.
  EXPECT_TRUE(Has(b_before, "rdma_agentd_refusals_total",
                  {{"reason", "peer_not_found"}}));
  EXPECT_TRUE(Has(before, "rdma_agentd_ops_total",
                  {{"backend", "tcp"}, {"op", "write"}, {"code", "OK"}}));
  EXPECT_TRUE(Has(b_before, "rdma_agentd_served_bytes_total",
                  {{"backend", "tcp"}, {"op", "write"}}));
  EXPECT_TRUE(Has(before, "rdma_agentd_notifications_received_total",
                  {{"kind", "dropped"}}));
  EXPECT_TRUE(Has(
      before, "rdma_agentd_rpcs_total",
      {{"method", "rdma.agent.v1.RdmaAgent/CancelTransfer"}, {"code", "OK"}}));
  EXPECT_TRUE(
      Has(before, "rdma_agentd_rpcs_total",
          {{"method", "rdma.agent.v1.Peer/ConnectQueuePair"}, {"code", "OK"}}))
      << "the Peer service's methods too";
  EXPECT_GT(Sum(before, "process_resident_memory_bytes"), 0);
  EXPECT_GT(Sum(before, "process_open_fds"), 0);

  auto local = a_->client().Allocate(kBytes, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  auto remote = b_->client().Allocate(kBytes, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(remote.ok()) << remote.status();
  auto gone = b_->client().Allocate(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(gone.ok()) << gone.status();
  const std::string gone_context = gone->remote_context();
  const uint64_t gone_id = gone->id();
  ASSERT_TRUE(gone->Release().ok());

  client::OpSpec write;
  write.type = v1::OP_TYPE_WRITE_FROM_LOCAL;
  write.local_buffer_id = local->id();
  write.length = kBytes;
  write.remote_context = remote->remote_context();
  client::OpSpec stale;
  stale.type = v1::OP_TYPE_READ_INTO_LOCAL;
  stale.local_buffer_id = local->id();
  stale.length = 4096;
  stale.remote_context = gone_context;
  auto results = a_->client().Submit({write}, absl::Seconds(30));
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
  EXPECT_EQ((*results)[0].backend, "tcp");
  results = a_->client().Submit({stale}, absl::Seconds(30));
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_EQ((*results)[0].status.code(), absl::StatusCode::kNotFound);

  const std::vector<Sample> after = Scrape(*a_);
  const std::vector<Sample> b_after = Scrape(*b_);
  const auto moved = [&](const std::string& name,
                         const std::map<std::string, std::string>& labels) {
    return Sum(after, name, labels) - Sum(before, name, labels);
  };
  EXPECT_EQ(moved("rdma_agentd_ops_total",
                  {{"backend", "tcp"}, {"op", "write"}, {"code", "OK"}}),
            1);
  EXPECT_EQ(moved("rdma_agentd_op_bytes_total",
                  {{"backend", "tcp"}, {"op", "write"}}),
            kBytes);
  EXPECT_EQ(moved("rdma_agentd_ops_total",
                  {{"backend", "tcp"}, {"op", "read"}, {"code", "NOT_FOUND"}}),
            1);
  EXPECT_EQ(moved("rdma_agentd_op_bytes_total", {{"op", "read"}}), 0)
      << "a failed op moves no bytes";
  EXPECT_EQ(
      moved("rdma_agentd_op_duration_seconds_count", {{"backend", "tcp"}}), 2);
  EXPECT_EQ(moved("rdma_agentd_submit_duration_seconds_count", {}), 2);
  EXPECT_GT(moved("rdma_agentd_submit_duration_seconds_sum", {}), 0);
  EXPECT_EQ(
      moved("rdma_agentd_rpcs_total",
            {{"method", "rdma.agent.v1.RdmaAgent/Submit"}, {"code", "OK"}}),
      2)
      << "per-op failures are no RPC failures";
  // Gauges: what A holds now, over all users (no uid label unless
  // --metrics_per_user).
  EXPECT_EQ(Sum(after, "rdma_agentd_registrations"), 1);
  EXPECT_EQ(Sum(after, "rdma_agentd_registered_bytes"), kBytes);
  for (const Sample& sample : after) {
    EXPECT_EQ(sample.labels.count("uid"), 0u) << sample.name;
  }
  EXPECT_EQ(Sum(after, "rdma_agentd_ops_in_flight"), 0);
  // One shape both ways: the peer's host.
  EXPECT_GE(
      Sum(after, "rdma_agentd_peer_links",
          {{"backend", "tcp"}, {"direction", "out"}, {"peer", "127.0.0.1"}}),
      1)
      << "the pooled connection to B";
  EXPECT_GE(
      Sum(b_after, "rdma_agentd_peer_links",
          {{"backend", "tcp"}, {"direction", "in"}, {"peer", "127.0.0.1"}}),
      1);
  // The serving side: B served A's WRITE.
  const auto b_moved = [&](const std::string& name,
                           const std::map<std::string, std::string>& labels) {
    return Sum(b_after, name, labels) - Sum(b_before, name, labels);
  };
  EXPECT_EQ(b_moved("rdma_agentd_served_ops_total",
                    {{"backend", "tcp"}, {"op", "write"}}),
            1);
  EXPECT_EQ(b_moved("rdma_agentd_served_bytes_total",
                    {{"backend", "tcp"}, {"op", "write"}}),
            kBytes);
  EXPECT_EQ(b_moved("rdma_agentd_served_bytes_total", {{"op", "read"}}), 0);
  EXPECT_EQ(moved("rdma_agentd_served_bytes_total", {}), 0)
      << "A served nothing";
  // B refused A's request for the released buffer.
  EXPECT_EQ(Sum(b_after, "rdma_agentd_refusals_total",
                {{"reason", "peer_not_found"}}) -
                Sum(b_before, "rdma_agentd_refusals_total",
                    {{"reason", "peer_not_found"}}),
            1);

  // The logs say who: A names the caller, B names the peer.
  EXPECT_THAT(a_->Log(),
              HasSubstr(absl::StrCat("warning Submit from uid 0 pid ",
                                     ::getpid(), ": READ of 4096 bytes")));
  EXPECT_THAT(a_->Log(), HasSubstr(absl::StrCat("buffer ", gone_id)));
  EXPECT_THAT(b_->Log(),
              HasSubstr(absl::StrCat("warning refused a request from "
                                     "127.0.0.1 for buffer ",
                                     gone_id, ": NOT_FOUND")));
  EXPECT_THAT(a_->Log(),
              HasSubstr(absl::StrCat("debug rdma.agent.v1.RdmaAgent/Submit "
                                     "from uid 0 pid ",
                                     ::getpid(), ": OK in")));
}

TEST_F(MetricsScrapeTest, AClientInALoopCannotFloodTheLog) {
  const std::vector<Sample> before = Scrape(*a_);
  constexpr int kCalls = 300;
  for (int i = 0; i < kCalls; ++i) {
    EXPECT_EQ(a_->client().Release(987654321).code(),
              absl::StatusCode::kNotFound);
  }
  const std::vector<Sample> after = Scrape(*a_);
  const std::map<std::string, std::string> labels = {
      {"method", "rdma.agent.v1.RdmaAgent/Release"}, {"code", "NOT_FOUND"}};
  EXPECT_EQ(Sum(after, "rdma_agentd_rpcs_total", labels) -
                Sum(before, "rdma_agentd_rpcs_total", labels),
            kCalls)
      << "metrics count every call, the log does not";
  const std::string log = a_->Log();
  int warnings = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StrContains(line, "warning rdma.agent.v1.RdmaAgent/Release")) {
      ++warnings;
    }
  }
  // A burst of 20, then one a second.
  EXPECT_GE(warnings, 20);
  EXPECT_LT(warnings, 60) << "the log is flooded";
}

// A family as docs/OPERATING.md's metrics table lists it.
struct DocumentedFamily {
  std::string type;
  std::set<std::string> labels;
};

std::map<std::string, DocumentedFamily> MetricsTable() {
  std::ifstream in(RunfilePath("docs/OPERATING.md"));
  std::map<std::string, DocumentedFamily> families;
  std::string line;
  while (std::getline(in, line)) {
    // | `name` | type | unit | labels | meaning |
    std::vector<std::string> cells = absl::StrSplit(line, " | ");
    if (cells.size() < 5 || !absl::StartsWith(cells[0], "| `") ||
        absl::StartsWith(cells[0], "| `--")) {
      continue;
    }
    const std::string name(
        absl::StripSuffix(absl::StripPrefix(cells[0], "| `"), "`"));
    DocumentedFamily family;
    family.type = cells[1];
    // "-", "a,b", or "- (uid with `--metrics_per_user`)".
    const std::string labels = cells[3].substr(0, cells[3].find(" ("));
    if (labels != "-") {
      for (absl::string_view label : absl::StrSplit(labels, ',')) {
        family.labels.insert(std::string(label));
      }
    }
    families[name] = family;
  }
  return families;
}

TEST_F(MetricsScrapeTest, OperatingListsEveryFamilyWithItsTypeAndLabels) {
  // Some traffic, so that every labelled family has samples.
  auto local = a_->client().Allocate(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  auto remote = b_->client().Allocate(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(remote.ok()) << remote.status();
  client::OpSpec write;
  write.type = v1::OP_TYPE_WRITE_FROM_LOCAL;
  write.local_buffer_id = local->id();
  write.length = 4096;
  write.remote_context = remote->remote_context();
  client::SubmitOptions options;
  options.timeout = absl::Seconds(30);
  options.notification = "ready";
  auto submitted = a_->client().Submit({write}, options);
  ASSERT_TRUE(submitted.ok()) << submitted.status();

  const std::map<std::string, DocumentedFamily> documented = MetricsTable();
  ASSERT_GT(documented.size(), 20u);
  const std::string text = ScrapeText(*a_);
  std::map<std::string, std::string> exposed;  // family -> type
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::ConsumePrefix(&line, "# TYPE ")) continue;
    const std::vector<std::string> words = absl::StrSplit(line, ' ');
    ASSERT_EQ(words.size(), 2u) << line;
    exposed[words[0]] = words[1];
  }
  for (const auto& [name, type] : exposed) {
    auto it = documented.find(name);
    ASSERT_NE(it, documented.end())
        << name << " is exposed but not in docs/OPERATING.md";
    EXPECT_EQ(it->second.type, type) << name;
    if (type == "counter") {
      EXPECT_TRUE(absl::EndsWith(name, "_total")) << name;
    }
  }
  std::map<std::string, std::set<std::string>> labels_seen;
  for (const Sample& sample : Parse(text)) {
    std::string family = sample.name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      if (exposed.count(family) == 0 && absl::EndsWith(family, suffix)) {
        family = family.substr(0, family.size() - strlen(suffix));
      }
    }
    for (const auto& [label, value] : sample.labels) {
      if (label != "le") labels_seen[family].insert(label);
    }
  }
  for (const auto& [name, family] : documented) {
    EXPECT_EQ(exposed.count(name), 1u)
        << name << " is in docs/OPERATING.md but not exposed";
    // Families without samples (no peer links yet) say nothing of labels.
    if (labels_seen.count(name) > 0) {
      EXPECT_EQ(labels_seen[name], family.labels) << name;
    }
  }
}

}  // namespace
}  // namespace rdma_agent::testing
