#include "daemon/directory/etcd_directory.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/directory/agent_record.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {

EtcdDirectory::EtcdDirectory(DirectoryOptions options,
                             std::unique_ptr<EtcdClient> client)
    : options_(std::move(options)),
      client_(std::move(client)),
      cache_(options_.resolve_cache_entries, options_.resolve_cache_bytes) {}

EtcdDirectory::~EtcdDirectory() {
  StopWatcher();
  StopKeeper();
}

std::optional<v1::NameEvent> EtcdDirectory::ToNameEvent(
    const mvccpb::Event& event) const {
  const std::string names = options_.prefix + "/names/";
  v1::NameEvent out;
  if (event.type() == mvccpb::Event::DELETE) {
    if (event.kv().key().size() <= names.size()) return std::nullopt;
    out.set_kind(v1::NameEvent::WITHDRAWN);
    // Who may hear of it is the withdrawn record's business: without it
    // (never readable), the event names an owner nobody is.
    auto previous = DecodeNameRecord(event.prev_kv().value());
    if (previous.ok()) {
      *out.mutable_record() = std::move(*previous);
      out.mutable_record()->clear_remote_context();
    } else {
      out.mutable_record()->set_owner_uid(static_cast<uint32_t>(-1));
    }
    out.mutable_record()->set_name(event.kv().key().substr(names.size()));
    return out;
  }
  auto record = DecodeNameRecord(event.kv().value());
  if (!record.ok()) return std::nullopt;
  out.set_kind(v1::NameEvent::PUBLISHED);
  *out.mutable_record() = std::move(*record);
  return out;
}

absl::StatusOr<std::unique_ptr<Directory::Subscription>>
EtcdDirectory::WatchNames(const std::string& prefix, NameEventCallback on_event,
                          EndCallback on_end) {
  // Held from the snapshot to the subscription: the watcher delivers
  // nothing meanwhile, so every change after the snapshot's revision
  // reaches this subscriber and none before it does.
  absl::MutexLock lock(&subscribers_.mu());
  const std::string names = options_.prefix + "/names/";
  auto range = client_->RangePrefix(names + prefix, kMaxWatchSnapshot + 1,
                                    absl::Now() + options_.call_timeout);
  if (!range.ok()) {
    return absl::Status(
        range.status().code(),
        absl::StrCat("directory ", name(), ": ", range.status().message()));
  }
  if (range->kvs_size() > static_cast<int>(kMaxWatchSnapshot) ||
      range->more()) {
    return SnapshotTooLarge(prefix);
  }
  const int64_t revision = range->header().revision();
  for (const mvccpb::KeyValue& kv : range->kvs()) {
    mvccpb::Event event;
    event.set_type(mvccpb::Event::PUT);
    *event.mutable_kv() = kv;
    if (auto name_event = ToNameEvent(event)) on_event(*name_event);
  }
  v1::NameEvent synced;
  synced.set_kind(v1::NameEvent::SYNCED);
  on_event(synced);
  if (!watcher_.joinable()) {
    watched_revision_ = revision;
    StartWatcher();
  }
  return subscribers_.Add(prefix, revision, std::move(on_event),
                          std::move(on_end));
}

void EtcdDirectory::StartWatcher() {
  if (!watcher_.joinable()) watcher_ = std::thread([this] { WatcherLoop(); });
}

