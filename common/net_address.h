#ifndef RDMA_AGENTD_COMMON_NET_ADDRESS_H_
#define RDMA_AGENTD_COMMON_NET_ADDRESS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rdma_agent {

// The address peers should dial to reach this host: the IPv4 address of the
// interface that holds the default route, else the first non-loopback
// address, else 127.0.0.1. Never a wildcard address.
std::string DefaultAdvertiseHost();

// Splits "host:port" / "[v6-literal]:port". INVALID_ARGUMENT when malformed
// (a bare IPv6 literal is ambiguous and refused).
struct HostPort {
  std::string host;
  uint16_t port = 0;
};
absl::StatusOr<HostPort> ParseHostPort(absl::string_view address);

// "host:port", bracketing IPv6 literals.
std::string JoinHostPort(absl::string_view host, uint16_t port);

// True for addresses that mean "every interface" ("", 0.0.0.0, ::, [::], *).
bool IsWildcardHost(absl::string_view host);

// The host others are told to dial to reach a listener bound to
// `listen_host`, never a wildcard: `chosen` (an operator's
// --advertise_host: NAT, containers) unless empty or a wildcard; else
// `listen_host` when the listener is bound to that one address (it is
// reachable only there; any other host would be a closed port); else
// `detected` (the default-route address) unless empty or a wildcard; else
// loopback.
std::string AdvertisedHost(absl::string_view listen_host,
                           absl::string_view chosen,
                           absl::string_view detected);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_NET_ADDRESS_H_
