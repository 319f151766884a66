#include "backends/tcp/notify_client.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "backends/tcp/socket_util.h"
#include "backends/tcp/wire.h"
#include "common/status_util.h"

namespace rdma_agent::tcp {
namespace {

// Longest a notification waiting for a connection sleeps before it looks at
// its cancellation again (a returned connection wakes it at once).
constexpr absl::Duration kWaitSlice = absl::Milliseconds(20);

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

// True when an idle pooled connection can carry a request: the peer has
// neither closed it (an agent restarted, or its idle timeout) nor sent
// anything unasked.
bool StillIdle(int fd) {
  pollfd p{fd, POLLIN, 0};
  return poll(&p, 1, 0) == 0;
}

}  // namespace

NotifyClient::NotifyClient(NotifyClientOptions options,
                           absl::Duration idle_timeout,
                           absl::Duration connect_timeout)
    : options_{std::max(1, options.connections_per_peer),
               std::max(1, options.max_connections)},
      idle_timeout_(idle_timeout),
      connect_timeout_(connect_timeout) {}

void NotifyClient::ExpireLocked(absl::Time now,
                                std::vector<UniqueFd>& closing) {
  for (auto it = peers_.begin(); it != peers_.end();) {
    Peer& peer = it->second;
    // Oldest first: the expired ones lead.
    size_t expired = 0;
    while (expired < peer.idle.size() &&
           now - peer.idle[expired].since >= idle_timeout_) {
      closing.push_back(std::move(peer.idle[expired].fd));
      ++expired;
    }
    if (expired > 0) {
      peer.idle.erase(peer.idle.begin(), peer.idle.begin() + expired);
      peer.open -= static_cast<int>(expired);
      open_ -= static_cast<int>(expired);
      ++returns_;
    }
    it = peer.open == 0 ? peers_.erase(it) : std::next(it);
  }
}

bool NotifyClient::EvictOldestIdleLocked(std::vector<UniqueFd>& closing) {
  Peer* oldest = nullptr;
  for (auto& [key, peer] : peers_) {
    if (!peer.idle.empty() &&
        (oldest == nullptr ||
         peer.idle.front().since < oldest->idle.front().since)) {
      oldest = &peer;
    }
  }
  if (oldest == nullptr) return false;
  closing.push_back(std::move(oldest->idle.front().fd));
  oldest->idle.erase(oldest->idle.begin());
  --oldest->open;
  --open_;
  // An emptied entry is erased by the next ExpireLocked.
  return true;
}

absl::StatusOr<NotifyClient::Lease> NotifyClient::Checkout(
    const std::string& key, const StopToken& stop) {
  // Closed after the lock is released (declared before it).
  std::vector<UniqueFd> closing;
  absl::MutexLock lock(&mu_);
  while (true) {
    ExpireLocked(absl::Now(), closing);
    Peer& peer = peers_[key];
    if (!peer.idle.empty()) {
      // The most recently used: the likeliest to be warm.
      Idle& last = peer.idle.back();
      Lease lease{std::move(last.fd), last.next_request_id};
      peer.idle.pop_back();
      return lease;
    }
    if (peer.open < options_.connections_per_peer &&
        (open_ < options_.max_connections || EvictOldestIdleLocked(closing))) {
      ++peer.open;
      ++open_;
      return Lease{};
    }
    // Every connection to this peer (or every one allowed) is in use: wait
    // for one to come back, as long as the notification may wait.
    if (stop.stopped()) {
      return stop.StopStatus(
          "while waiting for a connection to send the "
          "notification (not sent)");
    }
    struct Wait {
      const NotifyClient* client;
      uint64_t seen;
    } wait{this, returns_};
    mu_.AwaitWithDeadline(
        absl::Condition(
            +[](Wait* w) { return w->client->returns_ != w->seen; }, &wait),
        std::min(stop.deadline(), absl::Now() + kWaitSlice));
  }
}

void NotifyClient::Return(const std::string& key, Lease lease) {
  std::vector<UniqueFd> closing;
  absl::MutexLock lock(&mu_);
  Peer& peer = peers_[key];
  peer.idle.push_back(
      Idle{std::move(lease.fd), absl::Now(), lease.next_request_id});
  ++returns_;
  ExpireLocked(absl::Now(), closing);
}

void NotifyClient::Drop(const std::string& key) {
  absl::MutexLock lock(&mu_);
  Peer& peer = peers_[key];
  --peer.open;
  --open_;
  if (peer.open == 0 && peer.idle.empty()) peers_.erase(key);
  ++returns_;
}

std::map<std::string, int> NotifyClient::OpenConnectionsByPeer() const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, int> open;
  for (const auto& [key, peer] : peers_) {
    if (peer.open > 0) open[key] = peer.open;
  }
  return open;
}

