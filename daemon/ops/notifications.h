#ifndef RDMA_AGENTD_DAEMON_OPS_NOTIFICATIONS_H_
#define RDMA_AGENTD_DAEMON_OPS_NOTIFICATIONS_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "backends/buffer_directory.h"
#include "backends/notification_sink.h"
#include "common/revocable_callback.h"
#include "rdma/agent/v1/agent.pb.h"

namespace rdma_agent {

namespace v1 = ::rdma::agent::v1;

// Bounds of the inbox (flags --max_notification_bytes,
// --max_notifications_per_user, --max_notifications_total,
// --max_notification_queue_bytes_per_user,
// --max_notification_queue_bytes_total). What peers deliver is kept until
// its owner reads it, so it is bounded by count and by bytes, per user and
// in total; beyond any bound the oldest go (counted and reported).
struct NotificationLimits {
  // Per notification, what it is charged on top of its data and sender id:
  // the message, its strings and its queue slot.
  static constexpr size_t kOverheadBytes = 128;

  // Longest notification accepted, from a peer or in a SubmitRequest.
  size_t max_bytes = 4096;
  // Notifications kept for one user (and for one of its watch streams);
  // beyond, the oldest is dropped and counted.
  size_t max_queued_per_user = 1024;
  // Bytes kept for one user: its queue and every copy its open streams
  // hold, together (each charged its data, sender id and kOverheadBytes).
  // Beyond, the oldest of its fullest queue (a stream that does not read,
  // typically) go. Two full queues of default notifications.
  size_t max_queued_bytes_per_user = size_t{8} << 20;
  // Notifications kept for all users, copies in streams included; beyond,
  // the oldest of the user holding the most bytes go.
  size_t max_queued_total = 65536;
  // The same in bytes.
  size_t max_queued_bytes_total = size_t{64} << 20;
};

// The notifications peers sent to the owners of this agent's registrations,
// kept per owning user until that user reads them (GetNotifications: Take,
// or a Poll that waits) or streams them (WatchNotifications: a Stream).
// Readers never block here: a Poll or a Stream is told by its `wake`
// callback when there is something for it, so the RPCs that wait hold no
// thread (daemon/waiting_rpcs.h).
//
// - Each notification gets the next sequence number of its user (from 1),
//   so a reader sees where drops were.
// - While streams of a user are open, each arriving notification goes to
//   every one of them (each its own bounded queue); otherwise to the user's
//   queue, which the next Take or the first stream opened takes over. A
//   stream closed with notifications it never handed out gives them back to
//   the user's queue when it was the user's last.
// - A full queue drops its oldest notification and counts the drop; the
//   count is reported once, with the reader's next answer. So does a user
//   over its byte budget (from its fullest queue) and the inbox over its
//   totals (from the user holding the most bytes).
// - Close() wakes every reader and refuses further deliveries.
//
// Memory: every copy (the user's queue, each stream's) is charged to its
// user and to the totals: at most max_queued_bytes_per_user per user and
// max_queued_bytes_total in all, however many streams are open, and a few
// words per local user ever notified (kept so that sequence numbers never
// restart).
//
// Thread-safe. `wake` callbacks run on the delivering thread (or Close's),
// without the inbox's lock held.
class NotificationInbox : public NotificationSink {
 private:
  // One reader's notifications: a user's queue, or a stream's.
  struct Queue {
    std::deque<v1::Notification> items;
    uint64_t bytes = 0;    // charged for `items`
    uint64_t dropped = 0;  // not yet reported to the reader
  };

 public:
  // What one read returns.
  struct Taken {
    std::vector<v1::Notification> notifications;
    uint64_t dropped = 0;  // since the previous read that reported drops
  };

  // A WatchNotifications stream's view of its user's notifications.
  class Stream {
   public:
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    // Revokes `wake` (waiting for a run in progress), then gives back what
    // it never handed out (see above).
    ~Stream();

    // The next event: a notification with the drops before it, or only a
    // count of drops; nullopt when there is none now.
    std::optional<v1::NotificationEvent> Next();
    // OK while open; UNAVAILABLE once the inbox is closed.
    absl::Status status() const;

   private:
    friend class NotificationInbox;
    Stream(NotificationInbox* owner, uid_t uid, std::function<void()> wake)
        : owner_(owner),
          uid_(uid),
          wake_(std::make_shared<RevocableCallback>(std::move(wake))) {}

