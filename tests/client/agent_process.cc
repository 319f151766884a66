#include "tests/client/agent_process.h"

#include <signal.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace rdma_agent::testing {
namespace {

void AppendLine(const std::string& path, const std::string& line) {
  std::ofstream out(path, std::ios::app);
  out << line << "\n";
}

}  // namespace

absl::StatusOr<std::unique_ptr<AgentProcess>> AgentProcess::Start(
    std::vector<std::string> extra_flags, absl::Duration timeout) {
  absl::StatusOr<std::string> dir = MakeShortTempDir();
  if (!dir.ok()) return dir.status();
  const char* outputs = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR");
  const std::string log_path =
      absl::StrCat(outputs != nullptr ? outputs : *dir, "/rdma-agentd.",
                   dir->substr(dir->rfind('.') + 1), ".log");
  Subprocess::Options options;
  options.argv = {RunfilePath("daemon/rdma-agentd"), "--runtime_dir=" + *dir,
                  "--backends=memory", "--peer_listen=127.0.0.1:0",
                  "--log_level=debug"};
  for (std::string& flag : extra_flags) options.argv.push_back(std::move(flag));
  options.pipe_stdio = true;
  options.stderr_to_stdout = true;
  absl::StatusOr<Subprocess> process = Subprocess::Spawn(std::move(options));
  if (!process.ok()) {
    RemoveTree(*dir);
    return process.status();
  }
  std::unique_ptr<AgentProcess> agent(
      new AgentProcess(*dir, log_path, std::move(*process)));

  // The daemon logs "serving unix://..." once both its sockets listen.
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    absl::StatusOr<std::string> line =
        agent->process_.ReadLine(deadline - absl::Now());
    if (!line.ok()) {
      return absl::Status(
          line.status().code(),
          absl::StrCat("rdma-agentd did not start: ", line.status().message(),
                       "\n", agent->Log()));
    }
    AppendLine(log_path, *line);
    if (absl::StrContains(*line, "serving unix://")) break;
  }
  agent->drain_ = std::thread([raw = agent.get()] { raw->DrainOutput(); });
  return agent;
}

void AgentProcess::DrainOutput() {
  // Ends at end of output, i.e. once the daemon has exited.
  for (;;) {
    absl::StatusOr<std::string> line = process_.ReadLine(absl::Seconds(1));
    if (line.ok()) {
      AppendLine(log_path_, *line);
    } else if (!absl::IsDeadlineExceeded(line.status())) {
      return;
    }
  }
}

AgentProcess::~AgentProcess() {
  process_.Signal(SIGKILL);
  (void)process_.Wait(absl::Seconds(30));
  if (drain_.joinable()) drain_.join();
  RemoveTree(runtime_dir_);
}

absl::StatusOr<int> AgentProcess::Stop(absl::Duration timeout) {
  process_.Signal(SIGTERM);
  return process_.Wait(timeout);
}

std::string AgentProcess::Log() const {
  std::ifstream in(log_path_);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace rdma_agent::testing
