#include "daemon/exe/systemd_notifier.h"

#include <systemd/sd-daemon.h>

#include <cstdint>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace rdma_agent {
namespace {

// STATUS= is one line: a newline would start another assignment.
std::string OneLine(absl::string_view text) {
  return absl::StrReplaceAll(text, {{"\n", " "}});
}

}  // namespace

SystemdNotifier::SystemdNotifier() {
  const char* socket = std::getenv("NOTIFY_SOCKET");
  enabled_ = socket != nullptr && *socket != '\0';
  uint64_t usec = 0;
  // > 0 only when the watchdog is on and meant for this process.
  if (enabled_ && sd_watchdog_enabled(/*unset_environment=*/0, &usec) > 0) {
    watchdog_interval_ = absl::Microseconds(static_cast<int64_t>(usec));
  }
}

void SystemdNotifier::Send(const std::string& state) const {
  if (enabled_) (void)sd_notify(/*unset_environment=*/0, state.c_str());
}

void SystemdNotifier::Ready(absl::string_view status) const {
  Send(absl::StrCat("READY=1\nSTATUS=", OneLine(status)));
}

void SystemdNotifier::Status(absl::string_view status) const {
  Send(absl::StrCat("STATUS=", OneLine(status)));
}

void SystemdNotifier::WatchdogPing() const { Send("WATCHDOG=1"); }

void SystemdNotifier::Stopping(absl::string_view status) const {
  Send(absl::StrCat("STOPPING=1\nSTATUS=", OneLine(status)));
}

}  // namespace rdma_agent
