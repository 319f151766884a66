#ifndef RDMA_AGENTD_BENCH_AGENT_OPS_H_
#define RDMA_AGENTD_BENCH_AGENT_OPS_H_

// What the bench's tests share: batches of ops through an agent's Submit,
// the statistics of their times, and a tiny "name key=value ..." report.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/rdma_agent_client.h"

namespace rdma_agent::bench {

namespace v1 = ::rdma::agent::v1;

// `count` ops of `op_bytes` from `local` against `remote_context`, cycling
// through the first `window` bytes of both buffers (never past `buffer_bytes`,
// the smaller buffer's size).
std::vector<client::OpSpec> MakeOps(v1::OpType type, uint64_t local_id,
                                    const std::string& remote_context,
                                    uint64_t op_bytes, int count,
                                    uint64_t window, uint64_t buffer_bytes);

// Submits `ops` as one batch; OK only if every op succeeded on `backend`.
absl::Status RunBatch(client::AgentClient& agent,
                      const std::vector<client::OpSpec>& ops,
                      absl::string_view backend);

// Runs `step` until `duration` has passed (at least `min_steps` times);
// returns how many steps ran and how long they took.
struct Timed {
  int64_t steps = 0;
  absl::Duration elapsed;
};
template <typename Step>
absl::StatusOr<Timed> RunFor(absl::Duration duration, int64_t min_steps,
                             Step&& step) {
  Timed timed;
  const absl::Time start = absl::Now();
  const absl::Time end = start + duration;
  while (timed.steps < min_steps || absl::Now() < end) {
    if (absl::Status status = step(); !status.ok()) return status;
    ++timed.steps;
  }
  timed.elapsed = absl::Now() - start;
  return timed;
}

// Percentiles of a set of times, in microseconds.
struct Latency {
  double p50_us = 0;
  double p99_us = 0;
  double mean_us = 0;
  double min_us = 0;
  size_t samples = 0;
};
Latency Summarize(std::vector<absl::Duration> samples);

// One result line: "name key=value key=value ...", read by compare.sh.
class Report {
 public:
  explicit Report(std::string name) : name_(std::move(name)) {}
  Report& Add(absl::string_view key, double value, int decimals = 1);
  Report& Add(absl::string_view key, absl::string_view value);
  Report& AddLatency(absl::string_view prefix, const Latency& latency);
  std::string Line() const;

 private:
  std::string name_;
  std::vector<std::pair<std::string, std::string>> fields_;
};

}  // namespace rdma_agent::bench

#endif  // RDMA_AGENTD_BENCH_AGENT_OPS_H_
