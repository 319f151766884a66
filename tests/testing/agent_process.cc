#include "tests/testing/agent_process.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tests/testing/temp_dir.h"

namespace rdma_agent::testing {
namespace {

void AppendLine(const std::string& path, const std::string& line) {
  std::ofstream out(path, std::ios::app);
  out << line << "\n";
}

bool HasBackend(const std::string& backends, absl::string_view name) {
  for (absl::string_view backend : absl::StrSplit(backends, ',')) {
    if (backend == name) return true;
  }
  return false;
}

}  // namespace

AgentProcess::AgentProcess(Options options, std::string runtime_dir,
                           std::string log_path)
    : options_(std::move(options)),
      runtime_dir_(std::move(runtime_dir)),
      log_path_(std::move(log_path)) {}

absl::StatusOr<std::unique_ptr<AgentProcess>> AgentProcess::Start(
    Options options) {
  absl::StatusOr<std::string> dir = MakeShortTempDir();
  if (!dir.ok()) return dir.status();
  // The log outlives the runtime dir when bazel keeps test outputs.
  const char* outputs = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR");
  std::string log_path =
      absl::StrCat(outputs != nullptr ? outputs : *dir, "/rdma-agentd.",
                   dir->substr(dir->rfind('.') + 1), ".log");
  std::unique_ptr<AgentProcess> agent(
      new AgentProcess(std::move(options), *dir, std::move(log_path)));
  if (absl::Status status = agent->Launch(); !status.ok()) return status;
  return agent;
}

absl::Status AgentProcess::Launch() {
  const bool tcp = HasBackend(options_.backends, "tcp");
  Subprocess::Options spawn;
  if (!options_.netns.empty()) {
    spawn.argv = {"ip", "netns", "exec", options_.netns};
  }
  spawn.argv.insert(spawn.argv.end(), options_.wrapper.begin(),
                    options_.wrapper.end());
  spawn.argv.push_back(RunfilePath("daemon/rdma-agentd"));
  spawn.argv.push_back("--runtime_dir=" + runtime_dir_);
  // Never the host's /var/lib/rdma-agentd (tests run as root); apart from the
  // runtime dir, as under systemd.
  spawn.argv.push_back("--state_dir=" + state_dir());
  spawn.argv.push_back("--backends=" + options_.backends);
  if (tcp) {
    spawn.argv.push_back(absl::StrCat("--tcp_listen=", options_.listen_host,
                                      ":", options_.tcp_port));
  }
  spawn.argv.push_back(
      absl::StrCat("--peer_listen=", options_.listen_host, ":0"));
  if (!options_.advertise_host.empty()) {
    spawn.argv.push_back("--advertise_host=" + options_.advertise_host);
  }
  spawn.argv.push_back("--log_level=" + options_.log_level);
  for (const std::string& flag : options_.extra_flags) {
    spawn.argv.push_back(flag);
  }
  spawn.pipe_stdio = true;
  spawn.stderr_to_stdout = true;
  absl::StatusOr<Subprocess> process = Subprocess::Spawn(std::move(spawn));
  if (!process.ok()) return process.status();
  process_ = std::move(*process);

  // The daemon logs "serving unix://..." once both its sockets listen.
  const absl::Time deadline = absl::Now() + options_.start_timeout;
  absl::Status serving = process_->WaitForLine(
      "serving unix://", options_.start_timeout,
      [this](const std::string& line) { AppendLine(log_path_, line); });
  if (!serving.ok()) {
    return absl::Status(serving.code(),
                        absl::StrCat("rdma-agentd did not start: ",
                                     serving.message(), "\n", Log()));
  }
  drain_ = std::thread([this] { DrainOutput(); });

  // Until the start timeout: right after a restart the first connection
  // has been seen to end with "Broken pipe" although the agent serves.
  absl::StatusOr<std::unique_ptr<client::AgentClient>> connected;
  absl::StatusOr<::rdma::agent::v1::AgentInfo> info;
  for (;;) {
    client::ConnectOptions connect;
    connect.target = target();
    connect.connect_timeout =
        std::max(deadline - absl::Now(), absl::Milliseconds(1));
    connected = client::AgentClient::Connect(connect);
    if (!connected.ok()) {
      return absl::Status(
          connected.status().code(),
          absl::StrCat("cannot connect to rdma-agentd: ",
                       connected.status().message(), "\n", Log()));
    }
    info = (*connected)->GetInfo();
    if (info.ok() || info.status().code() != absl::StatusCode::kUnavailable ||
        absl::Now() >= deadline) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  if (!info.ok()) {
    return absl::Status(info.status().code(),
                        absl::StrCat("rdma-agentd does not answer GetInfo: ",
                                     info.status().message(), "\n", Log()));
  }
  if (tcp) {
    // Learn the bound data port so that a restart can reuse it.
    for (const auto& backend : info->backends()) {
      if (backend.name() != "tcp" ||
          backend.transport_info().addresses_size() == 0) {
        continue;
      }
      const std::string& address = backend.transport_info().addresses(0);
      uint32_t port = 0;
      if (absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port)) {
        options_.tcp_port = static_cast<uint16_t>(port);
      }
    }
    if (options_.tcp_port == 0) {
      return absl::InternalError(absl::StrCat(
          "rdma-agentd reports no tcp backend: ", info->DebugString()));
    }
  }
  client_ = std::move(*connected);
  return absl::OkStatus();
}

void AgentProcess::DrainOutput() {
  // Ends at end of output, i.e. once the daemon has exited.
  for (;;) {
    absl::StatusOr<std::string> line = process_->ReadLine(absl::Seconds(1));
    if (line.ok()) {
      AppendLine(log_path_, *line);
    } else if (!absl::IsDeadlineExceeded(line.status())) {
      return;
    }
  }
}

void AgentProcess::Reap() {
  if (!process_) return;
  (void)process_->Wait(absl::Seconds(30));
  if (drain_.joinable()) drain_.join();
}

AgentProcess::~AgentProcess() {
  Kill();
  RemoveTree(runtime_dir_);
}

void AgentProcess::Kill() {
  client_.reset();
  if (!process_) return;
  process_->Signal(SIGKILL);
  held_ = false;
  Reap();
}

void AgentProcess::Hold() {
  if (!process_ || held_) return;
  process_->Signal(SIGSTOP);
  held_ = true;
}

void AgentProcess::Resume() {
  if (!process_ || !held_) return;
  process_->Signal(SIGCONT);
  held_ = false;
}

absl::Status AgentProcess::Restart() {
  Kill();
  return Launch();
}

absl::StatusOr<int> AgentProcess::Stop(int signal, absl::Duration timeout) {
  client_.reset();
  if (!process_)
    return absl::FailedPreconditionError("rdma-agentd not started");
  process_->Signal(signal);
  Resume();  // a held daemon takes the signal once it runs
  absl::StatusOr<int> code = process_->Wait(timeout);
  if (code.ok() && drain_.joinable()) drain_.join();
  return code;
}

absl::StatusOr<std::unique_ptr<client::AgentClient>> AgentProcess::NewClient()
    const {
  client::ConnectOptions connect;
  connect.target = target();
  return client::AgentClient::Connect(connect);
}

std::string AgentProcess::Log() const {
  std::ifstream in(log_path_);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

AgentProcess::Options TcpAgentOptions(const std::string& host,
                                      const std::string& netns,
                                      std::vector<std::string> extra_flags) {
  AgentProcess::Options options;
  options.backends = "memory,tcp";
  options.netns = netns;
  options.listen_host = host;
  options.advertise_host = host;
  options.log_level = "info";
  options.extra_flags = std::move(extra_flags);
  return options;
}

}  // namespace rdma_agent::testing
