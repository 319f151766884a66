#ifndef RDMA_AGENTD_DAEMON_EXE_SYSTEMD_NOTIFIER_H_
#define RDMA_AGENTD_DAEMON_EXE_SYSTEMD_NOTIFIER_H_

#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace rdma_agent {

// Tells the service manager how the agent is doing (sd_notify(3)): READY
// once every socket listens, STATUS lines, WATCHDOG pings, STOPPING. Under
// systemd with Type=notify, NOTIFY_SOCKET is set; elsewhere (a shell, a
// container) every call is a no-op, so the agent runs the same everywhere.
class SystemdNotifier {
 public:
  // Reads NOTIFY_SOCKET and WATCHDOG_USEC/WATCHDOG_PID from the environment.
  SystemdNotifier();

  // True when a service manager listens.
  bool enabled() const { return enabled_; }
  // How often systemd expects a ping (WatchdogSec=); zero when it does not.
  absl::Duration watchdog_interval() const { return watchdog_interval_; }

  void Ready(absl::string_view status) const;
  void Status(absl::string_view status) const;
  void WatchdogPing() const;
  void Stopping(absl::string_view status) const;

 private:
  void Send(const std::string& state) const;

  bool enabled_ = false;
  absl::Duration watchdog_interval_;
};

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_EXE_SYSTEMD_NOTIFIER_H_
