#include "daemon/directory/name_subscribers.h"

#include <utility>

#include "absl/strings/match.h"

namespace rdma_agent {

class NameSubscribers::Handle final : public Directory::Subscription {
 public:
  Handle(NameSubscribers* owner, std::list<Entry>::iterator entry)
      : owner_(owner), entry_(entry) {}
  ~Handle() override {
    absl::MutexLock lock(&owner_->mu_);
    owner_->entries_.erase(entry_);
  }

 private:
  NameSubscribers* const owner_;
  const std::list<Entry>::iterator entry_;
};

NameSubscribers::~NameSubscribers() = default;

std::unique_ptr<Directory::Subscription> NameSubscribers::Add(
    std::string prefix, int64_t revision, Directory::NameEventCallback on_event,
    Directory::EndCallback on_end) {
  entries_.push_back(Entry{std::move(prefix), revision, std::move(on_event),
                           std::move(on_end)});
  return std::make_unique<Handle>(this, std::prev(entries_.end()));
}

void NameSubscribers::Deliver(const v1::NameEvent& event, int64_t revision) {
  for (Entry& entry : entries_) {
    if (entry.ended || revision <= entry.revision ||
        !absl::StartsWith(event.record().name(), entry.prefix)) {
      continue;
    }
    entry.on_event(event);
  }
}

void NameSubscribers::EndAll(const absl::Status& status) {
  for (Entry& entry : entries_) {
    if (entry.ended) continue;
    entry.ended = true;
    entry.on_end(status);
  }
}

}  // namespace rdma_agent
