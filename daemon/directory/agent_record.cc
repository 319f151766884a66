#include "daemon/directory/agent_record.h"

#include "absl/strings/str_cat.h"
#include "daemon/directory/directory_options.h"
#include "google/protobuf/util/json_util.h"

namespace rdma_agent {

std::string EncodeAgentRecord(const v1::AgentRecord& record) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  // Serializing a message the agent built cannot fail.
  (void)google::protobuf::util::MessageToJsonString(record, &json, options);
  return json;
}

absl::StatusOr<v1::AgentRecord> DecodeAgentRecord(absl::string_view value) {
  if (value.size() > kMaxAgentRecordBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("agent record of ", value.size(),
                     " bytes is over the limit of ", kMaxAgentRecordBytes));
  }
  v1::AgentRecord record;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  const auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(value.data(), value.size()), &record,
      options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("not an agent record: ", status.message().as_string()));
  }
  if (record.info().agent_id().empty()) {
    return absl::InvalidArgumentError("agent record without an agent id");
  }
  return record;
}

}  // namespace rdma_agent
