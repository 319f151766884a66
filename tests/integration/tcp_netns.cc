#include "tests/integration/tcp_netns.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/match.h"

namespace rdma_agent::testing {
namespace {

constexpr char kNetnsPrefix[] = "ratcp";

std::string RunfilePath(const std::string& relative) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir != nullptr) {
    return absl::StrCat(srcdir, "/", workspace ? workspace : "__main__", "/",
                        relative);
  }
  return relative;  // run by hand from bazel-bin
}

// Waits for `pid` to exit within `timeout`; its exit status, or -1.
int WaitExit(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  // Bounded: one waitpid per millisecond until the deadline.
  while (true) {
    int status = 0;
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) return status;
    if (done < 0) return -1;
    if (absl::Now() >= deadline) return -1;
    absl::SleepFor(absl::Milliseconds(1));
  }
}

// fork+exec `argv` with stdout/stderr into `output_fd` (or /dev/null).
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv,
                            int output_fd) {
  std::vector<char*> args;
  for (const auto& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    const int null = open("/dev/null", O_RDWR);
    dup2(null, 0);
    dup2(output_fd >= 0 ? output_fd : null, 1);
    dup2(output_fd >= 0 ? output_fd : null, 2);
    // The child must not outlive a crashed test (spawned from the test's
    // main thread, whose exit is the process's).
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    execvp(args[0], args.data());
    _exit(127);
  }
  return pid;
}

bool ProcessAlive(pid_t pid) { return kill(pid, 0) == 0 || errno == EPERM; }

// Deletes namespaces of earlier test processes that died before cleaning up.
void SweepStaleNamespaces() {
  auto list = RunCommand({"ip", "netns", "list"});
  if (!list.ok()) return;
  for (absl::string_view line : absl::StrSplit(*list, '\n')) {
    const std::string name(line.substr(0, line.find(' ')));
    if (!absl::StartsWith(name, kNetnsPrefix)) continue;
    // ratcp<pid>x<n><side>
    const std::string rest = name.substr(strlen(kNetnsPrefix));
    int pid = 0;
    if (!absl::SimpleAtoi(rest.substr(0, rest.find('x')), &pid)) continue;
    if (pid > 0 && !ProcessAlive(pid)) {
      (void)RunCommand({"ip", "netns", "delete", name});
    }
  }
}

}  // namespace

absl::Status CheckNetnsPrivileges() {
  if (geteuid() != 0) {
    return absl::FailedPreconditionError(
        "cross-host tcp tests need root (network namespaces and veth pairs); "
        "run them as root, e.g. in CI: sudo bazel test //tests/integration/...");
  }
  auto version = RunCommand({"ip", "-V"});
  if (!version.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the `ip` tool (iproute2) is needed: ", version.status().message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> RunCommand(const std::vector<std::string>& argv,
                                       absl::Duration timeout) {
  char path[] = "/tmp/ratcp-cmd.XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("mkstemp: ", std::strerror(errno)));
  }
  unlink(path);
  auto pid = Spawn(argv, fd);
  if (!pid.ok()) {
    close(fd);
    return pid.status();
  }
  const int status = WaitExit(*pid, timeout);
  if (status == -1) {
    kill(*pid, SIGKILL);
    waitpid(*pid, nullptr, 0);
  }
  std::string output;
  lseek(fd, 0, SEEK_SET);
  char buffer[4096];
  for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) {
    output.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(absl::StrCat(
        "`", absl::StrJoin(argv, " "), "` failed (status ", status, "): ",
        output));
  }
  return output;
}

absl::StatusOr<std::unique_ptr<NetnsPair>> NetnsPair::Create() {
  if (absl::Status status = CheckNetnsPrivileges(); !status.ok()) {
    return status;
  }
  SweepStaleNamespaces();
  static std::atomic<int> counter{0};
  const int n = counter.fetch_add(1);
  const std::string stem = absl::StrCat(kNetnsPrefix, getpid(), "x", n);
  std::unique_ptr<NetnsPair> pair(new NetnsPair());
  const char* const sides[2] = {"a", "b"};
  for (int side = 0; side < 2; ++side) {
    pair->netns_[side] = absl::StrCat(stem, sides[side]);
    // Interface names are at most 15 characters: keep them short.
    pair->link_[side] = absl::StrCat("v", getpid() % 1000000, "x",
                                     n % 100, sides[side]);
    pair->address_[side] = absl::StrCat("10.77.0.", side + 1);
  }
  for (int side = 0; side < 2; ++side) {
    auto made = RunCommand({"ip", "netns", "add", pair->netns_[side]});
    if (!made.ok()) return made.status();
    pair->created_[side] = true;
  }
  const std::vector<std::vector<std::string>> setup = {
      {"ip", "link", "add", pair->link_[0], "netns", pair->netns_[0], "type",
       "veth", "peer", "name", pair->link_[1], "netns", pair->netns_[1]},
  };
  for (const auto& command : setup) {
    if (auto done = RunCommand(command); !done.ok()) return done.status();
  }
  for (int side = 0; side < 2; ++side) {
    const std::string& ns = pair->netns_[side];
    for (const std::vector<std::string>& command :
         std::vector<std::vector<std::string>>{
             {"ip", "-n", ns, "link", "set", "lo", "up"},
             {"ip", "-n", ns, "addr", "add", pair->address_[side] + "/24",
              "dev", pair->link_[side]},
             {"ip", "-n", ns, "link", "set", pair->link_[side], "up"}}) {
      if (auto done = RunCommand(command); !done.ok()) return done.status();
    }
  }
  return pair;
}

