#ifndef RDMA_AGENTD_CLIENT_INTERNAL_HTTP_GET_H_
#define RDMA_AGENTD_CLIENT_INTERNAL_HTTP_GET_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace rdma_agent::client {

// The body of GET http://<address><path> (address "host:port"), on
// civetweb's client. UNAVAILABLE naming the address when it cannot be
// reached or answers late; the status code's gRPC equivalent (with the
// body) when it is not 200.
absl::StatusOr<std::string> HttpGet(const std::string& address,
                                    const std::string& path,
                                    absl::Duration timeout);

}  // namespace rdma_agent::client

#endif  // RDMA_AGENTD_CLIENT_INTERNAL_HTTP_GET_H_