void EtcdDirectory::WatcherLoop() {
  const std::string names = options_.prefix + "/names/";
  std::string names_end = names;
  names_end.back() = static_cast<char>(names_end.back() + 1);  // '/' + 1
  const size_t endpoints = options_.EtcdEndpoints().size();
  // Streams in a row that never became current, and since when.
  size_t failed = 0;
  absl::Time failing_since = absl::Now();
  for (;;) {
    grpc::ClientContext context;
    {
      absl::MutexLock lock(&watch_mu_);
      if (watch_stopping_) return;
      watch_context_ = &context;
      watch_opened_ = absl::Now();
      watch_current_ = false;
    }
    auto stream = client_->OpenWatch(&context);
    bool synced = false;  // this stream
    if (stream.ok()) {
      etcdserverpb::WatchRequest request;
      etcdserverpb::WatchCreateRequest* create =
          request.mutable_create_request();
      create->set_key(names);
      create->set_range_end(names_end);
      create->set_prev_kv(true);  // who may hear of a withdrawal
      {
        absl::MutexLock lock(&subscribers_.mu());
        // 0: from now (nothing delivered yet, nobody's snapshot to follow).
        if (watched_revision_ != 0) {
          create->set_start_revision(watched_revision_ + 1);
        }
      }
      etcdserverpb::WatchResponse response;
      if ((*stream)->Write(request)) {
        while ((*stream)->Read(&response)) {
          absl::MutexLock lock(&subscribers_.mu());
          if (response.created()) {
            {
              absl::MutexLock watch_lock(&watch_mu_);
              watch_current_ = true;
            }
            synced = true;
            watch_synced_ = true;
            watch_lost_ = false;
            if (watched_revision_ == 0) {
              watched_revision_ = response.header().revision();
            }
          }
          if (response.compact_revision() != 0 || response.canceled()) {
            cache_.Clear();
            // The history this watch needs is gone: its subscribers may
            // have missed changes; they watch again from a new snapshot.
            subscribers_.EndAll(absl::UnavailableError(absl::StrCat(
                "directory ", name(),
                ": its history was compacted past this watch; watch again")));
            watched_revision_ =
                std::max(watched_revision_, response.compact_revision());
            break;
          }
          // One revision may hold many events (a lease expiring withdraws
          // every name under it at once): skip only what an earlier
          // response delivered.
          const int64_t delivered = watched_revision_;
          for (const mvccpb::Event& event : response.events()) {
            const int64_t revision = event.kv().mod_revision();
            if (revision <= delivered) continue;
            auto name_event = ToNameEvent(event);
            if (name_event.has_value()) {
              if (name_event->kind() == v1::NameEvent::PUBLISHED) {
                cache_.Published(name_event->record(), revision);
              } else {
                cache_.Withdrawn(name_event->record().name(), revision);
              }
              subscribers_.Deliver(*name_event, revision);
            } else if (event.kv().key().size() > names.size()) {
              // An unreadable record: whatever was cached is stale.
              cache_.Withdrawn(event.kv().key().substr(names.size()), revision);
            }
            watched_revision_ = revision;
          }
        }
      }
      context.TryCancel();
      client_->WatchEnded((*stream)->Finish());
    }
    if (synced) {
      failed = 0;
      failing_since = absl::Now();
    } else {
      ++failed;
    }
    {
      // Etcd is lost once every endpoint failed to give a current stream
      // for a call timeout (a cluster electing a leader is not lost);
      // until then misses ask etcd.
      absl::MutexLock lock(&subscribers_.mu());
      watch_lost_ = failed >= endpoints &&
                    absl::Now() - failing_since >= options_.call_timeout;
      watch_synced_ = false;
    }
    absl::MutexLock lock(&watch_mu_);
    watch_context_ = nullptr;
    // The next endpoint at once; a second between rounds, unless stopping.
    watch_mu_.AwaitWithTimeout(absl::Condition(&watch_stopping_),
                               failed % endpoints != 0 || failed == 0
                                   ? absl::Milliseconds(100)
                                   : absl::Seconds(1));
    if (watch_stopping_) return;
  }
}

void EtcdDirectory::CancelStuckWatch() {
  absl::MutexLock lock(&watch_mu_);
  if (watch_context_ != nullptr && !watch_current_ &&
      absl::Now() - watch_opened_ > options_.call_timeout) {
    watch_context_->TryCancel();
  }
}

void EtcdDirectory::StopWatcher() {
  {
    absl::MutexLock lock(&watch_mu_);
    watch_stopping_ = true;
    if (watch_context_ != nullptr) watch_context_->TryCancel();
  }
  if (watcher_.joinable()) watcher_.join();
}

