#include "daemon/exe/logging.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/log_context.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {
namespace {

// syslog(3) priorities, as sd-daemon(3) prefixes expect them.
int SyslogPriority(spdlog::level::level_enum level) {
  switch (level) {
    case spdlog::level::trace:
    case spdlog::level::debug:
      return 7;  // LOG_DEBUG
    case spdlog::level::info:
      return 6;  // LOG_INFO
    case spdlog::level::warn:
      return 4;  // LOG_WARNING
    case spdlog::level::err:
      return 3;  // LOG_ERR
    case spdlog::level::critical:
      return 2;  // LOG_CRIT
    default:
      return 6;
  }
}

// "%*" in a pattern: the line's "<N>" priority prefix.
class PriorityFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    const std::string prefix =
        absl::StrCat("<", SyslogPriority(msg.level), ">");
    dest.append(prefix.data(), prefix.data() + prefix.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<PriorityFlag>();
  }
};

// `text` as the inside of a JSON string. Bytes outside ASCII are written as
// \u00XX: a line stays valid JSON whatever bytes a message carries
// (callers' strings are already escaped by LogSafe).
void AppendJsonString(absl::string_view text, std::string* out) {
  for (const char c : text) {
    const unsigned char byte = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(c);
    } else if (byte < 0x20 || byte >= 0x7f) {
      absl::StrAppend(out, "\\u00", absl::Hex(byte, absl::kZeroPad2));
    } else {
      out->push_back(c);
    }
  }
}

// One JSON object a line (LogFormat::kJson).
class JsonFormatter : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg,
              spdlog::memory_buf_t& dest) override {
    std::string line = absl::StrCat(
        "{\"time\":\"",
        absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::FromChrono(msg.time),
                         absl::UTCTimeZone()),
        "\",\"level\":\"");
    const spdlog::string_view_t level =
        spdlog::level::to_string_view(msg.level);
    line.append(level.data(), level.size());
    line.append("\",\"message\":\"");
    AppendJsonString(absl::string_view(msg.payload.data(), msg.payload.size()),
                     &line);
    line.push_back('"');
    const LogContext& context = CurrentLogContext();
    if (!context.method.empty()) {
      line.append(",\"method\":\"");
      AppendJsonString(context.method, &line);
      line.push_back('"');
    }
    if (context.uid.has_value())
      absl::StrAppend(&line, ",\"uid\":", *context.uid);
    if (context.pid.has_value())
      absl::StrAppend(&line, ",\"pid\":", *context.pid);
    line.append("}\n");
    dest.append(line.data(), line.data() + line.size());
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }
};

}  // namespace

absl::StatusOr<spdlog::level::level_enum> ParseLogLevel(
    absl::string_view text) {
  const std::string level = absl::AsciiStrToLower(text);
  if (level == "trace") return spdlog::level::trace;
  if (level == "debug") return spdlog::level::debug;
  if (level == "info") return spdlog::level::info;
  if (level == "warn" || level == "warning") return spdlog::level::warn;
  if (level == "error") return spdlog::level::err;
  if (level == "critical") return spdlog::level::critical;
  if (level == "off") return spdlog::level::off;
  return absl::InvalidArgumentError(
      absl::StrCat("--log_level: unknown level \"", text,
                   "\"; use trace, debug, info, warn, error, critical or off"));
}

bool IsJournalStream(int fd) {
  const char* stream = std::getenv("JOURNAL_STREAM");
  if (stream == nullptr) return false;
  uintmax_t device = 0;
  uintmax_t inode = 0;
  if (std::sscanf(stream, "%" SCNuMAX ":%" SCNuMAX, &device, &inode) != 2) {
    return false;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) return false;
  return static_cast<uintmax_t>(st.st_dev) == device &&
         static_cast<uintmax_t>(st.st_ino) == inode;
}

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view text, int fd) {
  const std::string format = absl::AsciiStrToLower(text);
  if (format == "journal") return LogFormat::kJournal;
  if (format == "terminal") return LogFormat::kTerminal;
  if (format == "plain") return LogFormat::kPlain;
  if (format == "json") return LogFormat::kJson;
  if (format == "auto") {
    if (IsJournalStream(fd)) return LogFormat::kJournal;
    return ::isatty(fd) ? LogFormat::kTerminal : LogFormat::kPlain;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--log_format: unknown format \"", text,
                   "\"; use auto, journal, terminal, plain or json"));
}

std::unique_ptr<spdlog::formatter> MakeLogFormatter(LogFormat format) {
  if (format == LogFormat::kJson) return std::make_unique<JsonFormatter>();
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  switch (format) {
    case LogFormat::kJournal:
      formatter->add_flag<PriorityFlag>('*').set_pattern("%*%v");
      break;
    case LogFormat::kTerminal:
      formatter->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] %v");
      break;
    case LogFormat::kPlain:
      // UTC with a zone marker: lines from several hosts line up.
      formatter = std::make_unique<spdlog::pattern_formatter>(
          spdlog::pattern_time_type::utc);
      formatter->set_pattern("%Y-%m-%dT%H:%M:%S.%fZ %l %v");
      break;
    case LogFormat::kJson:
      break;  // returned above
  }
  return formatter;
}

void ConfigureLogging(spdlog::level::level_enum level, LogFormat format) {
  std::shared_ptr<spdlog::sinks::sink> sink;
  if (format == LogFormat::kTerminal) {
    sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  } else {
    sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  }
  auto logger = std::make_shared<spdlog::logger>("rdma-agentd", sink);
  logger->set_formatter(MakeLogFormatter(format));
  logger->set_level(level);
  // Warnings and worse reach the journal or the file at once, even if the
  // agent dies right after.
  logger->flush_on(spdlog::level::warn);
  spdlog::set_default_logger(std::move(logger));
}

}  // namespace rdma_agent
