#include "common/net_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace rdma_agent {
namespace {

// The interface of the IPv4 default route, from /proc/net/route.
std::string DefaultRouteInterface() {
  std::ifstream routes("/proc/net/route");
  std::string line;
  std::getline(routes, line);  // header
  while (std::getline(routes, line)) {
    std::istringstream fields(line);
    std::string iface, destination;
    if (fields >> iface >> destination && destination == "00000000") {
      return iface;
    }
  }
  return "";
}

}  // namespace

std::string DefaultAdvertiseHost() {
  const std::string route_iface = DefaultRouteInterface();
  struct ifaddrs* addrs = nullptr;
  if (::getifaddrs(&addrs) != 0) return "127.0.0.1";
  std::string on_route, first_other;
  for (struct ifaddrs* a = addrs; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    if ((a->ifa_flags & IFF_UP) == 0 || (a->ifa_flags & IFF_LOOPBACK) != 0) {
      continue;
    }
    char text[INET_ADDRSTRLEN];
    const auto* in = reinterpret_cast<const struct sockaddr_in*>(a->ifa_addr);
    if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) == nullptr) {
      continue;
    }
    if (on_route.empty() && route_iface == a->ifa_name) on_route = text;
    if (first_other.empty()) first_other = text;
  }
  ::freeifaddrs(addrs);
  if (!on_route.empty()) return on_route;
  if (!first_other.empty()) return first_other;
  return "127.0.0.1";
}

absl::StatusOr<HostPort> ParseHostPort(absl::string_view address) {
  HostPort result;
  absl::string_view port_text;
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos || close + 1 >= address.size() ||
        address[close + 1] != ':') {
      return absl::InvalidArgumentError(
          absl::StrCat("malformed address '", address, "'"));
    }
    result.host = std::string(address.substr(1, close - 1));
    port_text = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos || address.find(':') != colon) {
      return absl::InvalidArgumentError(absl::StrCat(
          "malformed address '", address, "': want host:port or [host]:port"));
    }
    result.host = std::string(address.substr(0, colon));
    port_text = address.substr(colon + 1);
  }
  uint32_t port = 0;
  if (!absl::SimpleAtoi(port_text, &port) || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad port in address '", address, "'"));
  }
  result.port = static_cast<uint16_t>(port);
  return result;
}

std::string JoinHostPort(absl::string_view host, uint16_t port) {
  if (host.find(':') != absl::string_view::npos) {
    return absl::StrCat("[", host, "]:", port);
  }
  return absl::StrCat(host, ":", port);
}

bool IsWildcardHost(absl::string_view host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]" ||
         host == "*";
}

std::string AdvertisedHost(absl::string_view listen_host,
                           absl::string_view chosen,
                           absl::string_view detected) {
  for (absl::string_view host : {chosen, listen_host, detected}) {
    if (!IsWildcardHost(host)) return std::string(host);
  }
  return "127.0.0.1";
}

}  // namespace rdma_agent
