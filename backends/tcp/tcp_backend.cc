#include "backends/tcp/tcp_backend.h"

#include <map>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "backends/tcp/socket_util.h"
#include "backends/tcp/wire.h"

namespace rdma_agent {

absl::StatusOr<std::unique_ptr<TcpBackend>> TcpBackend::Create(
    TcpOptions options, const BackendEnvironment& env) {
  if (env.directory == nullptr) {
    return absl::InvalidArgumentError("tcp backend needs a buffer directory");
  }
  if (options.client.connections_per_peer < 1 ||
      options.client.max_in_flight < 1 || options.client.chunk_bytes < 1 ||
      options.client.chunk_bytes > tcp::kMaxPayloadBytes ||
      options.client.socket_buffer_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tcp options out of range: connections per peer and max in flight "
        "must be >= 1, chunk bytes in [1, ",
        tcp::kMaxPayloadBytes, "], socket buffer bytes >= 0"));
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
  if (advertise.empty()) advertise = env.advertise_host;
  if (IsWildcardHost(advertise)) {
    // Nothing better known: the listen address if it is a specific one.
    advertise = IsWildcardHost(listen->host) ? "127.0.0.1" : listen->host;
  }

  tcp::DataServerOptions server_options = options.server;
  server_options.zero_copy_send = options.client.zero_copy_send;
  server_options.socket_buffer_bytes = options.client.socket_buffer_bytes;
  auto server = tcp::DataServer::Start(*listen, env.directory, server_options);
  if (!server.ok()) {
    // An advertise host that is not this host's (NAT) cannot be bound.
    return absl::Status(
        server.status().code(),
        absl::StrCat("tcp data plane: ", server.status().message(),
                     default_listen ? " (listening on the advertise host by "
                                      "default; set --tcp_listen)"
                                    : ""));
  }
  return std::unique_ptr<TcpBackend>(new TcpBackend(
      std::move(options), env, std::move(advertise), std::move(*server)));
}

TcpBackend::TcpBackend(TcpOptions options, BackendEnvironment env,
                       std::string advertise_host,
                       std::unique_ptr<tcp::DataServer> server)
    : options_(std::move(options)),
      env_(std::move(env)),
      advertise_host_(std::move(advertise_host)),
      client_(options_.client),
      server_(std::move(server)) {}

v1::TransportInfo TcpBackend::transport_info() const {
  v1::TransportInfo info;
  info.add_addresses(JoinHostPort(advertise_host_, port()));
  auto& attributes = *info.mutable_attributes();
  attributes["listen"] = options_.listen;
  attributes["connections_per_peer"] =
      absl::StrCat(options_.client.connections_per_peer);
  attributes["chunk_bytes"] = absl::StrCat(options_.client.chunk_bytes);
  attributes["max_in_flight"] = absl::StrCat(options_.client.max_in_flight);
  attributes["zero_copy_send"] =
      options_.client.zero_copy_send ? "true" : "false";
  return info;
}

absl::StatusOr<std::unique_ptr<BackendRegistration>> TcpBackend::Register(
    const Registration& /*registration*/, v1::BackendEndpoint* endpoint) {
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

std::vector<absl::Status> TcpBackend::Submit(absl::Span<const Op> ops,
                                             const StopToken& stop) {
  const absl::Time deadline = stop.deadline();
  std::vector<absl::Status> results(ops.size());
  // Ops grouped by the data port that serves them.
  std::map<std::string, std::pair<HostPort, std::vector<size_t>>> peers;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!CanReach(*ops[i].remote)) {
      results[i] = absl::InvalidArgumentError(
          "remote context has no usable tcp endpoint");
      continue;
    }
    const v1::TcpEndpoint& endpoint =
        FindEndpoint(*ops[i].remote, name_)->tcp();
    HostPort peer{endpoint.host(), static_cast<uint16_t>(endpoint.port())};
    auto& group = peers[JoinHostPort(peer.host, peer.port)];
    group.first = peer;
    group.second.push_back(i);
  }

  auto run_peer = [&](const HostPort& peer,
                      const std::vector<size_t>& indices) {
    std::vector<Op> batch;
    batch.reserve(indices.size());
    for (size_t i : indices) batch.push_back(ops[i]);
    std::vector<absl::Status> statuses = client_.Run(peer, batch, deadline);
    for (size_t k = 0; k < indices.size(); ++k) {
      const Op& op = ops[indices[k]];
      if (statuses[k].ok()) op.local->CountMoved(op.length);
      results[indices[k]] = std::move(statuses[k]);
    }
  };

  // Peers are independent: run them side by side.
  std::vector<std::thread> workers;
  for (auto it = std::next(peers.begin(), peers.empty() ? 0 : 1);
       it != peers.end(); ++it) {
    workers.emplace_back(run_peer, std::cref(it->second.first),
                         std::cref(it->second.second));
  }
  if (!peers.empty()) {
    run_peer(peers.begin()->second.first, peers.begin()->second.second);
  }
  for (auto& worker : workers) worker.join();
  return results;
}

}  // namespace rdma_agent
