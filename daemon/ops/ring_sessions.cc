#include "daemon/ops/ring_sessions.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/fd_message.h"
#include "common/log_text.h"
#include "common/ring_protocol.h"
#include "common/shared_memory.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {
namespace {

v1::AttachResponse Refusal(const absl::Status& status) {
  v1::AttachResponse response;
  response.set_code(static_cast<int>(status.code()));
  response.set_message(std::string(status.message()));
  return response;
}

// One doorbell byte; a full socket already holds one, which is enough.
void Ring(int fd) {
  const char byte = 1;
  (void)::send(fd, &byte, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
}

}  // namespace

// One open ring: its mapping (the agent's geometry, never read back from
// it), the agent's own head and completion tail, and the loop that serves
// it on the connection's thread.
class RingSessions::Session {
 public:
  Session(RingSessions* owner, int fd, const PeerCredentials& peer,
          SharedMemory memory, const ring::Geometry& geometry)
      : owner_(owner),
        fd_(fd),
        peer_(peer),
        memory_(std::move(memory)),
        geometry_(geometry),
        base_(memory_.data()) {}

  void Serve();

 private:
  std::atomic<uint32_t>& Word(size_t offset) {
    return ring::Word(base_, offset);
  }
  // Reads doorbell bytes; false when the client closed the connection.
  bool Drain();
  // Sleeps on the connection until a doorbell or `timeout`; false when the
  // client closed it.
  bool Sleep(absl::Duration timeout);
  // One turn: takes and runs at most one batch. False when the session must
  // end (stopped).
  bool Turn(bool* worked);
  // Runs the taken batch and posts one completion per entry.
  void Run(const ring::Batch& batch);
  // Stops the session: the reason for the client, STOPPED, a doorbell.
  void Stop(const absl::Status& reason);

