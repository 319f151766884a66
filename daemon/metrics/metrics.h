#ifndef RDMA_AGENTD_DAEMON_METRICS_METRICS_H_
#define RDMA_AGENTD_DAEMON_METRICS_METRICS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "rdma/agent/v1/types.pb.h"

namespace rdma_agent {

// The metrics endpoint's switches and bounds (AgentOptions::metrics; the
// flags of the same names in daemon/exe/flags.cc).
struct MetricsOptions {
  // Serve the per-user gauges (registrations, registered bytes, watched
  // clients) with a uid label. Whoever reaches the endpoint then learns
  // which local users use the agent and how much; off, those gauges are
  // totals over all users. --metrics_per_user.
  bool per_user = false;
  // Connections the endpoint holds at once; past this, a new connection
  // closes the oldest one still sending its request.
  // --metrics_max_connections.
  size_t max_connections = 64;
  // How long one connection may take, request in and answer out.
  // --metrics_request_timeout.
  absl::Duration request_timeout = absl::Seconds(10);
  // Peers named in rdma_agentd_peer_links, per backend and direction (those
  // with the most links); the others are summed under peer="other".
  // --metrics_max_peers.
  size_t max_peers = 64;
};

// A labelled value read at scrape time (registrations per user, connections
// per peer...), for state the agent already keeps: nothing is counted twice.
struct GaugeSample {
  std::map<std::string, std::string> labels;
  double value = 0;
};

// `samples` with at most `max_values` distinct values of label `label` in
// each group of samples alike in every other label: the values with the
// largest samples keep theirs, the rest are summed into one sample labelled
// "other". For labels whose values come from outside (peer addresses): the
// number of series stays bounded whoever connects.
std::vector<GaugeSample> CapLabelValues(std::vector<GaugeSample> samples,
                                        const std::string& label,
                                        size_t max_values);

// The agent's Prometheus metrics (names prefixed rdma_agentd_). Counters and
// histograms are updated on the data path; gauges of state the agent keeps
// anyway are read through callbacks at scrape time.
//
// Thread-safe.
class AgentMetrics {
 public:
  // build_info carries `version` and `revision` (the source revision of a
  // stamped build, "unknown" otherwise).
  AgentMetrics(absl::string_view version, absl::string_view revision);
  AgentMetrics(const AgentMetrics&) = delete;
  AgentMetrics& operator=(const AgentMetrics&) = delete;

  // `count` ops ended alike: by backend ("" when no backend could carry
  // them), op type and status code; `bytes` (their total) count when they
  // succeeded. `latency` is the time their backend took for the batch they
  // ran in. Callers group a Submit's ops so that a batch of thousands costs
  // a few label lookups, not one each.
  void RecordOps(absl::string_view backend, ::rdma::agent::v1::OpType type,
                 absl::StatusCode code, uint64_t count, uint64_t bytes,
                 absl::Duration latency);
  void RecordOp(absl::string_view backend, ::rdma::agent::v1::OpType type,
                absl::StatusCode code, uint64_t bytes, absl::Duration latency) {
    RecordOps(backend, type, code, 1, bytes, latency);
  }
  // One RPC of the API ended with `code` after `latency`; `method` is
  // "package.Service/Method", or "unknown" (the caller bounds it: every
  // value is a series for the agent's life). Submit's latency also goes to
  // its histogram.
  void RecordRpc(absl::string_view method, absl::StatusCode code,
                 absl::Duration latency);
  // One Submit ended after `latency`.
  void RecordSubmit(absl::Duration latency);
  // An op failed UNAVAILABLE on `from` and was retried on `to`.
  void RecordRetry(absl::string_view from, absl::string_view to);
  // Something was refused to protect the agent (a limit, a stranger).
  void RecordRefusal(absl::string_view reason);
  // A batch's notification to one remote buffer ended with `code` (sent by
  // `backend`; empty when it was not sent).
  void RecordNotificationSent(absl::string_view backend, absl::StatusCode code);

  // Creates, at zero, the series of every labelled counter family for the
  // label values known at start: ops and bytes by `backends` (in routing
  // order) and op type, retries from each backend to each later one,
  // notifications sent by each backend, and the peer refusal reasons. A
  // rate() or an alert then sees the series before the first event.
  void DeclareBackends(const std::vector<std::string>& backends);
  // Likewise rdma_agentd_rpcs_total{code="OK"} for each of `methods`
  // ("package.Service/Method").
  void DeclareRpcMethods(const std::vector<std::string>& methods);

  // Adds a gauge family whose samples `read` returns at every scrape.
  void AddGauge(const std::string& name, const std::string& help,
                std::function<std::vector<GaugeSample>()> read);
  // Adds a counter family (`name` ends in _total) whose samples `read`
  // returns at every scrape: counts the agent keeps anyway, never
  // decreasing.
  void AddCounter(const std::string& name, const std::string& help,
                  std::function<std::vector<GaugeSample>()> read);

  // Everything, in the Prometheus text exposition format.
  std::string Scrape() const;

 private:
  class Callbacks;
  // The series one group of ops is counted in.
  struct OpSeries {
    prometheus::Counter* ops = nullptr;
    prometheus::Counter* bytes = nullptr;  // OK groups only
    prometheus::Histogram* seconds = nullptr;
  };

  // The series of (backend, op, code), found in their families once: a
  // family's lookup builds label maps (a few dozen allocations), which a
  // batch's end must not pay. Series are never removed, so the pointers
  // stay valid.
  OpSeries SeriesFor(absl::string_view backend, ::rdma::agent::v1::OpType type,
                     absl::StatusCode code);

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<Callbacks> callbacks_;
  prometheus::Family<prometheus::Counter>& rpcs_;
  prometheus::Family<prometheus::Counter>& ops_;
  prometheus::Family<prometheus::Counter>& bytes_;
  prometheus::Family<prometheus::Histogram>& op_seconds_;
  prometheus::Histogram& submit_seconds_;
  prometheus::Family<prometheus::Counter>& retries_;
  prometheus::Family<prometheus::Counter>& refusals_;
  prometheus::Family<prometheus::Counter>& notifications_sent_;
  absl::Mutex series_mu_;
  // By backend, op name and code: a few dozen at most (backends, 3 op
  // names, 17 codes).
  absl::flat_hash_map<std::tuple<std::string, std::string, int>, OpSeries>
      series_ ABSL_GUARDED_BY(series_mu_);
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_METRICS_METRICS_H_
