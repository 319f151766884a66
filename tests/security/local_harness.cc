#include "tests/security/local_harness.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace rdma_agent::testing {

absl::StatusOr<LocalWorker> LocalWorker::Start(const AgentProcess& agent,
                                               int uid) {
  Subprocess::Options spawn;
  spawn.argv = {RunfilePath("tests/security/local_worker"),
                "--target=" + agent.target(),
                "--attach_socket=" + agent.attach_socket_path()};
  if (uid >= 0) {
    spawn.argv.push_back(absl::StrCat("--uid=", uid));
    spawn.argv.push_back(absl::StrCat("--gid=", uid));
  }
  spawn.pipe_stdio = true;
  absl::StatusOr<Subprocess> process = Subprocess::Spawn(std::move(spawn));
  if (!process.ok()) return process.status();
  absl::StatusOr<std::string> ready = process->ReadLine(absl::Seconds(30));
  if (!ready.ok()) return ready.status();
  if (!absl::StartsWith(*ready, "ready ")) {
    return absl::InternalError(absl::StrCat("worker did not start: ", *ready));
  }
  return LocalWorker(std::move(*process));
}

std::string LocalWorker::Ask(absl::string_view command,
                             absl::Duration timeout) {
  absl::Status written = process_.WriteLine(command);
  if (!written.ok())
    return absl::StrCat("<no answer: ", written.ToString(), ">");
  absl::StatusOr<std::string> line = process_.ReadLine(timeout);
  if (!line.ok())
    return absl::StrCat("<no answer: ", line.status().ToString(), ">");
  return *line;
}

uint64_t VmSizeBytes(pid_t pid) {
  return static_cast<uint64_t>(
      std::max<int64_t>(0, ProcessStatusBytes(pid, "VmSize")));
}

int OpenFdCount(pid_t pid) {
  DIR* dir = ::opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (dir == nullptr) return -1;
  int count = 0;
  while (struct dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  ::closedir(dir);
  return count;
}

size_t CountOf(absl::string_view text, absl::string_view needle) {
  size_t count = 0;
  for (size_t at = text.find(needle); at != absl::string_view::npos;
       at = text.find(needle, at + needle.size())) {
    ++count;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<AgentProcess>> StartSharedAgent(
    std::vector<std::string> extra_flags) {
  AgentProcess::Options options;
  options.log_level = "info";
  options.extra_flags = std::move(extra_flags);
  auto agent = AgentProcess::Start(std::move(options));
  if (!agent.ok()) return agent.status();
  // mkdtemp made it 0700; the daemon makes its sockets 0666.
  if (::chmod((*agent)->runtime_dir().c_str(), 0755) != 0) {
    return absl::InternalError("chmod of the runtime dir failed");
  }
  return agent;
}

}  // namespace rdma_agent::testing
