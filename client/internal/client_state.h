#ifndef RDMA_AGENTD_CLIENT_INTERNAL_CLIENT_STATE_H_
#define RDMA_AGENTD_CLIENT_INTERNAL_CLIENT_STATE_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "client/internal/transfer_tracker.h"
#include "client/rdma_agent_client.h"
#include "grpcpp/grpcpp.h"
#include "rdma/agent/v1/agent.grpc.pb.h"

namespace rdma_agent::client::internal {

// What a client and every Buffer, Transfer and TransferWatch it made share:
// any of them may outlive the AgentClient and still reach the agent.
class ClientState {
 public:
  ClientState(ConnectOptions options, std::shared_ptr<grpc::Channel> channel,
              absl::StatusOr<std::string> attach_socket)
      : options_(std::move(options)),
        channel_(std::move(channel)),
        stub_(v1::RdmaAgent::NewStub(channel_)),
        attach_socket_(std::move(attach_socket)) {}

  const ConnectOptions& options() const { return options_; }
  grpc::Channel& channel() { return *channel_; }
  const std::shared_ptr<grpc::Channel>& shared_channel() const {
    return channel_;
  }
  v1::RdmaAgent::Stub& stub() { return *stub_; }
  const absl::StatusOr<std::string>& attach_socket() const {
    return attach_socket_;
  }
  // The client's asynchronous transfers and its watch.
  TransferTracker& transfers() { return transfers_; }

  // Sets the deadline every RPC other than Submit and the transfer waits
  // gets.
  void PrepareContext(grpc::ClientContext* context) const {
    context->set_deadline(
        absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  }

 private:
  const ConnectOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::RdmaAgent::Stub> stub_;
  const absl::StatusOr<std::string> attach_socket_;
  TransferTracker transfers_;
};

}  // namespace rdma_agent::client::internal

#endif  // RDMA_AGENTD_CLIENT_INTERNAL_CLIENT_STATE_H_
