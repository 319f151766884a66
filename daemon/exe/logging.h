#ifndef RDMA_AGENTD_DAEMON_EXE_LOGGING_H_
#define RDMA_AGENTD_DAEMON_EXE_LOGGING_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "spdlog/common.h"
#include "spdlog/formatter.h"

namespace rdma_agent {

// The agent logs to stderr, in the form its reader wants:
// - kJournal: journald reads stderr (systemd sets JOURNAL_STREAM to it):
//   each line starts with a syslog priority "<N>" so that journalctl -p
//   works, and has no timestamp (journald adds its own) and no colour.
// - kTerminal: a person at a TTY: timestamps and coloured levels.
// - kPlain: a pipe or file (docker logs, kubectl logs, a test): timestamps
//   and level names, no colour codes.
// - kJson: log stacks that parse (Kubernetes collectors): one JSON object a
//   line with "time" (UTC, RFC 3339), "level", "message", and "method",
//   "uid" and "pid" when the line is about an RPC and its caller
//   (common/log_context.h).
enum class LogFormat { kJournal, kTerminal, kPlain, kJson };

// --log_level: trace, debug, info, warn (or warning), error, critical, off,
// in any case. Anything else is INVALID_ARGUMENT listing the valid values,
// so that a typo never silently turns logging off.
absl::StatusOr<spdlog::level::level_enum> ParseLogLevel(absl::string_view text);

// --log_format: auto, journal, terminal, plain or json. auto decides from
// where `fd` (stderr) goes: journald, a TTY, else plain.
absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view text, int fd = 2);

// True when $JOURNAL_STREAM names `fd`'s device and inode (sd-daemon(3)'s
// way to tell that a stream is connected to journald).
bool IsJournalStream(int fd);

// The formatter of one format (exposed for tests).
std::unique_ptr<spdlog::formatter> MakeLogFormatter(LogFormat format);

// Makes the default logger write to stderr in `format` at `level`.
void ConfigureLogging(spdlog::level::level_enum level, LogFormat format);

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_EXE_LOGGING_H_
