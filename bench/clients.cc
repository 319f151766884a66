#include "bench/clients.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/agent_ops.h"
#include "client/rdma_agent_client.h"
#include "common/unique_fd.h"

namespace rdma_agent::bench {
namespace {

using client::AgentClient;

// Runs the child's part after setup; reports on stdout.
absl::Status ChildRun(const ClientChildOptions& options) {
  client::ConnectOptions local_options;
  local_options.target = options.local;
  client::ConnectOptions remote_options;
  remote_options.target = options.remote;
  auto local_agent = AgentClient::Connect(local_options);
  if (!local_agent.ok()) return local_agent.status();
  auto remote_agent = AgentClient::Connect(remote_options);
  if (!remote_agent.ok()) return remote_agent.status();
  const uint64_t bytes = options.op_bytes * options.batch;
  auto local = (*local_agent)->Attach(bytes, v1::ACCESS_READ_WRITE, "bench");
  if (!local.ok()) return local.status();
  auto remote = (*remote_agent)->Attach(bytes, v1::ACCESS_READ_WRITE, "bench");
  if (!remote.ok()) return remote.status();
  for (uint64_t i = 0; i < bytes; i += 4096) {
    local->data()[i] = std::byte{1};
    remote->data()[i] = std::byte{2};
  }
  const auto ops = MakeOps(v1::OP_TYPE_WRITE_FROM_LOCAL, local->id(),
                           remote->remote_context(), options.op_bytes,
                           options.batch, bytes, bytes);
  if (absl::Status s = RunBatch(**local_agent, ops, "tcp"); !s.ok()) return s;
  std::cout << "ready" << std::endl;
  std::string go;
  if (!std::getline(std::cin, go) || go != "go") {
    return absl::AbortedError("no go from the parent");
  }
  auto timed = RunFor(options.duration, 1,
                      [&] { return RunBatch(**local_agent, ops, "tcp"); });
  if (!timed.ok()) return timed.status();
  std::cout << "result ops=" << timed->steps * options.batch
            << " seconds=" << absl::ToDoubleSeconds(timed->elapsed)
            << std::endl;
  return absl::OkStatus();
}

struct Child {
  pid_t pid = -1;
  UniqueFd to;    // its stdin
  UniqueFd from;  // its stdout
  std::string pending;
};

absl::StatusOr<Child> StartChild(const std::vector<std::string>& args) {
  int to[2], from[2];
  if (pipe2(to, O_CLOEXEC) != 0) return absl::InternalError("pipe");
  if (pipe2(from, O_CLOEXEC) != 0) {
    close(to[0]);
    close(to[1]);
    return absl::InternalError("pipe");
  }
  std::vector<char*> argv;
  static char self[] = "/proc/self/exe";
  argv.push_back(self);
  for (const std::string& arg : args)
    argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    // Only async-signal-safe calls until exec.
    dup2(to[0], STDIN_FILENO);
    dup2(from[1], STDOUT_FILENO);
    execv(self, argv.data());
    _exit(127);
  }
  close(to[0]);
  close(from[1]);
  Child child;
  child.to.reset(to[1]);
  child.from.reset(from[0]);
  if (pid < 0)
    return absl::InternalError(absl::StrCat("fork: ", strerror(errno)));
  child.pid = pid;
  return child;
}

// The child's next line, waiting at most until `deadline`.
absl::StatusOr<std::string> ReadLine(Child& child, absl::Time deadline) {
  for (;;) {
    if (size_t end = child.pending.find('\n'); end != std::string::npos) {
      std::string line = child.pending.substr(0, end);
      child.pending.erase(0, end + 1);
      return line;
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError("client child is silent");
    }
    pollfd fd{child.from.get(), POLLIN, 0};
    const int ready = poll(&fd, 1, absl::ToInt64Milliseconds(left) + 1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;
    char buffer[256];
    const ssize_t n = read(child.from.get(), buffer, sizeof(buffer));
    if (n <= 0) return absl::UnavailableError("client child exited");
    child.pending.append(buffer, n);
  }
}

absl::StatusOr<double> ParseResult(const std::string& line) {
  double ops = 0, seconds = 0;
  for (absl::string_view field : absl::StrSplit(line, ' ')) {
    if (absl::ConsumePrefix(&field, "ops="))
      (void)absl::SimpleAtod(field, &ops);
    if (absl::ConsumePrefix(&field, "seconds=")) {
      (void)absl::SimpleAtod(field, &seconds);
    }
  }
  if (!absl::StartsWith(line, "result ") || seconds <= 0) {
    return absl::InternalError(absl::StrCat("client child: ", line));
  }
  return ops / seconds;
}

absl::StatusOr<ClientRates> Drive(std::vector<Child>& children,
                                  absl::Duration timeout) {
  for (Child& child : children) {
    auto line = ReadLine(child, absl::Now() + timeout);
    if (!line.ok()) return line.status();
    if (*line != "ready") {
      return absl::InternalError(absl::StrCat("client child: ", *line));
    }
  }
  for (Child& child : children) {
    if (write(child.to.get(), "go\n", 3) != 3) {
      return absl::InternalError("cannot start a client child");
    }
  }
  ClientRates rates;
  for (Child& child : children) {
    auto line = ReadLine(child, absl::Now() + timeout);
    if (!line.ok()) return line.status();
    auto rate = ParseResult(*line);
    if (!rate.ok()) return rate.status();
    rates.ops_per_second.push_back(*rate);
  }
  return rates;
}

}  // namespace

int RunClientChild(const ClientChildOptions& options) {
  if (absl::Status status = ChildRun(options); !status.ok()) {
    std::cout << "error " << status << std::endl;
    return 1;
  }
  return 0;
}

absl::StatusOr<ClientRates> RunClients(
    int count, const std::vector<std::string>& child_args,
    absl::Duration timeout) {
  std::vector<Child> children;
  absl::StatusOr<ClientRates> rates = ClientRates{};
  for (int i = 0; i < count; ++i) {
    auto child = StartChild(child_args);
    if (!child.ok()) {
      rates = child.status();
      break;
    }
    children.push_back(std::move(*child));
  }
  if (rates.ok()) rates = Drive(children, timeout);
  for (Child& child : children) {
    if (!rates.ok()) kill(child.pid, SIGKILL);
    child.to.reset();
    int status = 0;
    while (waitpid(child.pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
  return rates;
}

}  // namespace rdma_agent::bench
