#include "daemon/directory/agent_record.h"

#include "absl/strings/str_cat.h"
#include "daemon/directory/directory_options.h"
#include "google/protobuf/util/json_util.h"

namespace rdma_agent {

namespace {

std::string Encode(const google::protobuf::Message& record) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  // Serializing a message the agent built cannot fail.
  (void)google::protobuf::util::MessageToJsonString(record, &json, options);
  return json;
}

absl::Status Decode(absl::string_view value, absl::string_view what,
                    google::protobuf::Message* record) {
  if (value.size() > kMaxAgentRecordBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " of ", value.size(), " bytes is over the limit of ",
                     kMaxAgentRecordBytes));
  }
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  const auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(value.data(), value.size()), record,
      options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a valid ", what, ": ", status.message().as_string()));
  }
  return absl::OkStatus();
}

}  // namespace

std::string EncodeAgentRecord(const v1::AgentRecord& record) {
  return Encode(record);
}

absl::StatusOr<v1::AgentRecord> DecodeAgentRecord(absl::string_view value) {
  v1::AgentRecord record;
  absl::Status status = Decode(value, "agent record", &record);
  if (!status.ok()) return status;
  if (record.info().agent_id().empty()) {
    return absl::InvalidArgumentError("agent record without an agent id");
  }
  return record;
}

std::string EncodeNameRecord(const v1::NameRecord& record) {
  return Encode(record);
}

absl::StatusOr<v1::NameRecord> DecodeNameRecord(absl::string_view value) {
  v1::NameRecord record;
  absl::Status status = Decode(value, "name record", &record);
  if (!status.ok()) return status;
  if (record.name().empty() || record.agent_id().empty()) {
    return absl::InvalidArgumentError("name record without a name or owner");
  }
  return record;
}

}  // namespace rdma_agent
