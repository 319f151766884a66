#include "backends/tcp/notify_client.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "backends/tcp/socket_util.h"
#include "backends/tcp/wire.h"
#include "common/status_util.h"
#include "common/unique_fd.h"

namespace rdma_agent::tcp {
namespace {

// Dials `peer` and checks its hello; the socket comes back blocking.
absl::StatusOr<UniqueFd> Connect(const HostPort& peer, absl::Time until,
                                 const StopCheck& stopped) {
  auto addresses = ResolvePeer(peer, until, stopped);
  if (!addresses.ok()) return addresses.status();
  absl::Status last = absl::UnavailableError("no address");
  for (const PeerAddress& address : *addresses) {
    auto fd = OpenDataSocket(address, 0);
    if (!fd.ok()) return fd.status();
    last = ConnectSocket(fd->get(), address, until, stopped);
    if (last.ok()) last = ReadServerHello(fd->get(), until, stopped);
    if (last.ok()) {
      SetBlocking(fd->get());
      return std::move(*fd);
    }
    if (absl::IsDeadlineExceeded(last) || absl::IsCancelled(last)) break;
  }
  return last;
}

}  // namespace

absl::Status SendNotification(const HostPort& peer, const ServeRequest& target,
                              absl::string_view from_agent_id,
                              absl::string_view data, const StopToken& stop,
                              absl::Duration connect_timeout) {
  const std::string name = JoinHostPort(peer.host, peer.port);
  const StopCheck stopped = [&stop] { return stop.cancelled(); };
  auto fd = Connect(peer, std::min(stop.deadline(), absl::Now() + connect_timeout),
                    stopped);
  if (!fd.ok()) {
    if (absl::IsCancelled(fd.status())) {
      return stop.StopStatus("while connecting to send the notification");
    }
    return Prefixed(fd.status(),
                    absl::StrCat("notification not sent to ", name));
  }
  // The socket is closed by a cancellation, which ends any blocked call.
  const auto on_cancel =
      stop.OnCancel([raw = fd->get()] { shutdown(raw, SHUT_RDWR); });
  const absl::Duration left = stop.deadline() - absl::Now();
  if (left <= absl::ZeroDuration()) {
    return stop.StopStatus("before the notification was sent");
  }
  SetIoTimeout(fd->get(), /*receive=*/false, left);
  SetIoTimeout(fd->get(), /*receive=*/true, left);

  const std::string payload = EncodeNotification(from_agent_id, data);
  RequestHeader header;
  header.kind = RequestKind::kNotify;
  header.request_id = 1;
  header.epoch = target.agent_epoch;
  header.buffer_id = target.buffer_id;
  header.length = payload.size();
  header.token_bytes = static_cast<uint32_t>(target.token.size());
  std::byte header_bytes[kRequestHeaderBytes];
  EncodeRequestHeader(header, header_bytes);
  iovec iov[3] = {
      {header_bytes, sizeof(header_bytes)},
      {const_cast<char*>(target.token.data()), target.token.size()},
      {const_cast<char*>(payload.data()), payload.size()},
  };
  // From the first byte written, the target may have queued it.
  const auto failed = [&](absl::string_view what) {
    absl::Status why = stop.stopped()
                           ? stop.StopStatus("while sending the notification")
                           : absl::UnavailableError(absl::StrCat(
                                 what, " ", name, " failed"));
    return absl::Status(
        why.code(),
        absl::StrCat(why.message(), " (it may have arrived all the same)"));
  };
  if (!WriteFull(fd->get(), iov, 3).ok()) {
    return failed("sending the notification to");
  }
  std::byte response_bytes[kResponseHeaderBytes];
  if (!ReadFull(fd->get(), response_bytes, sizeof(response_bytes)).ok()) {
    return failed("reading the answer to the notification from");
  }
  auto response = DecodeResponseHeader(response_bytes);
  if (!response.ok() || response->request_id != 1 ||
      response->payload_bytes != 0) {
    return absl::UnavailableError(absl::StrCat(
        "agent at ", name,
        " answered the notification with a malformed response (it may "
        "have arrived all the same)"));
  }
  std::string message(response->message_bytes, '\0');
  if (!ReadFull(fd->get(), message.data(), message.size()).ok()) {
    return failed("reading the answer to the notification from");
  }
  return absl::Status(static_cast<absl::StatusCode>(response->code), message);
}

}  // namespace rdma_agent::tcp
