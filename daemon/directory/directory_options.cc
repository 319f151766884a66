#include "daemon/directory/directory_options.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace rdma_agent {
namespace {

constexpr absl::string_view kEtcdScheme = "etcd://";

absl::Status CheckEndpoint(absl::string_view endpoint) {
  const size_t colon = endpoint.rfind(':');
  uint32_t port = 0;
  if (colon == absl::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(endpoint.substr(colon + 1), &port) || port == 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--directory: \"", endpoint,
                     "\" is not host:port (e.g. etcd://10.0.0.5:2379)"));
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<std::string> DirectoryOptions::EtcdEndpoints() const {
  absl::string_view rest = address;
  if (!absl::ConsumePrefix(&rest, kEtcdScheme)) return {};
  return absl::StrSplit(rest, ',', absl::SkipEmpty());
}

absl::Status DirectoryOptions::Validate() const {
  if (address != "local") {
    if (!absl::StartsWith(address, kEtcdScheme)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--directory must be local or etcd://host:port[,host:port...], not "
          "\"",
          address, "\""));
    }
    const std::vector<std::string> endpoints = EtcdEndpoints();
    if (endpoints.empty()) {
      return absl::InvalidArgumentError(
          "--directory=etcd:// names no endpoint");
    }
    for (const std::string& endpoint : endpoints) {
      absl::Status status = CheckEndpoint(endpoint);
      if (!status.ok()) return status;
    }
  }
  if (prefix.size() < 2 || prefix.front() != '/' || prefix.back() == '/' ||
      prefix.size() > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--directory_prefix must start with / and not end with one (at most "
        "256 bytes), not \"",
        prefix, "\""));
  }
  if (lease_ttl < absl::Seconds(2) || lease_ttl > absl::Hours(1)) {
    return absl::InvalidArgumentError(
        "--directory_lease_ttl must be 2s to 1h (etcd counts leases in whole "
        "seconds, and the agent renews every third of it)");
  }
  if (call_timeout <= absl::ZeroDuration() || call_timeout > lease_ttl) {
    return absl::InvalidArgumentError(
        "--directory_call_timeout must be positive and at most "
        "--directory_lease_ttl");
  }
  if (cert_file.empty() != key_file.empty()) {
    return absl::InvalidArgumentError(
        "--directory_cert_file and --directory_key_file go together");
  }
  if (!cert_file.empty() && ca_file.empty()) {
    return absl::InvalidArgumentError(
        "--directory_cert_file needs --directory_ca_file (TLS)");
  }
  if (user.empty() != password_file.empty()) {
    return absl::InvalidArgumentError(
        "--directory_user and --directory_password_file go together");
  }
  if (max_names_per_user < 1 || max_names_total < max_names_per_user) {
    return absl::InvalidArgumentError(
        "--max_names_per_user must be at least 1 and at most "
        "--max_names_total");
  }
  if (max_listed_agents < 1) {
    return absl::InvalidArgumentError(
        "--directory_max_listed_agents must be at least 1");
  }
  return absl::OkStatus();
}

}  // namespace rdma_agent
