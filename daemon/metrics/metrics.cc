#include "daemon/metrics/metrics.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/metrics/process_metrics.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace rdma_agent {
namespace {

namespace v1 = ::rdma::agent::v1;

// 10 us .. 10 s, about three buckets a decade: RDMA ops to stalled peers.
const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {
  static const auto* const kBuckets =
      new prometheus::Histogram::BucketBoundaries{
          1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10};
  return *kBuckets;
}

std::string OpName(v1::OpType type) {
  switch (type) {
    case v1::OP_TYPE_READ_INTO_LOCAL:
      return "read";
    case v1::OP_TYPE_WRITE_FROM_LOCAL:
      return "write";
    default:
      return "invalid";
  }
}

}  // namespace

std::vector<GaugeSample> CapLabelValues(std::vector<GaugeSample> samples,
                                        const std::string& label,
                                        size_t max_values) {
  // Groups: samples alike in every label but `label`.
  std::map<std::map<std::string, std::string>, std::vector<GaugeSample>> groups;
  std::vector<GaugeSample> out;
  for (GaugeSample& sample : samples) {
    auto others = sample.labels;
    if (others.erase(label) == 0) {
      out.push_back(std::move(sample));
      continue;
    }
    groups[std::move(others)].push_back(std::move(sample));
  }
  for (auto& [others, group] : groups) {
    // Largest first; by value of the label among equals, so that which
    // values keep their series does not change from scrape to scrape.
    std::sort(group.begin(), group.end(),
              [&](const GaugeSample& a, const GaugeSample& b) {
                if (a.value != b.value) return a.value > b.value;
                return a.labels.at(label) < b.labels.at(label);
              });
    GaugeSample rest{others, 0};
    rest.labels[label] = "other";
    for (size_t i = 0; i < group.size(); ++i) {
      if (i < max_values) {
        out.push_back(std::move(group[i]));
      } else {
        rest.value += group[i].value;
      }
    }
    if (group.size() > max_values) out.push_back(std::move(rest));
  }
  return out;
}

// Gauge and counter families read through callbacks when scraped.
class AgentMetrics::Callbacks : public prometheus::Collectable {
 public:
  void Add(std::string name, std::string help, prometheus::MetricType type,
           std::function<std::vector<GaugeSample>()> read) {
    absl::MutexLock lock(&mu_);
    families_.push_back(
        {std::move(name), std::move(help), type, std::move(read)});
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    absl::MutexLock lock(&mu_);
    std::vector<prometheus::MetricFamily> out;
    for (const Family& family : families_) {
      prometheus::MetricFamily collected;
      collected.name = family.name;
      collected.help = family.help;
      collected.type = family.type;
      for (const GaugeSample& sample : family.read()) {
        prometheus::ClientMetric metric;
        for (const auto& [name, value] : sample.labels) {
          metric.label.push_back({name, value});
        }
        if (family.type == prometheus::MetricType::Counter) {
          metric.counter.value = sample.value;
        } else {
          metric.gauge.value = sample.value;
        }
        collected.metric.push_back(std::move(metric));
      }
      out.push_back(std::move(collected));
    }
    return out;
  }

 private:
  struct Family {
    std::string name;
    std::string help;
    prometheus::MetricType type;
    std::function<std::vector<GaugeSample>()> read;
  };
  mutable absl::Mutex mu_;
  std::vector<Family> families_ ABSL_GUARDED_BY(mu_);
};

AgentMetrics::AgentMetrics(absl::string_view version,
                           absl::string_view revision)
    : registry_(std::make_shared<prometheus::Registry>()),
      callbacks_(std::make_shared<Callbacks>()),
      rpcs_(prometheus::BuildCounter()
                .Name("rdma_agentd_rpcs_total")
                .Help("RPCs answered (API and Peer), by method and gRPC status "
                      "code")
                .Register(*registry_)),
      ops_(prometheus::BuildCounter()
               .Name("rdma_agentd_ops_total")
               .Help("Ops ended, by backend, op type and gRPC status code")
               .Register(*registry_)),
      bytes_(prometheus::BuildCounter()
                 .Name("rdma_agentd_op_bytes_total")
                 .Help("Bytes moved by successful ops, by backend and op type")
                 .Register(*registry_)),
      op_seconds_(prometheus::BuildHistogram()
                      .Name("rdma_agentd_op_duration_seconds")
                      .Help("Time the backend took for the batch an op ran "
                            "in, by backend")
                      .Register(*registry_)),
      submit_seconds_(prometheus::BuildHistogram()
                          .Name("rdma_agentd_submit_duration_seconds")
                          .Help("Time from a Submit's arrival to its results")
                          .Register(*registry_)
                          .Add({}, LatencyBuckets())),
      retries_(prometheus::BuildCounter()
                   .Name("rdma_agentd_op_retries_total")
                   .Help("Ops that failed UNAVAILABLE on one backend and were "
                         "retried on the next")
                   .Register(*registry_)),
      refusals_(prometheus::BuildCounter()
                    .Name("rdma_agentd_refusals_total")
                    .Help("Requests refused to protect the agent, by reason")
                    .Register(*registry_)),
      notifications_sent_(
          prometheus::BuildCounter()
              .Name("rdma_agentd_notifications_sent_total")
              .Help("Notifications of this agent's batches to remote buffers, "
                    "by the backend that carried them and the outcome")
              .Register(*registry_)) {
  prometheus::BuildGauge()
      .Name("rdma_agentd_build_info")
      .Help("The running agent's version and source revision")
      .Register(*registry_)
      .Add({{"version", std::string(version)},
            {"revision", std::string(revision)}})
      .Set(1);
}

