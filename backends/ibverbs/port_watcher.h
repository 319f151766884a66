#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_PORT_WATCHER_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_PORT_WATCHER_H_

// Takes a device's asynchronous events on a thread of its own and hands
// the port events on: a port that came up (IBV_EVENT_PORT_ACTIVE) or went
// down (IBV_EVENT_PORT_ERR) is known at once rather than at the next
// ibv_query_port. The ibverbs backend runs one per device.

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>

#include "absl/time/time.h"
#include "backends/ibverbs/verbs.h"

namespace rdma_agent::ibverbs {

class PortWatcher {
 public:
  // Called on the watcher's thread for each port event: the port, and
  // whether it is ACTIVE now.
  using OnPort = std::function<void(uint8_t port, bool active)>;

  // Starts the thread. `device` must outlive the watcher. `wait` bounds how
  // long stopping takes (each wait for an event is at most that long).
  PortWatcher(verbs::Device* device, OnPort on_port,
              absl::Duration wait = absl::Milliseconds(100));
  // Asks the thread to stop without waiting for it, so that an owner of
  // several stops them all in one wait.
  void RequestStop() { stop_ = true; }
  // Stops and joins the thread: `on_port` is not called afterwards.
  ~PortWatcher();
  PortWatcher(const PortWatcher&) = delete;
  PortWatcher& operator=(const PortWatcher&) = delete;

 private:
  void Run();

  verbs::Device* const device_;
  const OnPort on_port_;
  const absl::Duration wait_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace rdma_agent::ibverbs

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_PORT_WATCHER_H_