absl::Status EtcdDirectory::PutRecord() {
  std::string key;
  std::string value;
  {
    absl::MutexLock lock(&mu_);
    if (!record_.has_value()) return absl::OkStatus();
    key = AgentRecordKey(options_, record_->info().agent_id());
    value = EncodeAgentRecord(*record_);
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    bool new_lease = false;
    const absl::Time granted = absl::Now();
    if (lease_ == 0) {
      auto lease = client_->GrantLease(options_.lease_ttl);
      if (!lease.ok()) return lease.status();
      lease_ = *lease;
      new_lease = true;
    }
    absl::Status status = client_->Put(key, value, lease_);
    // The lease expired or etcd lost it: take a new one, once.
    if (status.code() == absl::StatusCode::kNotFound) {
      lease_ = 0;
      continue;
    }
    published_ = status.ok();
    if (published_ && new_lease) {
      absl::MutexLock lock(&mu_);
      lease_held_until_ = granted + options_.lease_ttl;
    }
    if (published_ && new_lease) names_dirty_ = !names_.empty();
    if (published_ && names_dirty_) PutNamesAgain();
    return status;
  }
  return absl::UnavailableError("etcd: leases granted expire at once");
}

absl::Status EtcdDirectory::KeepPublished() {
  if (lease_ != 0 && published_ && names_dirty_) PutNamesAgain();
  if (lease_ != 0 && published_) {
    const absl::Time asked = absl::Now();
    auto ttl = client_->KeepAlive(lease_);
    if (!ttl.ok() || *ttl <= absl::ZeroDuration()) {
      renewals_failed_.fetch_add(1, std::memory_order_relaxed);
    } else {
      renewals_ok_.fetch_add(1, std::memory_order_relaxed);
    }
    if (!ttl.ok()) return ttl.status();
    if (*ttl > absl::ZeroDuration()) {
      absl::MutexLock lock(&mu_);
      lease_held_until_ = asked + *ttl;
      return absl::OkStatus();
    }
    // etcd no longer has the lease, so the record is gone with it.
    spdlog::warn("directory {}: this agent's lease expired; publishing again",
                 name());
    lease_ = 0;
    published_ = false;
  }
  return PutRecord();
}

absl::Status EtcdDirectory::PublishAgent(const v1::AgentRecord& record) {
  {
    absl::MutexLock lock(&mu_);
    record_ = record;
  }
  absl::Status status;
  {
    absl::MutexLock lock(&keeper_mu_);
    published_ = false;
    status = PutRecord();
  }
  if (cache_enabled()) {
    // Follow the names from now on, so that resolutions can be cached.
    absl::MutexLock lock(&subscribers_.mu());
    StartWatcher();
  }
  absl::MutexLock lock(&mu_);
  if (!keeper_.joinable() && !stopping_) {
    keeper_ = std::thread([this] { KeeperLoop(); });
  }
  return status;
}

