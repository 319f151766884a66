#include "daemon/directory/etcd_directory.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/directory/agent_record.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {

EtcdDirectory::EtcdDirectory(DirectoryOptions options,
                             std::unique_ptr<EtcdClient> client)
    : options_(std::move(options)), client_(std::move(client)) {}

EtcdDirectory::~EtcdDirectory() { StopKeeper(); }

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
    if (lease_ == 0) {
      auto lease = client_->GrantLease(options_.lease_ttl);
      if (!lease.ok()) return lease.status();
      lease_ = *lease;
    }
    absl::Status status = client_->Put(key, value, lease_);
    // The lease expired or etcd lost it: take a new one, once.
    if (status.code() == absl::StatusCode::kNotFound) {
      lease_ = 0;
      continue;
    }
    published_ = status.ok();
    return status;
  }
  return absl::UnavailableError("etcd: leases granted expire at once");
}

absl::Status EtcdDirectory::KeepPublished() {
  if (lease_ != 0 && published_) {
    auto ttl = client_->KeepAlive(lease_);
    if (!ttl.ok()) return ttl.status();
    if (*ttl > absl::ZeroDuration()) return absl::OkStatus();
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
  absl::MutexLock lock(&mu_);
  if (!keeper_.joinable() && !stopping_) {
    keeper_ = std::thread([this] { KeeperLoop(); });
  }
  return status;
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
  absl::MutexLock record_lock(&mu_);
  record_.reset();
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
