#include "backends/tcp/tcp_backend.h"

#include <cassert>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "backends/tcp/notify_client.h"
#include "backends/tcp/socket_util.h"
#include "backends/tcp/wire.h"
#include "common/log_text.h"
#include "common/net_address.h"

namespace rdma_agent::tcp {

absl::StatusOr<std::unique_ptr<TcpBackend>> TcpBackend::Create(
    TcpOptions options, const BackendEnvironment& env) {
  if (env.directory == nullptr) {
    return absl::InvalidArgumentError("tcp backend needs a buffer directory");
  }
  if (options.client.connections_per_peer < 1 ||
      options.client.max_in_flight < 1 || options.client.chunk_bytes < 1 ||
      options.client.chunk_bytes > kMaxPayloadBytes ||
      options.client.socket_buffer_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tcp options out of range: connections per peer and max in flight "
        "must be >= 1, chunk bytes in [1, ",
        kMaxPayloadBytes, "], socket buffer bytes >= 0"));
  }
  const bool default_listen = options.listen.empty();
  if (default_listen) {
    // Serve where peers are told to dial, not on every interface.
    options.listen = JoinHostPort(
        IsWildcardHost(env.advertise_host) ? "127.0.0.1" : env.advertise_host,
        TcpOptions::kDefaultPort);
  }
  auto listen = ParseHostPort(options.listen);
  if (!listen.ok()) return listen.status();

  std::string advertise = options.advertise_host;
  if (!advertise.empty() && IsWildcardHost(advertise)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tcp advertise host \"", advertise, "\" is a wildcard address"));
  }
  if (advertise.empty()) {
    advertise = AdvertisedHost(
        listen->host, env.advertise_host_explicit ? env.advertise_host : "",
        env.advertise_host);
  }

  auto client = DataClient::Create(options.client);
  if (!client.ok()) return client.status();
  DataServerOptions server_options = options.server;
  server_options.zero_copy_send = options.client.zero_copy_send;
  server_options.socket_buffer_bytes = options.client.socket_buffer_bytes;
  server_options.notifications = env.notifications;
  auto server = DataServer::Start(*listen, env.directory, server_options);
  if (!server.ok()) {
    // An advertise host that is not this host's (NAT) cannot be bound.
    return absl::Status(
        server.status().code(),
        absl::StrCat("tcp data plane: ", server.status().message(),
                     default_listen ? " (listening on the advertise host by "
                                      "default; set --tcp_listen)"
                                    : ""));
  }
  return std::unique_ptr<TcpBackend>(
      new TcpBackend(std::move(options), env, std::move(advertise),
                     std::move(*client), std::move(*server)));
}

TcpBackend::TcpBackend(TcpOptions options, BackendEnvironment env,
                       std::string advertise_host,
                       std::unique_ptr<DataClient> client,
                       std::unique_ptr<DataServer> server)
    : options_(std::move(options)),
      env_(std::move(env)),
      advertise_host_(std::move(advertise_host)),
      client_(std::move(client)),
      server_(std::move(server)) {}

v1::TransportInfo TcpBackend::transport_info() const {
  v1::TransportInfo info;
  info.add_addresses(JoinHostPort(advertise_host_, port()));
  auto& attributes = *info.mutable_attributes();
  // The address bound, with the port actually bound (":0" asks for any).
  auto listen = ParseHostPort(options_.listen);
  attributes["listen"] =
      listen.ok() ? JoinHostPort(listen->host, port()) : options_.listen;
  attributes["connections_per_peer"] =
      absl::StrCat(options_.client.connections_per_peer);
  attributes["chunk_bytes"] = absl::StrCat(options_.client.chunk_bytes);
  attributes["max_in_flight"] = absl::StrCat(options_.client.max_in_flight);
  attributes["in_flight_bytes"] = absl::StrCat(options_.client.in_flight_bytes);
  attributes["server_threads"] = absl::StrCat(options_.server.threads);
  attributes["server_bulk_threads"] =
      absl::StrCat(options_.server.bulk_threads);
  attributes["zero_copy_send"] =
      options_.client.zero_copy_send ? "true" : "false";
  return info;
}

absl::StatusOr<std::unique_ptr<BackendRegistration>> TcpBackend::Register(
    const Registration& registration, v1::BackendEndpoint* endpoint) {
  // The data plane copies bytes through the agent's mapping: device memory
  // has none (the registry does not offer it, see CanRegister).
  absl::Status host = RequireHostMemory(
      registration, "the tcp backend cannot reach device memory");
  if (!host.ok()) return host;
  v1::TcpEndpoint* tcp = endpoint->mutable_tcp();
  tcp->set_host(advertise_host_);
  tcp->set_port(port());
  // Nothing per buffer: requests name the buffer and the directory finds it.
  return std::make_unique<BackendRegistration>();
}

bool TcpBackend::CanReach(const v1::RemoteBuffer& remote) const {
  const v1::BackendEndpoint* endpoint = FindEndpoint(remote, name_);
  return endpoint != nullptr && endpoint->has_tcp() &&
         !IsWildcardHost(endpoint->tcp().host()) &&
         endpoint->tcp().port() != 0 && endpoint->tcp().port() <= 65535;
}

