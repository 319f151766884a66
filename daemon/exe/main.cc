// rdma-agentd: the per-host RDMA transfer agent.
#include <signal.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/log_text.h"
#include "daemon/agent.h"
#include "daemon/api/version.h"
#include "daemon/exe/build_info.h"
#include "daemon/exe/command_line.h"
#include "daemon/exe/flags.h"
#include "daemon/exe/logging.h"
#include "daemon/exe/main_loop.h"
#include "daemon/exe/systemd_notifier.h"
#include "daemon/limits/quota.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {
namespace {

// "--name=value" of every flag whose value is not its default, so that the
// startup line says how this agent differs from a stock one.
std::string NonDefaultFlags() {
  std::vector<std::string> changed;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (flag->CurrentValue() != flag->DefaultValue()) {
      changed.push_back(absl::StrCat("--", name, "=", flag->CurrentValue()));
    }
  }
  if (changed.empty()) return "defaults";
  std::sort(changed.begin(), changed.end());
  return LogSafe(absl::StrJoin(changed, " "));
}

int Run() {
  // First, so that every later refusal is seen.
  const LoggingFlags logging = LoggingFromFlags();
  auto log_format = ParseLogFormat(logging.format);
  auto log_level = ParseLogLevel(logging.level);
  if (!log_level.ok() || !log_format.ok()) {
    ConfigureLogging(spdlog::level::info,
                     log_format.ok() ? *log_format : LogFormat::kPlain);
    spdlog::critical(
        "{}", std::string(!log_level.ok() ? log_level.status().message()
                                          : log_format.status().message()));
    return 2;
  }
  ConfigureLogging(*log_level, *log_format);
  // Every registration and parked attachment holds an fd: take what the
  // hard limit allows. The admission defaults are derived from the result.
  spdlog::info("open-file limit {}",
               SetOpenFileLimit(logging.open_files_limit));

  auto options = AgentOptionsFromFlags();
  if (!options.ok()) {
    spdlog::critical("{}", std::string(options.status().message()));
    return 2;
  }
  options->build_revision = BuildRevision();

  // Before Agent::Start creates threads, so that they inherit the mask.
  const sigset_t signals = BlockAgentSignals();
  signal(SIGPIPE, SIG_IGN);
  const SystemdNotifier notifier;
  notifier.Status("starting");

  auto agent = Agent::Start(std::move(*options));
  if (!agent.ok()) {
    spdlog::critical("rdma-agentd cannot start: {}", agent.status().ToString());
    notifier.Status(absl::StrCat("cannot start: ", agent.status().message()));
    return 1;
  }
  // The line operators (and tests, and tools/run.sh) wait for.
  spdlog::info("rdma-agentd {} {}; flags: {}", kAgentVersion,
               (*agent)->Describe(), NonDefaultFlags());
  // Every socket listens: units ordered after this one may start now.
  notifier.Ready(ServingStatus(**agent));
  const int signal_number = ServeUntilStopSignal(signals, notifier);
  spdlog::info("signal {} received, shutting down", signal_number);
  notifier.Stopping(absl::StrCat("stopping: ", strsignal(signal_number)));
  (*agent)->Shutdown();
  spdlog::info("rdma-agentd stopped");
  return 0;
}

}  // namespace
}  // namespace rdma_agent

int main(int argc, char** argv) {
  // Debian builds abseil with lock-order (deadlock) detection on: every
  // lock and unlock then costs ~10x (measured 140-200 ns against 12-20 ns).
  // Tests keep it on (they run the agent as a library); the daemon turns it
  // off.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  rdma_agent::ParseCommandLineOrExit(argc, argv);
  return rdma_agent::Run();
}