void AgentMetrics::DeclareBackends(const std::vector<std::string>& backends) {
  for (size_t i = 0; i < backends.size(); ++i) {
    for (const char* op : {"read", "write"}) {
      ops_.Add({{"backend", backends[i]}, {"op", op}, {"code", "OK"}});
      bytes_.Add({{"backend", backends[i]}, {"op", op}});
    }
    notifications_sent_.Add({{"backend", backends[i]}, {"code", "OK"}});
    // Routing falls back from a backend to a later (slower) one only.
    for (size_t j = i + 1; j < backends.size(); ++j) {
      retries_.Add({{"from", backends[i]}, {"to", backends[j]}});
    }
  }
  // ObservePeerRefusals' reasons: the codes a peer request is refused with.
  for (const char* reason :
       {"peer_not_found", "peer_permission_denied", "peer_out_of_range",
        "peer_failed_precondition", "peer_invalid_argument"}) {
    refusals_.Add({{"reason", reason}});
  }
}

void AgentMetrics::DeclareRpcMethods(const std::vector<std::string>& methods) {
  for (const std::string& method : methods) {
    rpcs_.Add({{"method", method}, {"code", "OK"}});
  }
}

AgentMetrics::OpSeries AgentMetrics::SeriesFor(absl::string_view backend,
                                               v1::OpType type,
                                               absl::StatusCode code) {
  const std::string op = OpName(type);
  const std::string backend_name(backend.empty() ? "none" : backend);
  const auto key = std::make_tuple(backend_name, op, static_cast<int>(code));
  absl::MutexLock lock(&series_mu_);
  auto it = series_.find(key);
  if (it != series_.end()) return it->second;
  OpSeries series;
  series.ops = &ops_.Add({{"backend", backend_name},
                          {"op", op},
                          {"code", absl::StatusCodeToString(code)}});
  if (code == absl::StatusCode::kOk) {
    series.bytes = &bytes_.Add({{"backend", backend_name}, {"op", op}});
  }
  series.seconds =
      &op_seconds_.Add({{"backend", backend_name}}, LatencyBuckets());
  // Codes outside the canonical ones (a peer's) are not kept: the map stays
  // as small as the label sets it stands for.
  if (static_cast<int>(code) >= 0 && static_cast<int>(code) <= 16) {
    series_.emplace(key, series);
  }
  return series;
}

void AgentMetrics::RecordOps(absl::string_view backend, v1::OpType type,
                             absl::StatusCode code, uint64_t count,
                             uint64_t bytes, absl::Duration latency) {
  if (count == 0) return;
  const OpSeries series = SeriesFor(backend, type, code);
  series.ops->Increment(static_cast<double>(count));
  if (series.bytes != nullptr) {
    series.bytes->Increment(static_cast<double>(bytes));
  }
  // `count` observations of the same latency: one bucket update.
  const auto& buckets = LatencyBuckets();
  const double seconds = absl::ToDoubleSeconds(latency);
  // Reused by each thread: no allocation per batch.
  thread_local std::vector<double> increments;
  increments.assign(buckets.size() + 1, 0);
  increments[static_cast<size_t>(
      std::lower_bound(buckets.begin(), buckets.end(), seconds) -
      buckets.begin())] = static_cast<double>(count);
  series.seconds->ObserveMultiple(increments,
                                  seconds * static_cast<double>(count));
}

void AgentMetrics::RecordRpc(absl::string_view method, absl::StatusCode code,
                             absl::Duration latency) {
  rpcs_
      .Add({{"method", std::string(method)},
            {"code", absl::StatusCodeToString(code)}})
      .Increment();
  if (absl::EndsWith(method, "RdmaAgent/Submit")) RecordSubmit(latency);
}

void AgentMetrics::RecordSubmit(absl::Duration latency) {
  submit_seconds_.Observe(absl::ToDoubleSeconds(latency));
}

void AgentMetrics::RecordRetry(absl::string_view from, absl::string_view to) {
  retries_.Add({{"from", std::string(from)}, {"to", std::string(to)}})
      .Increment();
}

void AgentMetrics::RecordNotificationSent(absl::string_view backend,
                                          absl::StatusCode code) {
  notifications_sent_
      .Add({{"backend", std::string(backend)},
            {"code", absl::StatusCodeToString(code)}})
      .Increment();
}

void AgentMetrics::RecordRefusal(absl::string_view reason) {
  refusals_.Add({{"reason", std::string(reason)}}).Increment();
}

void AgentMetrics::AddGauge(const std::string& name, const std::string& help,
                            std::function<std::vector<GaugeSample>()> read) {
  callbacks_->Add(name, help, prometheus::MetricType::Gauge, std::move(read));
}

void AgentMetrics::AddCounter(const std::string& name, const std::string& help,
                              std::function<std::vector<GaugeSample>()> read) {
  callbacks_->Add(name, help, prometheus::MetricType::Counter, std::move(read));
}

std::string AgentMetrics::Scrape() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  std::vector<prometheus::MetricFamily> read = callbacks_->Collect();
  families.insert(families.end(), read.begin(), read.end());
  std::vector<prometheus::MetricFamily> process = CollectProcessMetrics();
  families.insert(families.end(), process.begin(), process.end());
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

}  // namespace rdma_agent
