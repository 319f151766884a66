#ifndef RDMA_AGENTD_DAEMON_DIRECTORY_AGENT_RECORD_H_
#define RDMA_AGENTD_DAEMON_DIRECTORY_AGENT_RECORD_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "rdma/agent/v1/agent.pb.h"

namespace rdma_agent {

namespace v1 = ::rdma::agent::v1;

// Agent records are stored as protobuf JSON, so that an operator reads them
// with `etcdctl get --prefix /rdma-agentd/agents/`; unknown fields are
// ignored on the way back in, so that older agents read newer records.
std::string EncodeAgentRecord(const v1::AgentRecord& record);

// INVALID_ARGUMENT when `value` is over kMaxAgentRecordBytes or not an
// AgentRecord with an agent id.
absl::StatusOr<v1::AgentRecord> DecodeAgentRecord(absl::string_view value);

// Name records, the same way (the context in base64).
std::string EncodeNameRecord(const v1::NameRecord& record);
absl::StatusOr<v1::NameRecord> DecodeNameRecord(absl::string_view value);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_DIRECTORY_AGENT_RECORD_H_
