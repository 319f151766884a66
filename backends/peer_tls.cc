#include "backends/peer_tls.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

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

}  // namespace rdma_agent