    NotificationInbox* const owner_;
    const uid_t uid_;
    const std::shared_ptr<RevocableCallback> wake_;
    // Guarded by owner_->mu_.
    Queue queue_;
  };

  // A GetNotifications long poll: settled once its user has something
  // queued (or drops to report) or the inbox closes.
  class Poll {
   public:
    Poll(const Poll&) = delete;
    Poll& operator=(const Poll&) = delete;
    ~Poll();

    bool settled() const;
    // Takes up to `max_count` of the user's queued notifications, and no
    // more than `max_bytes` of them (at least one).
    Taken Take(size_t max_count, size_t max_bytes = SIZE_MAX);

   private:
    friend class NotificationInbox;
    Poll(NotificationInbox* owner, uid_t uid, std::function<void()> wake)
        : owner_(owner),
          uid_(uid),
          wake_(std::make_shared<RevocableCallback>(std::move(wake))) {}

    NotificationInbox* const owner_;
    const uid_t uid_;
    const std::shared_ptr<RevocableCallback> wake_;
  };

  // `directory` resolves the buffers notifications name; it outlives the
  // inbox.
  NotificationInbox(const BufferDirectory* directory,
                    NotificationLimits limits);
  ~NotificationInbox() override;

  const NotificationLimits& limits() const { return limits_; }

  // NotificationSink: the target first (ResolveForNotification: token,
  // then WRITE access), then the length; UNAVAILABLE once closed.
  absl::Status Deliver(const ServeRequest& target,
                       absl::string_view from_agent_id,
                       absl::string_view data) override;
  size_t max_bytes() const override { return limits_.max_bytes; }

  // Takes up to `max_count` of uid's queued notifications, oldest first,
  // at once.
  // Taken notifications are charged as the inbox charges them; more than
  // `max_bytes` are not taken (one always is), so that one answer stays
  // within what a client receives.
  Taken Take(uid_t uid, size_t max_count, size_t max_bytes = SIZE_MAX);
  // Starts a long poll of uid's queue; `wake` runs when it may have
  // settled. Every Poll must be destroyed before the inbox.
  std::unique_ptr<Poll> StartPoll(uid_t uid, std::function<void()> wake);
  // Opens a stream of uid's notifications; it starts with uid's queue.
  // `wake` runs when it may have a new event or has closed. Every Stream
  // must be destroyed before the inbox.
  std::unique_ptr<Stream> OpenStream(uid_t uid, std::function<void()> wake);

  // Notifications queued for uid outside streams (for metrics and tests).
  size_t queued(uid_t uid) const;
  // Bytes charged for everything kept, streams' copies included.
  uint64_t held_bytes() const;
  // Every notification accepted and every one dropped since start.
  uint64_t delivered_total() const;
  uint64_t dropped_total() const;

  // Wakes every reader and refuses deliveries from now on. Idempotent.
  void Close();

 private:
  using Wakeups = std::vector<std::shared_ptr<RevocableCallback>>;

  struct User {
    Queue queue;
    uint64_t bytes = 0;  // its queue's and its streams' together
    uint64_t next_sequence = 1;
    std::set<Stream*> streams;
    std::set<Poll*> polls;
  };

  // What one copy of `notification` is charged.
  static uint64_t Cost(const v1::Notification& notification);
  // Appends to `queue` of `user`, charging it; drops the queue's oldest
  // when it holds max_queued_per_user.
  void Push(User& user, Queue& queue, v1::Notification notification)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the oldest of `queue`; `dropped`: counted as a drop.
  v1::Notification PopFront(User& user, Queue& queue, bool dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The non-empty queue of `user` holding the most bytes, or nullptr.
  static Queue* Fullest(User& user);
  // Drops oldest copies until `user` and the inbox are within their byte
  // and count budgets.
  void Trim(User& user) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Up to `max_count` (and `max_bytes`, one at least) from the front of
  // uid's queue, with its drops.
  Taken Pop(User& user, size_t max_count, size_t max_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void RunAll(const Wakeups& wakeups);

  const BufferDirectory* const directory_;
  const NotificationLimits limits_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uid_t, User> users_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t delivered_total_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t dropped_total_ ABSL_GUARDED_BY(mu_) = 0;
  // What every queue holds now, all users.
  uint64_t held_count_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_OPS_NOTIFICATIONS_H_
