#include "client/internal/transfer_tracker.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace rdma_agent::client::internal {

uint64_t TransferTracker::BeginSubmit() {
  absl::MutexLock lock(&mu_);
  const uint64_t ticket = ++last_ticket_;
  submitting_.insert(ticket);
  return ticket;
}

std::shared_ptr<TransferCore> TransferTracker::EndSubmit(
    uint64_t ticket, std::optional<uint64_t> id) {
  absl::MutexLock lock(&mu_);
  submitting_.erase(ticket);
  std::shared_ptr<TransferCore> core;
  if (id.has_value()) {
    core = OpenLocked(*id);
    core->confirmed = true;
  }
  PruneUnclaimed();
  return core;
}

std::shared_ptr<TransferCore> TransferTracker::Open(uint64_t id) {
  absl::MutexLock lock(&mu_);
  return OpenLocked(id);
}

std::shared_ptr<TransferCore> TransferTracker::OpenLocked(uint64_t id) {
  std::shared_ptr<TransferCore>& core = cores_[id];
  if (core == nullptr) core = std::make_shared<TransferCore>(id);
  ++core->handles;
  if (auto early = unclaimed_.find(id); early != unclaimed_.end()) {
    // Delivered before anyone held it, so no callback can be waiting.
    if (!core->end.has_value()) core->end = std::move(early->second.end);
    unclaimed_.erase(early);
  }
  return core;
}

void TransferTracker::Close(const std::shared_ptr<TransferCore>& core) {
  absl::MutexLock lock(&mu_);
  --core->handles;
  DropIfUnused(*core);
}

void TransferTracker::DropIfUnused(const TransferCore& core) {
  if (core.handles > 0 || core.on_done != nullptr) return;
  auto it = cores_.find(core.id);
  if (it != cores_.end() && it->second.get() == &core) cores_.erase(it);
}

void TransferTracker::PruneUnclaimed() {
  if (unclaimed_.empty()) return;
  // A SubmitAsync can claim an end only if it was in progress when the end
  // arrived, i.e. its ticket is at most the end's horizon.
  const uint64_t oldest =
      submitting_.empty() ? last_ticket_ + 1 : *submitting_.begin();
  std::vector<uint64_t> stale;
  for (const auto& [id, kept] : unclaimed_) {
    if (kept.horizon < oldest) stale.push_back(id);
  }
  for (uint64_t id : stale) unclaimed_.erase(id);
}

std::optional<TransferResult> TransferTracker::End(
    const TransferCore& core) const {
  absl::MutexLock lock(&mu_);
  return core.end;
}

bool TransferTracker::Confirmed(const TransferCore& core) const {
  absl::MutexLock lock(&mu_);
  return core.confirmed;
}

void TransferTracker::Confirm(TransferCore& core) {
  absl::MutexLock lock(&mu_);
  core.confirmed = true;
}

TransferCallback TransferTracker::RecordEnd(TransferCore& core,
                                            TransferResult end) {
  if (core.end.has_value()) return nullptr;
  core.end = std::move(end);
  TransferCallback callback = std::move(core.on_done);
  core.on_done = nullptr;
  DropIfUnused(core);
  return callback;
}

TransferResult TransferTracker::Resolve(
    const std::shared_ptr<TransferCore>& core, TransferResult end) {
  TransferCallback callback;
  TransferResult in_force;
  {
    absl::MutexLock lock(&mu_);
    callback = RecordEnd(*core, std::move(end));
    in_force = *core->end;
  }
  if (callback != nullptr) std::move(callback)(in_force);
  return in_force;
}

absl::Status TransferTracker::SetOnDone(
    const std::shared_ptr<TransferCore>& core, TransferCallback callback) {
  TransferResult end;
  {
    absl::MutexLock lock(&mu_);
    if (core->on_done != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "OnDone: transfer ", core->id, " already has a callback"));
    }
    if (!core->end.has_value()) {
      if (!watching_) {
        return absl::FailedPreconditionError(absl::StrCat(
            "OnDone: transfer ", core->id,
            " has not ended and no TransferWatch runs on this client to "
            "deliver its end (AgentClient::WatchTransfers)"));
      }
      core->on_done = std::move(callback);
      // Kept in the table even once no handle is left, until it runs.
      cores_.try_emplace(core->id, core);
      return absl::OkStatus();
    }
    end = *core->end;
  }
  std::move(callback)(std::move(end));
  return absl::OkStatus();
}

bool TransferTracker::WatchServes() const {
  absl::MutexLock lock(&mu_);
  return watching_;
}

TransferTracker::Awaited TransferTracker::AwaitEnd(const TransferCore& core,
                                                   absl::Time deadline,
                                                   TransferResult* end) {
  absl::MutexLock lock(&mu_);
  const auto settled = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return core.end.has_value() || !watching_;
  };
  mu_.AwaitWithDeadline(absl::Condition(&settled), deadline);
  if (core.end.has_value()) {
    *end = *core.end;
    return Awaited::kEnded;
  }
  return watching_ ? Awaited::kTimedOut : Awaited::kNoWatch;
}

absl::Status TransferTracker::BeginWatch() {
  absl::MutexLock lock(&mu_);
  if (watching_) {
    return absl::FailedPreconditionError(
        "WatchTransfers: this client already runs a TransferWatch (one per "
        "client: it carries every transfer of the user)");
  }
  watching_ = true;
  return absl::OkStatus();
}

TransferCallback TransferTracker::Delivered(TransferResult end) {
  absl::MutexLock lock(&mu_);
  auto it = cores_.find(end.id);
  if (it == cores_.end()) {
    // Nobody here holds it, unless a SubmitAsync in progress started it.
    if (!submitting_.empty()) {
      const uint64_t id = end.id;
      unclaimed_.insert_or_assign(id, Unclaimed{std::move(end), last_ticket_});
    }
    return nullptr;
  }
  // Held: DropIfUnused may erase the table's reference.
  std::shared_ptr<TransferCore> core = it->second;
  return RecordEnd(*core, std::move(end));
}

TransferTracker::Orphans TransferTracker::EndWatch() {
  Orphans orphans;
  absl::MutexLock lock(&mu_);
  watching_ = false;
  std::vector<std::shared_ptr<TransferCore>> waiting;
  for (const auto& [id, core] : cores_) {
    if (core->on_done != nullptr) waiting.push_back(core);
  }
  for (const std::shared_ptr<TransferCore>& core : waiting) {
    orphans.emplace_back(core->id, std::move(core->on_done));
    core->on_done = nullptr;
    DropIfUnused(*core);
  }
  // Ends kept for a SubmitAsync in progress stay: that call claims them
  // once it returns the id.
  return orphans;
}

absl::Status TransferTracker::Failure(uint64_t id, const absl::Status& why) {
  // A callback gets a value or an error, never an OK status.
  const absl::Status error =
      why.ok() ? absl::UnavailableError("the agent ended the stream") : why;
  return absl::Status(error.code(),
                      absl::StrCat("transfer ", id,
                                   ": the watch ended before its end arrived: ",
                                   error.message()));
}

size_t TransferTracker::records() const {
  absl::MutexLock lock(&mu_);
  return cores_.size();
}

size_t TransferTracker::unclaimed() const {
  absl::MutexLock lock(&mu_);
  return unclaimed_.size();
}

}  // namespace rdma_agent::client::internal
