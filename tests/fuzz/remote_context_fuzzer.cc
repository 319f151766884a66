// Fuzz target: the remote context of an op, bytes a caller got from some
// peer. Everything the agent does with them before any backend runs: parse
// and check (ParseRemoteContext), pick endpoints (FindEndpoint), and read the
// tcp and ibverbs addresses in them.
//
// Oracle: no crash or undefined behaviour; a refusal is INVALID_ARGUMENT with
// a message; an accepted context has every field the check promises and
// survives a serialise/parse round trip unchanged; addresses that parse
// round-trip through JoinHostPort/ParseHostPort.
#include <cstddef>
#include <cstdint>
#include <string>

#include "backends/backend.h"
#include "common/net_address.h"
#include "daemon/ops/remote_context.h"
#include "google/protobuf/stubs/logging.h"
#include "tests/fuzz/fuzz_check.h"

namespace rdma_agent {
namespace {

void CheckAddressRoundTrip(const std::string& address) {
  auto parsed = ParseHostPort(address);
  if (!parsed.ok()) {
    FUZZ_CHECK(parsed.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  const std::string joined = JoinHostPort(parsed->host, parsed->port);
  auto again = ParseHostPort(joined);
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(again->host == parsed->host);
  FUZZ_CHECK(again->port == parsed->port);
}

void FuzzOne(const std::string& bytes) {
  auto parsed = ParseRemoteContext(bytes);
  if (!parsed.ok()) {
    FUZZ_CHECK(parsed.status().code() == absl::StatusCode::kInvalidArgument);
    FUZZ_CHECK(!parsed.status().message().empty());
    return;
  }
  const v1::RemoteBuffer& remote = **parsed;
  FUZZ_CHECK(!remote.agent_id().empty());
  FUZZ_CHECK(remote.agent_epoch() != 0);
  FUZZ_CHECK(remote.size_bytes() != 0);
  FUZZ_CHECK(!remote.token().empty());
  FUZZ_CHECK(remote.endpoints_size() > 0);
  FUZZ_CHECK(AllowsRead(remote.access()) || AllowsWrite(remote.access()));

  // What the agent forwards or re-parses must mean the same thing.
  const std::string again = remote.SerializeAsString();
  auto reparsed = ParseRemoteContext(again);
  FUZZ_CHECK(reparsed.ok());
  FUZZ_CHECK((*reparsed)->SerializeAsString() == again);

  for (const char* name : {"memory", "tcp", "ibverbs", ""}) {
    const v1::BackendEndpoint* endpoint = FindEndpoint(remote, name);
    if (endpoint == nullptr) continue;
    FUZZ_CHECK(endpoint->backend() == name);
    if (endpoint->has_tcp()) {
      const v1::TcpEndpoint& tcp = endpoint->tcp();
      (void)IsWildcardHost(tcp.host());
      if (tcp.port() <= 65535) {
        CheckAddressRoundTrip(
            JoinHostPort(tcp.host(), static_cast<uint16_t>(tcp.port())));
      }
    }
    if (endpoint->has_ibverbs()) {
      CheckAddressRoundTrip(endpoint->ibverbs().peer_address());
    }
  }
}

}  // namespace
}  // namespace rdma_agent

// Invalid UTF-8 in a string field makes libprotobuf log an error line per
// parse; millions of them would only slow fuzzing down.
extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  rdma_agent::FuzzOne(std::string(reinterpret_cast<const char*>(data), size));
  return 0;
}
