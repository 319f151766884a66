#include "backends/testing/peer_listener.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"

namespace rdma_agent {
namespace testing {

absl::StatusOr<std::unique_ptr<PeerListener>> PeerListener::ServeAndStart(
    Backend& backend, const PeerTls& tls) {
  std::unique_ptr<PeerListener> listener(new PeerListener());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", PeerServerCredentials(tls), &port);
  for (grpc::Service* service : backend.peer_services()) {
    builder.RegisterService(service);
  }
  listener->server_ = builder.BuildAndStart();
  if (listener->server_ == nullptr || port == 0) {
    return absl::UnavailableError("cannot listen for peers on 127.0.0.1");
  }
  listener->address_ = absl::StrCat("127.0.0.1:", port);
  const absl::Status started = backend.Start(listener->address_);
  if (!started.ok()) return started;
  return listener;
}

PeerListener::~PeerListener() {
  // No peer call may run into the backend once this is gone.
  if (server_ != nullptr) server_->Shutdown();
}

}  // namespace testing
}  // namespace rdma_agent