absl::Status EtcdDirectory::PutName(const v1::NameRecord& record) {
  if (lease_ == 0 || !published_) {
    return absl::UnavailableError(
        absl::StrCat("this agent is not published in the directory ", name(),
                     " (unreachable?); names need it"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (absl::Now() >= lease_held_until_) {
      return absl::UnavailableError(
          absl::StrCat("this agent's lease in the directory ", name(),
                       " could not be renewed within ",
                       absl::FormatDuration(options_.lease_ttl),
                       " (etcd unreachable?); names need it"));
    }
  }
  const std::string key = NameKey(options_, record.name());
  const std::string value = EncodeNameRecord(record);
  // Put only where nobody holds the name; otherwise read who does.
  etcdserverpb::TxnRequest create;
  etcdserverpb::Compare* absent = create.add_compare();
  absent->set_key(key);
  absent->set_target(etcdserverpb::Compare::CREATE);
  absent->set_result(etcdserverpb::Compare::EQUAL);
  absent->set_create_revision(0);
  etcdserverpb::PutRequest* put = create.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  put->set_lease(lease_);
  create.add_failure()->mutable_request_range()->set_key(key);
  auto created = client_->Txn(create);
  if (!created.ok()) return created.status();
  if (created->succeeded()) return absl::OkStatus();
  const auto& held = created->responses(0).response_range();
  if (held.kvs_size() == 0) {
    return absl::AbortedError(absl::StrCat("name \"", record.name(),
                                           "\" changed meanwhile; try again"));
  }
  auto holder = DecodeNameRecord(held.kvs(0).value());
  if (!holder.ok() || holder->agent_id() != record.agent_id() ||
      holder->owner_uid() != record.owner_uid()) {
    return absl::AlreadyExistsError(absl::StrCat(
        "name \"", record.name(), "\" is published by another user or agent",
        holder.ok() ? absl::StrCat(" (agent ", holder->agent_id(), ")")
                    : std::string()));
  }
  // The owner's own earlier record (an earlier life of this agent, or the
  // same name moved to another buffer): replace it, unless it changed since.
  etcdserverpb::TxnRequest replace;
  etcdserverpb::Compare* same = replace.add_compare();
  same->set_key(key);
  same->set_target(etcdserverpb::Compare::MOD);
  same->set_result(etcdserverpb::Compare::EQUAL);
  same->set_mod_revision(held.kvs(0).mod_revision());
  *replace.add_success()->mutable_request_put() = *put;
  auto replaced = client_->Txn(replace);
  if (!replaced.ok()) return replaced.status();
  if (!replaced->succeeded()) {
    return absl::AbortedError(absl::StrCat("name \"", record.name(),
                                           "\" changed meanwhile; try again"));
  }
  return absl::OkStatus();
}

void EtcdDirectory::PutNamesAgain() {
  names_dirty_ = false;
  for (auto it = names_.begin(); it != names_.end();) {
    absl::Status status = PutName(it->second);
    if (status.code() == absl::StatusCode::kAlreadyExists) {
      // Taken while this agent's lease was gone: the taker keeps it.
      spdlog::warn("directory {}: {}; it is no longer this agent's", name(),
                   std::string(status.message()));
      names_.erase(it++);
      continue;
    }
    if (!status.ok()) names_dirty_ = true;
    ++it;
  }
}

absl::Status EtcdDirectory::PublishName(const v1::NameRecord& record) {
  absl::MutexLock lock(&keeper_mu_);
  absl::Status status = PutName(record);
  if (status.ok()) names_[record.name()] = record;
  return status;
}

absl::Status EtcdDirectory::UnpublishName(const std::string& name,
                                          uint32_t uid) {
  absl::MutexLock lock(&keeper_mu_);
  auto it = names_.find(name);
  if (it == names_.end() || it->second.owner_uid() != uid) {
    return absl::NotFoundError(
        absl::StrCat("you have published no name \"", name, "\" here"));
  }
  names_.erase(it);
  if (lease_ == 0) return absl::OkStatus();  // gone with the lease
  // Delete it only while it is still under this agent's lease.
  const std::string key = NameKey(options_, name);
  etcdserverpb::TxnRequest txn;
  etcdserverpb::Compare* ours = txn.add_compare();
  ours->set_key(key);
  ours->set_target(etcdserverpb::Compare::LEASE);
  ours->set_result(etcdserverpb::Compare::EQUAL);
  ours->set_lease(lease_);
  txn.add_success()->mutable_request_delete_range()->set_key(key);
  auto done = client_->Txn(txn);
  return done.ok() ? absl::OkStatus() : done.status();
}

absl::Status EtcdDirectory::CheckClaimed(const v1::NameRecord& record) {
  absl::MutexLock lock(&mu_);
  if (!record_.has_value() || record.agent_id() != record_->info().agent_id() ||
      absl::Now() < lease_held_until_) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat(
      "the name \"", record.name(), "\" is this agent's, and its lease in ",
      name(), " could not be renewed within ",
      absl::FormatDuration(options_.lease_ttl),
      " (etcd unreachable?): it no longer claims it"));
}

absl::StatusOr<v1::NameRecord> EtcdDirectory::ResolveName(
    const std::string& name, absl::Time deadline) {
  {
    absl::MutexLock lock(&subscribers_.mu());
    if (cache_enabled()) {
      StartWatcher();
      if (std::optional<v1::NameRecord> cached = cache_.Lookup(name)) {
        absl::Status claimed = CheckClaimed(*cached);
        if (!claimed.ok()) return claimed;
        return *std::move(cached);
      }
      if (watch_lost_) {
        return absl::UnavailableError(absl::StrCat(
            "directory ", this->name(),
            ": etcd cannot be reached (the names "
            "watch is down); only names resolved here before are answered "
            "until it is back"));
      }
    }
  }
  int64_t revision = 0;
  auto value = client_->Get(NameKey(options_, name), deadline, &revision);
  if (!value.ok()) {
    return absl::Status(value.status().code(),
                        absl::StrCat("directory ", this->name(), ": ",
                                     value.status().message()));
  }
  if (!value->has_value()) {
    return NameNotPublished(name);
  }
  auto record = DecodeNameRecord((*value)->value());
  if (!record.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the name \"", name,
        "\" holds no readable record: ", record.status().message()));
  }
  {
    absl::MutexLock lock(&subscribers_.mu());
    // Cached only while the watch is current and has delivered nothing
    // after this read: every later change of the name then reaches the
    // entry, and no earlier one overwrites it.
    if (watch_synced_ && watched_revision_ <= revision) {
      cache_.Fill(*record, (*value)->mod_revision());
    }
  }
  absl::Status claimed = CheckClaimed(*record);
  if (!claimed.ok()) return claimed;
  return record;
}

