#include "backends/ibverbs/rails.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace rdma_agent::ibverbs {

void Cooldown::Fail(absl::Time now, absl::Duration initial, absl::Duration max,
                    std::string why) {
  backoff_ = failures_ == 0 ? initial : std::min(backoff_ * 2, max);
  until_ = now + backoff_;
  why_ = std::move(why);
  ++failures_;
}

void Cooldown::Recover() {
  until_ = absl::InfinitePast();
  backoff_ = absl::ZeroDuration();
  failures_ = 0;
}

std::string RemoteRail::name() const { return absl::StrCat(device, ":", port); }

std::vector<RemoteRail> RemoteRailsOf(const v1::IbverbsEndpoint& endpoint) {
  std::vector<RemoteRail> rails;
  for (const v1::IbverbsRail& rail : endpoint.rails()) {
    if (rails.size() == kMaxRemoteRails) break;
    RemoteRail r;
    r.device = rail.device();
    r.port = rail.port();
    r.lid = rail.lid();
    r.gid = rail.gid();
    r.max_message_bytes = rail.max_message_bytes();
    r.speed_gbps = rail.speed_gbps();
    rails.push_back(std::move(r));
  }
  if (rails.empty()) {
    RemoteRail r;
    r.device = endpoint.device();
    r.port = endpoint.port();
    r.lid = endpoint.lid();
    r.gid = endpoint.gid();
    r.max_message_bytes = endpoint.max_message_bytes();
    rails.push_back(std::move(r));
  }
  return rails;
}

std::vector<bool> RemoteNearRailsOf(const v1::IbverbsEndpoint& endpoint) {
  std::vector<bool> near;
  RemoteNearRailsOf(endpoint, near);
  return near;
}

void RemoteNearRailsOf(const v1::IbverbsEndpoint& endpoint,
                       std::vector<bool>& near) {
  const size_t count =
      std::clamp<size_t>(endpoint.rails_size(), 1, kMaxRemoteRails);
  near.assign(count, false);
  bool any = false;
  for (uint32_t index : endpoint.near_rails()) {
    if (index >= count) continue;  // past the rails used, or forged
    near[index] = true;
    any = true;
  }
  if (!any) near.assign(count, true);
}

Lane::Lane(std::string key, std::string peer, Rail* rail, RemoteRail remote)
    : key(std::move(key)),
      peer(std::move(peer)),
      rail(rail),
      remote(std::move(remote)),
      load(std::make_shared<LaneLoad>(
          absl::StrCat(rail->name, "->", this->remote.name()))) {}

}  // namespace rdma_agent::ibverbs
