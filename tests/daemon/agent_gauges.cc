#include "tests/daemon/agent_gauges.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "client/internal/http_get.h"

namespace rdma_agent::testing {

absl::StatusOr<double> ScrapeSum(AgentProcess& agent, const std::string& name) {
  auto client = agent.NewClient();
  if (!client.ok()) return client.status();
  auto info = (*client)->GetInfo();
  if (!info.ok()) return info.status();
  if (info->metrics_address().empty()) {
    return absl::UnavailableError("the agent serves no metrics");
  }
  auto text =
      client::HttpGet(info->metrics_address(), "/metrics", absl::Seconds(20));
  if (!text.ok()) return text.status();
  double sum = 0;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    const absl::string_view series = line.substr(0, space);
    if (series.substr(0, series.find('{')) != name) continue;
    double value = 0;
    if (!absl::SimpleAtod(line.substr(space + 1), &value)) {
      return absl::InternalError(absl::StrCat("unreadable sample: ", line));
    }
    sum += value;
  }
  return sum;
}

}  // namespace rdma_agent::testing
