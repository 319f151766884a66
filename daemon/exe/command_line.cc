#include "daemon/exe/command_line.h"

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "daemon/exe/build_info.h"

namespace rdma_agent {
namespace {

// Follows "rdma-agentd: " in the help text.
constexpr char kUsage[] =
    "the per-host RDMA transfer agent; serves rdma.agent.v1 on a Unix "
    "socket.\n\n  rdma-agentd [--flagfile=FILE] [--flag=value ...]";

// Paths as the build names them: "backends/tcp/flags.cc",
// "absl/flags/parse.cc".
std::string NormalizeFilename(absl::string_view file) {
  absl::ConsumePrefix(&file, "./");
  return std::string(file);
}

// Abseil's default lists only flags defined in a file named after the
// program (rdma-agentd.cc): none. Ours live in daemon/ and in each backend's
// flags.cc, and --flagfile (how the unit configures the agent) in abseil.
bool IsHelpFile(absl::string_view file) {
  return absl::StartsWith(file, "daemon/") ||
         absl::StartsWith(file, "backends/") ||
         absl::StartsWith(file, "common/") ||
         absl::EndsWith(file, "absl/flags/parse.cc");
}

bool IsDaemonFile(absl::string_view file) {
  return absl::StartsWith(file, "daemon/");
}

void ConfigureUsage() {
  absl::SetProgramUsageMessage(kUsage);
  absl::FlagsUsageConfig config;
  config.contains_help_flags = IsHelpFile;
  config.contains_helpshort_flags = IsDaemonFile;
  config.contains_helppackage_flags = IsDaemonFile;
  config.version_string = VersionText;
  config.normalize_filename = NormalizeFilename;
  absl::SetFlagsUsageConfig(std::move(config));
}

}  // namespace

void ParseCommandLineOrExit(int argc, char** argv) {
  ConfigureUsage();
  // absl::ParseCommandLine of this abseil (20220623) exits 1 after printing
  // the help that was asked for; its usage flags are answered here instead.
  // Unknown flags still end the process inside (exit 1, naming the flag).
  namespace internal = absl::flags_internal;
  const std::vector<char*> arguments = internal::ParseCommandLineImpl(
      argc, argv, internal::ArgvListAction::kRemoveParsedArgs,
      internal::UsageFlagsAction::kIgnoreUsage,
      internal::OnUndefinedFlag::kAbortIfUndefined);
  if (internal::HandleUsageFlags(std::cout, absl::ProgramUsageMessage()) !=
      -1) {
    std::cout.flush();
    std::exit(0);
  }
  // arguments[0] is the program; the agent takes no others.
  if (arguments.size() > 1) {
    std::cerr << "rdma-agentd: unexpected argument '" << arguments[1]
              << "': flags are --name=value (see --help)\n";
    std::exit(2);
  }
}

}  // namespace rdma_agent
