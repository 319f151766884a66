#ifndef RDMA_AGENTD_BACKENDS_PEER_TLS_H_
#define RDMA_AGENTD_BACKENDS_PEER_TLS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace grpc {
class AuthContext;
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

// The names the certificate that authenticated a Peer call gives its
// agent: its subject common name (CN) and its subjectAltName DNS names and
// URIs. Empty when no certificate did (plaintext).
std::vector<std::string> PeerCertificateNames(const grpc::AuthContext& auth);

// Under mutual TLS (`tls` enabled) a Peer caller is the agent its
// certificate names: OK when `claimed` (the request's agent_id) is one of
// PeerCertificateNames(auth), UNAUTHENTICATED when the call carries no
// verified certificate, PERMISSION_DENIED naming both otherwise. Without
// TLS, OK: the claim is a label only and never selects anything.
absl::Status CheckPeerAgentId(const PeerTls& tls, const grpc::AuthContext& auth,
                              absl::string_view claimed);

// The caller's address ("ipv4:10.0.0.2:5555") from gRPC's peer string of
// a Peer call: the agent's Peer listener splices connections to gRPC over
// Unix sockets named after the caller ("unix-abstract:ipv4:10.0.0.2:5555/7",
// daemon/peer_gate.h), which this undoes; other strings are returned as
// they are.
std::string PeerCallerAddress(absl::string_view grpc_peer);

// The address a Peer call came from, without its port, from gRPC's peer
// string: "10.0.0.2" from "ipv4:10.0.0.2:5555", "[fe80::1]" from
// "ipv6:[fe80::1]:5555"; any other string whole. What per-source bounds
// count by: one host's connections and sessions share it, whatever port
// they come from.
std::string PeerSourceAddress(absl::string_view peer);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_BACKENDS_PEER_TLS_H_