DirectoryStats EtcdDirectory::Stats() {
  DirectoryStats stats;
  {
    absl::MutexLock lock(&subscribers_.mu());
    stats.resolve_cache_hits = cache_.hits();
    stats.resolve_cache_misses = cache_.misses();
    stats.resolve_cache_entries = cache_.entries();
    stats.resolve_cache_bytes = cache_.bytes();
    stats.watch_streams = subscribers_.size();
  }
  stats.lease_renewals_ok = renewals_ok_.load(std::memory_order_relaxed);
  stats.lease_renewals_failed =
      renewals_failed_.load(std::memory_order_relaxed);
  for (const EtcdClient::OperationCount& count : client_->Counts()) {
    stats.etcd.push_back({count.operation, count.calls, count.errors});
  }
  return stats;
}

void EtcdDirectory::KeeperLoop() {
  const absl::Duration renew = options_.lease_ttl / 3;
  absl::Duration wait = renew;
  bool failing = false;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), wait);
      if (stopping_) return;
    }
    CancelStuckWatch();
    absl::Status status;
    {
      absl::MutexLock lock(&keeper_mu_);
      status = KeepPublished();
    }
    if (status.ok()) {
      if (failing) spdlog::info("directory {}: published again", name());
      failing = false;
      wait = renew;
      continue;
    }
    if (auto held = failure_log_.Allow()) {
      spdlog::warn("directory {}: {} (retrying every second{})", name(),
                   std::string(status.message()),
                   *held > 0 ? absl::StrCat("; ", *held, " more failures")
                             : std::string());
    }
    failing = true;
    // Retry soon: the record must be back well within a lease's life.
    wait = std::min(renew, absl::Seconds(1));
  }
}

void EtcdDirectory::StopKeeper() {
  std::thread keeper;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    keeper = std::move(keeper_);
  }
  if (keeper.joinable()) keeper.join();
}

void EtcdDirectory::Withdraw() {
  StopKeeper();
  absl::MutexLock lock(&keeper_mu_);
  if (lease_ != 0) {
    // Revoking the lease deletes the record with it.
    absl::Status status = client_->RevokeLease(lease_);
    if (!status.ok()) {
      spdlog::warn(
          "directory {}: withdrawing this agent: {}; its record expires "
          "within {}",
          name(), std::string(status.message()),
          absl::FormatDuration(options_.lease_ttl));
    }
    lease_ = 0;
  }
  published_ = false;
  names_.clear();
  absl::MutexLock record_lock(&mu_);
  record_.reset();
  lease_held_until_ = absl::InfinitePast();
}

absl::StatusOr<v1::ListAgentsResponse> EtcdDirectory::ListAgents(
    absl::Time deadline) {
  const int64_t max = options_.max_listed_agents;
  auto range =
      client_->RangePrefix(options_.prefix + "/agents/", max + 1, deadline);
  if (!range.ok()) {
    return absl::Status(
        range.status().code(),
        absl::StrCat("directory ", name(), ": ", range.status().message()));
  }
  v1::ListAgentsResponse response;
  response.set_directory(name());
  int64_t seen = 0;
  for (const auto& kv : range->kvs()) {
    if (seen++ == max) {
      response.set_truncated(true);
      break;
    }
    auto record = DecodeAgentRecord(kv.value());
    if (!record.ok()) {
      response.set_unreadable(response.unreadable() + 1);
      continue;
    }
    *response.add_agents() = std::move(*record);
  }
  if (range->more()) response.set_truncated(true);
  return response;
}

}  // namespace rdma_agent
