#ifndef RDMA_AGENTD_BACKENDS_PEER_TLS_H_
#define RDMA_AGENTD_BACKENDS_PEER_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace grpc {
class ChannelArguments;
class ChannelCredentials;
class ServerCredentials;
}  // namespace grpc

namespace rdma_agent {

// Mutual TLS for the agent-to-agent Peer gRPC service: every agent presents
// a certificate issued by `ca_pem` and accepts only peers that do. Empty =
// plaintext (any host that reaches the Peer port may call it; see
// backends/ibverbs/README.md for what that allows).
struct PeerTls {
  std::string cert_pem;  // this agent's certificate chain
  std::string key_pem;   // its private key
  std::string ca_pem;    // the CA peers' certificates must chain to
  // Name expected in peers' certificates instead of the host dialled
  // (one certificate name for every agent); empty = the host dialled.
  std::string server_name;

  bool enabled() const { return !cert_pem.empty(); }
};

// Reads the three PEM files (all or none: INVALID_ARGUMENT otherwise; an
// unreadable file is INVALID_ARGUMENT naming it). All empty = plaintext.
absl::StatusOr<PeerTls> LoadPeerTls(const std::string& cert_path,
                                    const std::string& key_path,
                                    const std::string& ca_path,
                                    const std::string& server_name = "");

// Server side: requires and verifies a client certificate from the CA when
// `tls` is enabled, plaintext otherwise.
std::shared_ptr<grpc::ServerCredentials> PeerServerCredentials(
    const PeerTls& tls);

// Client side: verifies the server against the CA and presents this agent's
// certificate when `tls` is enabled, plaintext otherwise. Sets the expected
// server name in `args` when tls.server_name is set.
std::shared_ptr<grpc::ChannelCredentials> PeerChannelCredentials(
    const PeerTls& tls, grpc::ChannelArguments* args);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_PEER_TLS_H_