  RingSessions* const owner_;
  const int fd_;
  const PeerCredentials peer_;
  SharedMemory memory_;
  const ring::Geometry geometry_;
  std::byte* const base_;
  uint32_t head_ = 0;     // next submission to take
  uint32_t cq_tail_ = 0;  // next completion slot
  ring::Batch batch_;
  std::vector<ring::Completion> completions_;
  std::vector<std::string> messages_;
};

bool RingSessions::Session::Drain() {
  char bytes[64];
  for (;;) {
    const ssize_t n = ::recv(fd_, bytes, sizeof(bytes), MSG_DONTWAIT);
    if (n > 0) continue;
    if (n == 0) return false;
    if (errno == EINTR) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK;
  }
}

bool RingSessions::Session::Sleep(absl::Duration timeout) {
  struct pollfd pfd = {fd_, POLLIN, 0};
  const int ms = static_cast<int>(absl::ToInt64Milliseconds(timeout));
  const int ready = ::poll(&pfd, 1, ms);
  if (ready <= 0) return true;
  if ((pfd.revents & (POLLHUP | POLLERR | POLLNVAL)) != 0 &&
      (pfd.revents & POLLIN) == 0) {
    return false;
  }
  return Drain();
}

void RingSessions::Session::Stop(const absl::Status& reason) {
  const std::string text = reason.ToString();
  const size_t n = std::min<size_t>(text.size(), ring::kStopReasonBytes - 1);
  std::memcpy(base_ + ring::kStopReasonOffset, text.data(), n);
  base_[ring::kStopReasonOffset + n] = std::byte{0};
  Word(ring::kAgentFlagsOffset).fetch_or(ring::kAgentStopped);
  Ring(fd_);
  spdlog::warn("ring session of uid {} pid {} stopped: {}", peer_.uid,
               peer_.pid, LogSafe(text));
}

bool RingSessions::Session::Turn(bool* worked) {
  *worked = false;
  const uint32_t tail =
      Word(ring::kSqTailOffset).load(std::memory_order_acquire);
  const uint32_t cq_head =
      Word(ring::kCqHeadOffset).load(std::memory_order_acquire);
  auto free = ring::FreeCompletions(cq_head, cq_tail_, geometry_.entries);
  if (!free.ok()) {
    Stop(free.status());
    return false;
  }
  auto taken = ring::TakeBatch(base_, geometry_, head_, tail, *free, &batch_);
  if (!taken.ok()) {
    Stop(taken.status());
    return false;
  }
  if (*taken == 0) return true;
  head_ += *taken;
  // The entries are copied: the client may reuse their slots.
  Word(ring::kSqHeadOffset).store(head_, std::memory_order_release);
  Run(batch_);
  *worked = true;
  return true;
}

void RingSessions::Session::Run(const ring::Batch& batch) {
  const size_t count = batch.entries.size();
  completions_.assign(count, ring::Completion());
  messages_.assign(count, std::string());
  // One request per batch; an entry that failed its checks is kept in place
  // (as an op no check passes) so that every op's index is its entry's.
  v1::SubmitRequest request;
  request.mutable_ops()->Reserve(static_cast<int>(count));
  for (size_t i = 0; i < count; ++i) {
    const ring::Submission& entry = batch.entries[i];
    v1::Op* op = request.add_ops();
    if (!batch.checks[i].ok()) continue;
    op->set_type(static_cast<v1::OpType>(entry.opcode));
    op->set_local_buffer_id(entry.local_buffer_id);
    op->set_local_offset(entry.local_offset);
    op->set_length(entry.length);
    op->set_remote_handle(entry.remote_handle);
    op->set_remote_offset(entry.remote_offset);
  }
  const uint32_t timeout_ms = batch.entries.back().timeout_ms;
  const absl::Duration timeout = timeout_ms == 0
                                     ? owner_->limits_.default_timeout
                                     : absl::Milliseconds(timeout_ms);
  absl::Status refused;
  if (timeout > owner_->limits_.max_timeout) {
    refused = absl::InvalidArgumentError(
        absl::StrCat("timeout ", absl::FormatDuration(timeout),
                     " exceeds the agent's limit of ",
                     absl::FormatDuration(owner_->limits_.max_timeout)));
  }
  std::unique_ptr<ActiveCalls::OpsCharge> charge;
  if (refused.ok()) {
    auto charged = owner_->calls_->ChargeOps(peer_.uid, count);
    if (charged.ok()) {
      charge = std::move(*charged);
    } else {
      refused = charged.status();
    }
  }
  v1::SubmitResponse response;
  if (refused.ok()) {
    auto prepared = OpBatch::Prepare(owner_->env_, peer_, &request, "Ring");
    response =
        prepared->Run(StopToken(absl::Now() + timeout, &owner_->stopping_));
  }
  charge.reset();
  for (size_t i = 0; i < count; ++i) {
    ring::Completion& completion = completions_[i];
    completion.user_tag = batch.entries[i].user_tag;
    absl::Status status;
    std::string backend;
    if (!batch.checks[i].ok()) {
      status = AnnotateOp(batch.checks[i], i);
    } else if (!refused.ok()) {
      status = AnnotateOp(refused, i);
    } else {
      const v1::OpResult& result = response.results(static_cast<int>(i));
      status = absl::Status(static_cast<absl::StatusCode>(result.code()),
                            result.message());
      backend = result.backend();
    }
    completion.code = static_cast<int32_t>(status.code());
    completion.backend = ring::BackendCode(backend);
    ring::WriteCompletion(base_, geometry_, cq_tail_ + static_cast<uint32_t>(i),
                          completion, std::string(status.message()));
  }
  cq_tail_ += static_cast<uint32_t>(count);
  Word(ring::kCqTailOffset).store(cq_tail_, std::memory_order_release);
  // A client about to block is told; one that spins is not bothered.
  if ((Word(ring::kClientFlagsOffset).load() & ring::kClientWaiting) != 0) {
    Word(ring::kClientFlagsOffset).fetch_and(~ring::kClientWaiting);
    Ring(fd_);
  }
}

void RingSessions::Session::Serve() {
  absl::Time last_work = absl::Now();
  int turns = 0;
  while (!owner_->stopping_.cancelled()) {
    bool worked = false;
    if (!Turn(&worked)) return;
    if (worked) {
      last_work = absl::Now();
      continue;
    }
    // Spinning: the connection is looked at now and then, for its closing.
    if (absl::Now() - last_work < owner_->limits_.spin) {
      if (++turns % 64 == 0 && !Drain()) return;
      continue;
    }
    // Asleep: a client that publishes work sees NEEDS_WAKEUP and rings.
    Word(ring::kAgentFlagsOffset).fetch_or(ring::kAgentNeedsWakeup);
    const uint32_t tail = Word(ring::kSqTailOffset).load();
    const bool waiting = tail != head_;
    if (!Sleep(waiting ? absl::Milliseconds(1) : absl::Seconds(1))) return;
    Word(ring::kAgentFlagsOffset).fetch_and(~ring::kAgentNeedsWakeup);
    if (!waiting) last_work = absl::Now();
  }
}

RingSessions::RingSessions(const RingLimits& limits,
                           const OpBatchEnvironment& env, ActiveCalls* calls,
                           std::shared_ptr<ResourceQuota> bytes)
    : limits_(limits),
      env_(env),
      calls_(calls),
      bytes_(std::move(bytes)),
      sessions_(ResourceQuota::Create(
          "ring sessions", "max_ring_sessions_per_user", "max_ring_sessions",
          {limits.max_sessions_per_user, limits.max_sessions})) {}

void RingSessions::Serve(int fd, const PeerCredentials& peer,
                         const v1::OpenRing& request) {
  auto refuse = [&](const absl::Status& status) {
    (void)SendFdMessage(fd, Refusal(Prefixed(status, "open ring")));
  };
  if (stopping_.cancelled()) return refuse(stopping_.reason());
  if (request.entries() > limits_.max_entries) {
    return refuse(absl::InvalidArgumentError(
        absl::StrCat("entries ", request.entries(), " exceeds the limit of ",
                     limits_.max_entries, " (--max_ring_entries)")));
  }
  auto geometry = ring::GeometryFor(request.entries());
  if (!geometry.ok()) return refuse(geometry.status());
  // Counted before anything of the session exists; held until it ends.
  auto slot = sessions_->Reserve(peer.uid, 1);
  if (!slot.ok()) return refuse(slot.status());
  // Charged like registered memory, before the memfd exists.
  auto memory = SharedMemory::Allocate(
      geometry->total_bytes, "rdma-agentd-ring",
      [&](uint64_t bytes) -> absl::StatusOr<std::unique_ptr<MappingCharge>> {
        auto charge = bytes_->Reserve(peer.uid, bytes);
        if (!charge.ok()) return charge.status();
        return MemoryCharge::Of(std::move(*charge));
      });
  if (!memory.ok()) return refuse(memory.status());
  ring::WriteHeader(memory->data(), *geometry);
  v1::AttachResponse response;
  response.set_size_bytes(geometry->total_bytes);
  if (!SendFdMessage(fd, response, memory->fd()).ok()) return;
  open_.fetch_add(1, std::memory_order_relaxed);
  spdlog::debug("uid {} pid {} opened a ring of {} entries", peer.uid, peer.pid,
                geometry->entries);
  Session session(this, fd, peer, std::move(*memory), *geometry);
  session.Serve();
  open_.fetch_sub(1, std::memory_order_relaxed);
}

void RingSessions::Shutdown(const absl::Status& reason) {
  stopping_.Cancel(reason);
}

}  // namespace rdma_agent
