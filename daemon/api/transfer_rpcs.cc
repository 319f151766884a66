#include "daemon/api/transfer_rpcs.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/api/waiting_rpcs.h"

namespace rdma_agent {
namespace {

// Transfers one GetTransfers may name.
constexpr size_t kMaxTransfersPerGet = 1024;
// What the transfers of one reply may take, under the agent's 64 MiB
// message bound with room to spare: past it, ended transfers come without
// their results (TransferTable::Poll::Report, which counts it from each
// transfer's kept sizes before copying anything) and stay kept.
constexpr size_t kMaxReplyBytes = 48 << 20;

// A GetTransfers long poll's view of the table.
class TransferPoll final : public PollSource<v1::GetTransfersResponse> {
 public:
  explicit TransferPoll(std::unique_ptr<TransferTable::Poll> poll)
      : poll_(std::move(poll)) {}

  bool settled() const override { return poll_->settled(); }

  absl::Status Answer(v1::GetTransfersResponse* response) override {
    // Sized before anything is copied, and charged to the user's transfer
    // byte budget until the call is done (the poll goes at OnDone).
    absl::StatusOr<std::vector<v1::Transfer>> transfers =
        poll_->Report(kMaxReplyBytes);
    if (!transfers.ok()) return transfers.status();
    response->mutable_transfers()->Reserve(static_cast<int>(transfers->size()));
    for (v1::Transfer& transfer : *transfers) {
      *response->add_transfers() = std::move(transfer);
    }
    return absl::OkStatus();
  }

 private:
  const std::unique_ptr<TransferTable::Poll> poll_;
};

// A WatchTransfers stream's view of the table.
class TransferEnds final : public EventSource<v1::TransferEvent> {
 public:
  explicit TransferEnds(std::unique_ptr<TransferTable::Stream> stream)
      : stream_(std::move(stream)) {}

  std::optional<v1::TransferEvent> Next() override {
    std::optional<v1::Transfer> transfer = stream_->Next();
    if (!transfer.has_value()) return std::nullopt;
    v1::TransferEvent event;
    *event.mutable_transfer() = std::move(*transfer);
    return event;
  }

  void Written(const v1::TransferEvent& event) override {
    stream_->Delivered(event.transfer().transfer_id());
  }

  absl::Status status() const override { return stream_->status(); }

 private:
  const std::unique_ptr<TransferTable::Stream> stream_;
};

}  // namespace

grpc::ServerUnaryReactor* ServeGetTransfers(
    grpc::CallbackServerContext* context,
    std::unique_ptr<ActiveCalls::Call> call, uid_t uid,
    const v1::GetTransfersRequest& request, v1::GetTransfersResponse* response,
    TransferTable* transfers, absl::Duration max_wait) {
  if (request.transfer_ids().empty() ||
      static_cast<size_t>(request.transfer_ids_size()) > kMaxTransfersPerGet) {
    return RefuseUnary(
        context, absl::InvalidArgumentError(absl::StrCat(
                     "GetTransfers: name 1 to ", kMaxTransfersPerGet,
                     " transfers (got ", request.transfer_ids_size(), ")")));
  }
  auto wait =
      LongPollWait(request.has_wait() ? &request.wait() : nullptr, max_wait);
  if (!wait.ok()) {
    return RefuseUnary(context, Prefixed(wait.status(), "GetTransfers"));
  }
  const absl::Time deadline =
      std::min(absl::Now() + *wait, absl::FromChrono(context->deadline()));
  const absl::Span<const uint64_t> ids(request.transfer_ids().data(),
                                       request.transfer_ids_size());
  return ServeLongPoll<v1::GetTransfersResponse>(
      std::move(call), "GetTransfers", deadline, response,
      [&](std::function<void()> wake)
          -> absl::StatusOr<
              std::unique_ptr<PollSource<v1::GetTransfersResponse>>> {
        auto poll = transfers->StartPoll(uid, ids, std::move(wake));
        if (!poll.ok()) return poll.status();
        return std::make_unique<TransferPoll>(std::move(*poll));
      });
}

grpc::ServerWriteReactor<v1::TransferEvent>* ServeWatchTransfers(
    std::unique_ptr<ActiveCalls::Call> call, uid_t uid,
    TransferTable* transfers) {
  return ServeEventStream<v1::TransferEvent>(
      std::move(call), "WatchTransfers",
      [&](std::function<void()> wake)
          -> absl::StatusOr<std::unique_ptr<EventSource<v1::TransferEvent>>> {
        auto stream = transfers->Watch(uid, std::move(wake));
        if (!stream.ok()) return stream.status();
        return std::make_unique<TransferEnds>(std::move(*stream));
      });
}

}  // namespace rdma_agent
