#include "backends/ibverbs/port_watcher.h"

#include <utility>

#include "spdlog/spdlog.h"

namespace rdma_agent::ibverbs {

PortWatcher::PortWatcher(verbs::Device* device, OnPort on_port,
                         absl::Duration wait)
    : device_(device),
      on_port_(std::move(on_port)),
      wait_(wait),
      thread_([this] { Run(); }) {}

PortWatcher::~PortWatcher() {
  stop_ = true;
  thread_.join();
}

void PortWatcher::Run() {
  while (!stop_) {
    auto event = device_->GetAsyncEvent(wait_);
    if (!event.ok()) {
      // Ports are still looked at when ops are planned (ibv_query_port):
      // a device without usable events is slower to notice, not blind.
      spdlog::warn(
          "ibverbs: no asynchronous events from {} ({}): its ports are only "
          "looked at",
          device_->name(), event.status().ToString());
      return;
    }
    if (!event->has_value()) continue;
    const verbs::AsyncEvent& got = **event;
    if (got.type == IBV_EVENT_PORT_ACTIVE || got.type == IBV_EVENT_PORT_ERR) {
      on_port_(got.port, got.type == IBV_EVENT_PORT_ACTIVE);
    } else {
      spdlog::debug("ibverbs: {} reported {} (port {})", device_->name(),
                    verbs::AsyncEventName(got.type), got.port);
    }
  }
}

}  // namespace rdma_agent::ibverbs