absl::StatusOr<HostPort> TcpBackend::PeerOf(
    const v1::BackendEndpoint& entry) const {
  // Routed here by the registry, which checked CanReach (backend.h).
  assert(entry.has_tcp());
  const v1::TcpEndpoint& endpoint = entry.tcp();
  if (!options_.client.allow_host_names && !IsIpLiteral(endpoint.host())) {
    // Resolving caller-supplied names would let a context stall this agent
    // in DNS; contexts this agent family issues carry addresses.
    return absl::InvalidArgumentError(absl::StrCat(
        "the remote context names tcp host \"", LogSafe(endpoint.host(), 64),
        "\", not an IP address (set --tcp_allow_host_names to resolve names)"));
  }
  return HostPort{endpoint.host(), static_cast<uint16_t>(endpoint.port())};
}

absl::Status TcpBackend::Notify(const v1::RemoteBuffer& remote,
                                const v1::BackendEndpoint& endpoint,
                                absl::string_view data, const StopToken& stop) {
  auto peer = PeerOf(endpoint);
  if (!peer.ok()) return peer.status();
  return notifier_.Send(*peer, NotificationTarget(remote),
                        env_.identity.agent_id, data, stop);
}

std::vector<DataClient::PeerBatch> TcpBackend::GroupByPeer(
    absl::Span<const Op> ops, std::vector<absl::Status>& results) const {
  std::vector<DataClient::PeerBatch> batches;
  // Ops of one remote context share its endpoint (the registry parses each
  // context once per batch): a run of them needs one lookup, not one each.
  // Contexts of one peer differ only in their buffer: the last batch's peer
  // is compared before any name is built.
  const v1::BackendEndpoint* last_endpoint = nullptr;
  size_t last_batch = 0;
  std::map<std::string, size_t> batch_of;
  for (size_t i = 0; i < ops.size(); ++i) {
    // Never routed here (the registry routes device memory to the backends
    // that registered it), and refused should it be.
    if (absl::Status host = RequireHostMemory(
            *ops[i].local, "the tcp backend cannot reach device memory");
        !host.ok()) {
      results[i] =
          absl::FailedPreconditionError(absl::StrCat("local ", host.message()));
      continue;
    }
    const v1::BackendEndpoint* endpoint = ops[i].endpoint;
    if (endpoint != nullptr && !batches.empty() &&
        (endpoint == last_endpoint ||
         (endpoint->tcp().port() == batches[last_batch].peer.port &&
          endpoint->tcp().host() == batches[last_batch].peer.host))) {
      batches[last_batch].ops.push_back(i);
      last_endpoint = endpoint;
      continue;
    }
    auto peer = PeerOf(*endpoint);
    if (!peer.ok()) {
      results[i] = peer.status();
      continue;
    }
    auto [it, added] =
        batch_of.emplace(JoinHostPort(peer->host, peer->port), batches.size());
    if (added) {
      batches.push_back({*std::move(peer), {}});
      // Most batches go to one peer: its list is sized once, not doubled.
      if (batches.size() == 1) batches.back().ops.reserve(ops.size() - i);
    }
    batches[it->second].ops.push_back(i);
    last_endpoint = endpoint;
    last_batch = it->second;
  }
  return batches;
}

void TcpBackend::Conclude(absl::Span<const Op> ops,
                          std::vector<absl::Status>& results) {
  for (size_t i = 0; i < ops.size(); ++i) {
    if (results[i].ok()) {
      ops[i].local->CountMoved(ops[i].length);
    } else {
      results[i] = AnnotateOp(results[i], ops[i].index);
    }
  }
}

void TcpBackend::Post(absl::Span<const Op> ops, const StopToken& stop,
                      OpsDone done) {
  std::vector<absl::Status> results(ops.size());
  std::vector<DataClient::PeerBatch> batches = GroupByPeer(ops, results);
  client_->Post(ops, std::move(batches), std::move(results), stop,
                [ops, done = std::move(done)](
                    std::vector<absl::Status> statuses) mutable {
                  Conclude(ops, statuses);
                  std::move(done)(std::move(statuses));
                });
}

std::vector<absl::Status> TcpBackend::Submit(absl::Span<const Op> ops,
                                             const StopToken& stop) {
  std::vector<absl::Status> results(ops.size());
  std::vector<DataClient::PeerBatch> batches = GroupByPeer(ops, results);
  results = client_->Run(ops, std::move(batches), std::move(results), stop);
  Conclude(ops, results);
  return results;
}

std::vector<Backend::PeerLinks> TcpBackend::peer_links() const {
  std::vector<PeerLinks> links;
  // Named by host both ways, as incoming connections are (their source
  // port is ephemeral): one series per peer host, not per port.
  std::map<std::string, size_t> by_host;
  for (const auto& [peer, count] : client_->OpenConnectionsByPeer()) {
    absl::StatusOr<HostPort> address = ParseHostPort(peer);
    by_host[address.ok() ? address->host : peer] += count;
  }
  for (const auto& [host, count] : by_host) {
    links.push_back({host, "out", count});
  }
  for (const auto& [source, count] : server_->ConnectionsBySource()) {
    links.push_back({source, "in", count});
  }
  return links;
}

}  // namespace rdma_agent::tcp
