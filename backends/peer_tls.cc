#include "backends/peer_tls.h"

#include <grpc/grpc_security_constants.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/auth_context.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace rdma_agent {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in || text.str().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read the peer TLS ", what, " from ", path));
  }
  return text.str();
}

}  // namespace

absl::StatusOr<PeerTls> LoadPeerTls(const std::string& cert_path,
                                    const std::string& key_path,
                                    const std::string& ca_path,
                                    const std::string& server_name) {
  PeerTls tls;
  const int given = !cert_path.empty() + !key_path.empty() + !ca_path.empty();
  if (given == 0) {
    if (!server_name.empty()) {
      return absl::InvalidArgumentError(
          "a peer TLS server name needs --peer_tls_cert, --peer_tls_key and "
          "--peer_tls_ca");
    }
    return tls;
  }
  if (given != 3) {
    return absl::InvalidArgumentError(
        "peer TLS needs all of --peer_tls_cert, --peer_tls_key and "
        "--peer_tls_ca");
  }
  auto cert = ReadPem(cert_path, "certificate");
  if (!cert.ok()) return cert.status();
  auto key = ReadPem(key_path, "key");
  if (!key.ok()) return key.status();
  auto ca = ReadPem(ca_path, "CA");
  if (!ca.ok()) return ca.status();
  tls.cert_pem = std::move(*cert);
  tls.key_pem = std::move(*key);
  tls.ca_pem = std::move(*ca);
  tls.server_name = server_name;
  return tls;
}

std::shared_ptr<grpc::ServerCredentials> PeerServerCredentials(
    const PeerTls& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = tls.ca_pem;
  options.pem_key_cert_pairs.push_back({tls.key_pem, tls.cert_pem});
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> PeerChannelCredentials(
    const PeerTls& tls, grpc::ChannelArguments* args) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = tls.ca_pem;
  options.pem_private_key = tls.key_pem;
  options.pem_cert_chain = tls.cert_pem;
  if (!tls.server_name.empty() && args != nullptr) {
    args->SetSslTargetNameOverride(tls.server_name);
  }
  return grpc::SslCredentials(options);
}

std::vector<std::string> PeerCertificateNames(const grpc::AuthContext& auth) {
  std::vector<std::string> names;
  if (!auth.IsPeerAuthenticated()) return names;
  for (const char* property :
       {GRPC_X509_CN_PROPERTY_NAME, GRPC_PEER_DNS_PROPERTY_NAME,
        GRPC_PEER_URI_PROPERTY_NAME}) {
    for (const grpc::string_ref& value : auth.FindPropertyValues(property)) {
      std::string name(value.data(), value.size());
      if (std::find(names.begin(), names.end(), name) == names.end()) {
        names.push_back(std::move(name));
      }
    }
  }
  return names;
}

absl::Status CheckPeerAgentId(const PeerTls& tls, const grpc::AuthContext& auth,
                              absl::string_view claimed) {
  if (!tls.enabled()) return absl::OkStatus();
  const std::vector<std::string> names = PeerCertificateNames(auth);
  if (names.empty()) {
    return absl::UnauthenticatedError(
        "the Peer call carries no verified client certificate");
  }
  if (std::find(names.begin(), names.end(), claimed) != names.end()) {
    return absl::OkStatus();
  }
  // Names are the CA's, not the caller's: safe to show, cut all the same.
  std::string shown = absl::StrJoin(names, ", ");
  if (shown.size() > 256) shown = shown.substr(0, 256) + "...";
  std::string agent(claimed.substr(0, 128));
  return absl::PermissionDeniedError(absl::StrCat(
      "the caller claims agent id '", agent,
      "', which its certificate does not name (it names ", shown, ")"));
}

std::string PeerCallerAddress(absl::string_view grpc_peer) {
  absl::string_view address = grpc_peer;
  if (absl::ConsumePrefix(&address, "unix-abstract:") &&
      (absl::StartsWith(address, "ipv4:") ||
       absl::StartsWith(address, "ipv6:"))) {
    return std::string(address.substr(0, address.rfind('/')));
  }
  return std::string(grpc_peer);
}

std::string PeerSourceAddress(absl::string_view peer) {
  const std::string caller = PeerCallerAddress(peer);
  absl::string_view address = caller;
  if (absl::ConsumePrefix(&address, "ipv4:")) {
    return std::string(address.substr(0, address.rfind(':')));
  }
  if (absl::ConsumePrefix(&address, "ipv6:") &&
      absl::StartsWith(address, "[")) {
    return std::string(address.substr(0, address.find(']') + 1));
  }
  return caller;
}

}  // namespace rdma_agent
