#include "daemon/exe/main_loop.h"

#include <time.h>

#include <chrono>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log_text.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {
namespace {

using Clock = std::chrono::steady_clock;

// The next of `signals`, or 0 when `timeout` (none: no bound) passes first or
// the wait is interrupted.
int WaitForSignal(const sigset_t& signals,
                  std::optional<Clock::duration> timeout) {
  if (!timeout.has_value()) {
    int signal_number = 0;
    return sigwait(&signals, &signal_number) == 0 ? signal_number : 0;
  }
  const auto nanos = std::max<int64_t>(
      0,
      std::chrono::duration_cast<std::chrono::nanoseconds>(*timeout).count());
  const timespec wait = {static_cast<time_t>(nanos / 1000000000),
                         static_cast<long>(nanos % 1000000000)};
  const int signal_number = sigtimedwait(&signals, nullptr, &wait);
  return signal_number > 0 ? signal_number : 0;
}

}  // namespace

sigset_t BlockAgentSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

std::string ServingStatus(const Agent& agent) {
  std::vector<std::string> available;
  std::vector<std::string> unavailable;
  for (const auto& backend : agent.registry().backends()) {
    if (backend->available()) {
      available.push_back(backend->name());
    } else {
      unavailable.push_back(
          absl::StrCat(backend->name(), " (",
                       LogSafe(backend->unavailable_reason(), 80), ")"));
    }
  }
  std::string status =
      absl::StrCat("serving ", agent.target(),
                   "; backends: ", absl::StrJoin(available, ", "));
  if (!unavailable.empty()) {
    absl::StrAppend(&status,
                    "; unavailable: ", absl::StrJoin(unavailable, ", "));
  }
  return status;
}

int ServeUntilStopSignal(const sigset_t& signals,
                         const SystemdNotifier& notifier) {
  // A steady clock: a wall-clock jump must not stall the pings.
  const auto ping_every = std::chrono::duration_cast<Clock::duration>(
      absl::ToChronoNanoseconds(notifier.watchdog_interval() / 2));
  const bool watchdog = ping_every > Clock::duration::zero();
  Clock::time_point next_ping = Clock::now();
  for (;;) {
    if (watchdog && Clock::now() >= next_ping) {
      notifier.WatchdogPing();
      next_ping = Clock::now() + ping_every;
    }
    std::optional<Clock::duration> timeout;
    if (watchdog) timeout = next_ping - Clock::now();
    switch (const int signal_number = WaitForSignal(signals, timeout)) {
      case SIGTERM:
      case SIGINT:
        return signal_number;
      case SIGHUP:
        spdlog::info("SIGHUP received: nothing to reload; logs go to stderr");
        break;
      default:  // the next ping is due, or an interrupted wait
        break;
    }
  }
}

}  // namespace rdma_agent
