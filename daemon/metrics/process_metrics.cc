#include "daemon/metrics/process_metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <optional>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace rdma_agent {
namespace {

std::optional<std::string> ReadText(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  return std::string((std::istreambuf_iterator<char>(in)),
                     std::istreambuf_iterator<char>());
}

prometheus::MetricFamily Family(const std::string& name,
                                const std::string& help,
                                prometheus::MetricType type, double value) {
  prometheus::MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = type;
  prometheus::ClientMetric metric;
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family.metric.push_back(metric);
  return family;
}

// Seconds since the epoch at which the system booted (/proc/stat btime).
std::optional<double> BootTime() {
  const std::optional<std::string> stat = ReadText("/proc/stat");
  if (!stat.has_value()) return std::nullopt;
  for (absl::string_view line : absl::StrSplit(*stat, '\n')) {
    double seconds;
    if (absl::ConsumePrefix(&line, "btime ") &&
        absl::SimpleAtod(line, &seconds)) {
      return seconds;
    }
  }
  return std::nullopt;
}

}  // namespace

std::vector<prometheus::MetricFamily> CollectProcessMetrics(
    const std::string& proc_self) {
  std::vector<prometheus::MetricFamily> out;
  const auto gauge = prometheus::MetricType::Gauge;
  // /proc/PID/stat: the fields after the command name, which is in
  // parentheses and may hold spaces.
  if (const auto stat = ReadText(proc_self + "/stat"); stat.has_value()) {
    const size_t close = stat->rfind(')');
    if (close != std::string::npos) {
      // fields[0] is the state (field 3 of proc(5)).
      const std::vector<absl::string_view> fields = absl::StrSplit(
          absl::string_view(*stat).substr(close + 2), ' ', absl::SkipEmpty());
      const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
      const double page = static_cast<double>(::sysconf(_SC_PAGESIZE));
      double utime, stime, threads, start, vsize, rss;
      if (fields.size() > 21 && absl::SimpleAtod(fields[11], &utime) &&
          absl::SimpleAtod(fields[12], &stime) &&
          absl::SimpleAtod(fields[17], &threads) &&
          absl::SimpleAtod(fields[19], &start) &&
          absl::SimpleAtod(fields[20], &vsize) &&
          absl::SimpleAtod(fields[21], &rss)) {
        out.push_back(Family("process_cpu_seconds_total",
                             "Total user and system CPU time spent in seconds",
                             prometheus::MetricType::Counter,
                             (utime + stime) / ticks));
        out.push_back(Family("process_resident_memory_bytes",
                             "Resident memory size in bytes", gauge,
                             rss * page));
        out.push_back(Family("process_virtual_memory_bytes",
                             "Virtual memory size in bytes", gauge, vsize));
        out.push_back(
            Family("process_threads", "Number of OS threads", gauge, threads));
        if (const std::optional<double> boot = BootTime()) {
          out.push_back(
              Family("process_start_time_seconds",
                     "Start time of the process since unix epoch in seconds",
                     gauge, *boot + start / ticks));
        }
      }
    }
  }
  if (DIR* dir = ::opendir((proc_self + "/fd").c_str()); dir != nullptr) {
    // Reading our own fds lists the directory's fd too: not counted.
    const std::string own =
        proc_self == "/proc/self" ? std::to_string(::dirfd(dir)) : "";
    double fds = 0;
    while (const dirent* entry = ::readdir(dir)) {
      if (entry->d_name[0] != '.' && entry->d_name != own) ++fds;
    }
    ::closedir(dir);
    out.push_back(Family("process_open_fds", "Number of open file descriptors",
                         gauge, fds));
  }
  struct rlimit files = {};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0) {
    out.push_back(Family("process_max_fds",
                         "Maximum number of open file descriptors", gauge,
                         static_cast<double>(files.rlim_cur)));
  }
  return out;
}

}  // namespace rdma_agent