absl::Status NotifyClient::Send(const HostPort& peer,
                                const ServeRequest& target,
                                absl::string_view from_agent_id,
                                absl::string_view data, const StopToken& stop) {
  const std::string name = JoinHostPort(peer.host, peer.port);
  const StopCheck stopped = [&stop] { return stop.cancelled(); };
  Lease lease;
  while (true) {
    auto checked_out = Checkout(name, stop);
    if (!checked_out.ok()) return checked_out.status();
    lease = std::move(*checked_out);
    if (!lease.fd) break;  // a slot to dial
    if (StillIdle(lease.fd.get())) break;
    // Closed by the peer while idle: its slot goes, and the next checkout
    // takes another pooled connection or dials.
    lease.fd.reset();
    Drop(name);
  }
  if (!lease.fd) {
    auto fd =
        Connect(peer, std::min(stop.deadline(), absl::Now() + connect_timeout_),
                stopped);
    if (!fd.ok()) {
      Drop(name);
      if (absl::IsCancelled(fd.status())) {
        return stop.StopStatus("while connecting to send the notification");
      }
      return Prefixed(fd.status(),
                      absl::StrCat("notification not sent to ", name));
    }
    lease.fd = std::move(*fd);
  }

  // Until the answer is in, the connection is this notification's; one
  // that fails (or is cut short) is closed: answers could be out of step.
  bool in_step = false;
  const absl::Status answer =
      Exchange(lease, name, target, from_agent_id, data, stop, &in_step);
  // Only a granted notification's connection is kept: the server holds a
  // connection that never presented a valid token to its handshake
  // deadline, and would cut it under a later notification.
  if (in_step && answer.ok() && !stop.cancelled()) {
    Return(name, std::move(lease));
  } else {
    lease.fd.reset();
    Drop(name);
  }
  return answer;
}

absl::Status NotifyClient::Exchange(Lease& lease, const std::string& name,
                                    const ServeRequest& target,
                                    absl::string_view from_agent_id,
                                    absl::string_view data,
                                    const StopToken& stop, bool* in_step) {
  const int fd = lease.fd.get();
  // A cancellation shuts the socket down, which ends any blocked call; the
  // callback is gone when this returns, before the connection is pooled.
  const auto on_cancel = stop.OnCancel([fd] { shutdown(fd, SHUT_RDWR); });
  const absl::Duration left = stop.deadline() - absl::Now();
  if (left <= absl::ZeroDuration()) {
    return stop.StopStatus("before the notification was sent");
  }
  SetIoTimeout(fd, /*receive=*/false, left);
  SetIoTimeout(fd, /*receive=*/true, left);

  const std::string payload = EncodeNotification(from_agent_id, data);
  const uint64_t request_id = lease.next_request_id++;
  RequestHeader header;
  header.kind = RequestKind::kNotify;
  header.request_id = request_id;
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
    absl::Status why =
        stop.stopped()
            ? stop.StopStatus("while sending the notification")
            : absl::UnavailableError(absl::StrCat(what, " ", name, " failed"));
    return absl::Status(
        why.code(),
        absl::StrCat(why.message(), " (it may have arrived all the same)"));
  };
  if (!WriteFull(fd, iov, 3).ok()) {
    return failed("sending the notification to");
  }
  std::byte response_bytes[kResponseHeaderBytes];
  if (!ReadFull(fd, response_bytes, sizeof(response_bytes)).ok()) {
    return failed("reading the answer to the notification from");
  }
  auto response = DecodeResponseHeader(response_bytes);
  if (!response.ok() || response->request_id != request_id ||
      response->payload_bytes != 0) {
    return absl::UnavailableError(absl::StrCat(
        "agent at ", name,
        " answered the notification with a malformed response (it may "
        "have arrived all the same)"));
  }
  std::string message(response->message_bytes, '\0');
  if (!ReadFull(fd, message.data(), message.size()).ok()) {
    return failed("reading the answer to the notification from");
  }
  *in_step = true;
  return absl::Status(static_cast<absl::StatusCode>(response->code), message);
}

}  // namespace rdma_agent::tcp
