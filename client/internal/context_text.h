#ifndef RDMA_AGENTD_CLIENT_INTERNAL_CONTEXT_TEXT_H_
#define RDMA_AGENTD_CLIENT_INTERNAL_CONTEXT_TEXT_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rdma_agent::client::internal {

// Decodes standard or web-safe base64 (padding optional, surrounding
// whitespace ignored). INVALID_ARGUMENT if `text` is not base64 or is empty.
absl::StatusOr<std::string> DecodeBase64(absl::string_view text);

// Prints a serialized RemoteBuffer as text proto, with its capability token
// (and ibverbs GIDs) as hex instead of escaped bytes. INVALID_ARGUMENT if
// `serialized` is empty or does not parse as a RemoteBuffer.
absl::StatusOr<std::string> RemoteContextToText(absl::string_view serialized);

}  // namespace rdma_agent::client::internal

#endif  // RDMA_AGENTD_CLIENT_INTERNAL_CONTEXT_TEXT_H_