NetnsPair::~NetnsPair() {
  for (int side = 0; side < 2; ++side) {
    if (created_[side]) (void)RunCommand({"ip", "netns", "delete", netns_[side]});
  }
}

absl::Status NetnsPair::SetLink(int side, bool up) {
  auto done = RunCommand({"ip", "-n", netns_[side], "link", "set", link_[side],
                          up ? "up" : "down"});
  return done.status();
}

absl::Status NetnsPair::PinNeighbour(int side) {
  const int other = 1 - side;
  auto shown = RunCommand({"ip", "-n", netns_[other], "-o", "link", "show",
                           link_[other]});
  if (!shown.ok()) return shown.status();
  const size_t at = shown->find("link/ether ");
  if (at == std::string::npos) {
    return absl::InternalError(absl::StrCat("no MAC in: ", *shown));
  }
  const std::string mac = shown->substr(at + 11, 17);
  return RunCommand({"ip", "-n", netns_[side], "neigh", "replace",
                     address_[other], "lladdr", mac, "dev", link_[side], "nud",
                     "permanent"})
      .status();
}

absl::StatusOr<std::unique_ptr<TcpAgentProcess>> TcpAgentProcess::Start(
    Options options) {
  char dir[] = "/tmp/ratcp.XXXXXX";
  if (mkdtemp(dir) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: ", std::strerror(errno)));
  }
  std::unique_ptr<TcpAgentProcess> agent(
      new TcpAgentProcess(std::move(options), dir));
  if (absl::Status status = agent->Launch(); !status.ok()) return status;
  return agent;
}

absl::Status TcpAgentProcess::Launch() {
  std::vector<std::string> argv;
  if (!options_.netns.empty()) {
    argv = {"ip", "netns", "exec", options_.netns};
  }
  const std::string& host = options_.host;
  for (std::string arg :
       {RunfilePath("daemon/rdma-agentd"), "--runtime_dir=" + runtime_dir_,
        std::string("--backends=memory,tcp"),
        absl::StrCat("--tcp_listen=", host, ":", options_.tcp_port),
        absl::StrCat("--peer_listen=", host, ":0"),
        "--advertise_host=" + host, std::string("--log_level=info")}) {
    argv.push_back(std::move(arg));
  }
  for (const auto& flag : options_.extra_flags) argv.push_back(flag);

  const std::string log = runtime_dir_ + "/agentd.log";
  const int log_fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC,
                          0644);
  if (log_fd < 0) {
    return absl::InternalError(absl::StrCat("open ", log, ": ",
                                            std::strerror(errno)));
  }
  auto pid = Spawn(argv, log_fd);
  close(log_fd);
  if (!pid.ok()) return pid.status();
  pid_ = *pid;

  // Ready once it answers GetInfo; bounded by 30 s, and an early exit of the
  // daemon ends the wait at once.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  absl::Status last = absl::UnavailableError("not started");
  while (absl::Now() < deadline) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::InternalError(
          absl::StrCat("rdma-agentd exited (status ", status, "): ", Log()));
    }
    client::ConnectOptions connect;
    connect.target = target();
    connect.connect_timeout = absl::Milliseconds(200);
    auto connected = client::AgentClient::Connect(connect);
    if (connected.ok()) {
      auto info = (*connected)->GetInfo();
      if (info.ok()) {
        client_ = std::move(*connected);
        // Learn the bound data port so a restart can reuse it.
        for (const auto& backend : info->backends()) {
          if (backend.name() != "tcp" ||
              backend.transport_info().addresses_size() == 0) {
            continue;
          }
          const std::string& address = backend.transport_info().addresses(0);
          uint32_t port = 0;
          if (absl::SimpleAtoi(address.substr(address.rfind(':') + 1),
                               &port)) {
            options_.tcp_port = static_cast<uint16_t>(port);
          }
        }
        if (options_.tcp_port == 0) {
          return absl::InternalError(absl::StrCat(
              "rdma-agentd reports no tcp backend: ", info->DebugString()));
        }
        return absl::OkStatus();
      }
      last = info.status();
    } else {
      last = connected.status();
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "rdma-agentd did not answer within 30 s (", last.message(), "): ",
      Log()));
}

void TcpAgentProcess::Kill() {
  client_.reset();
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
}

absl::Status TcpAgentProcess::Restart() {
  Kill();
  return Launch();
}

TcpAgentProcess::~TcpAgentProcess() {
  Kill();
  std::error_code ignored;
  std::filesystem::remove_all(runtime_dir_, ignored);
}

absl::StatusOr<std::unique_ptr<client::AgentClient>>
TcpAgentProcess::NewClient() const {
  client::ConnectOptions connect;
  connect.target = target();
  return client::AgentClient::Connect(connect);
}

std::string TcpAgentProcess::Log() const {
  std::ifstream in(runtime_dir_ + "/agentd.log");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

namespace {
inline uint8_t PatternByte(uint64_t position, uint8_t seed) {
  return static_cast<uint8_t>(position * 7 + (position >> 8) * 31 +
                              (position >> 16) * 13 + seed * 101);
}
}  // namespace

void FillPattern(std::byte* data, uint64_t size, uint64_t start, uint8_t seed) {
  for (uint64_t i = 0; i < size; ++i) {
    data[i] = static_cast<std::byte>(PatternByte(start + i, seed));
  }
}

int64_t FindPatternMismatch(const std::byte* data, uint64_t size,
                            uint64_t start, uint8_t seed) {
  for (uint64_t i = 0; i < size; ++i) {
    if (std::to_integer<uint8_t>(data[i]) != PatternByte(start + i, seed)) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

}  // namespace rdma_agent::testing
