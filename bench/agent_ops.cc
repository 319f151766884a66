#include "bench/agent_ops.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace rdma_agent::bench {

std::vector<client::OpSpec> MakeOps(v1::OpType type, uint64_t local_id,
                                    const std::string& remote_context,
                                    uint64_t op_bytes, int count,
                                    uint64_t window, uint64_t buffer_bytes) {
  const uint64_t slots =
      std::max<uint64_t>(1, std::min(window, buffer_bytes) / op_bytes);
  std::vector<client::OpSpec> ops;
  ops.reserve(count);
  for (int i = 0; i < count; ++i) {
    client::OpSpec op;
    op.type = type;
    op.local_buffer_id = local_id;
    op.local_offset = (i % slots) * op_bytes;
    op.length = op_bytes;
    op.remote_context = remote_context;
    op.remote_offset = (i % slots) * op_bytes;
    ops.push_back(std::move(op));
  }
  return ops;
}

absl::Status RunBatch(client::AgentClient& agent,
                      const std::vector<client::OpSpec>& ops,
                      absl::string_view backend) {
  auto results = agent.Submit(ops, absl::Seconds(120));
  if (!results.ok()) return results.status();
  for (const client::OpResult& result : *results) {
    if (!result.status.ok()) return result.status;
    if (result.backend != backend) {
      return absl::FailedPreconditionError(
          absl::StrCat("op ran on ", result.backend, ", not ", backend));
    }
  }
  return absl::OkStatus();
}

Latency Summarize(std::vector<absl::Duration> samples) {
  Latency latency;
  latency.samples = samples.size();
  if (samples.empty()) return latency;
  std::sort(samples.begin(), samples.end());
  auto at = [&](double quantile) {
    const size_t index = std::min(
        samples.size() - 1, static_cast<size_t>(quantile * samples.size()));
    return absl::ToDoubleMicroseconds(samples[index]);
  };
  absl::Duration sum;
  for (absl::Duration sample : samples) sum += sample;
  latency.p50_us = at(0.50);
  latency.p99_us = at(0.99);
  latency.min_us = absl::ToDoubleMicroseconds(samples.front());
  latency.mean_us =
      absl::ToDoubleMicroseconds(sum) / static_cast<double>(samples.size());
  return latency;
}

Report& Report::Add(absl::string_view key, double value, int decimals) {
  fields_.emplace_back(std::string(key),
                       absl::StrFormat("%.*f", decimals, value));
  return *this;
}

Report& Report::Add(absl::string_view key, absl::string_view value) {
  fields_.emplace_back(std::string(key), std::string(value));
  return *this;
}

Report& Report::AddLatency(absl::string_view prefix, const Latency& latency) {
  Add(absl::StrCat(prefix, "p50_us"), latency.p50_us);
  Add(absl::StrCat(prefix, "p99_us"), latency.p99_us);
  Add(absl::StrCat(prefix, "mean_us"), latency.mean_us);
  Add(absl::StrCat(prefix, "min_us"), latency.min_us);
  Add(absl::StrCat(prefix, "samples"), static_cast<double>(latency.samples), 0);
  return *this;
}

std::string Report::Line() const {
  std::string line = absl::StrFormat("%-18s", name_);
  for (const auto& [key, value] : fields_) {
    absl::StrAppend(&line, " ", key, "=", value);
  }
  return line;
}

}  // namespace rdma_agent::bench
