#include "tests/testing/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace rdma_agent::testing {
namespace {

absl::Status ErrnoStatus(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

int PollTimeoutMs(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(
      std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 60000));
}

// argv[0] as a path to exec: as given when it holds a '/', else the first
// executable of that name in PATH. Looked up before fork, because after it
// only async-signal-safe calls may run.
absl::StatusOr<std::string> ResolveExecutable(const std::string& name) {
  if (absl::StrContains(name, '/')) return name;
  const char* path = std::getenv("PATH");
  for (absl::string_view dir :
       absl::StrSplit(path != nullptr ? path : "/usr/sbin:/usr/bin:/sbin:/bin",
                      ':', absl::SkipEmpty())) {
    std::string candidate = absl::StrCat(dir, "/", name);
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return absl::NotFoundError(absl::StrCat(name, " not found in PATH"));
}

// This process's environment with `overrides` ("NAME=value") set.
std::vector<std::string> ChildEnvironment(
    const std::vector<std::string>& overrides) {
  auto name = [](absl::string_view entry) {
    return entry.substr(0, entry.find('='));
  };
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const bool overridden = std::any_of(
        overrides.begin(), overrides.end(),
        [&](const std::string& o) { return name(o) == name(*entry); });
    if (!overridden) env.emplace_back(*entry);
  }
  env.insert(env.end(), overrides.begin(), overrides.end());
  return env;
}

std::vector<char*> NullTerminated(std::vector<std::string>& strings) {
  std::vector<char*> raw;
  for (std::string& s : strings) raw.push_back(s.data());
  raw.push_back(nullptr);
  return raw;
}

// Forks a child that execs `argv` with `stdin_fd`, `stdout_fd` and
// `stderr_fd` (-1: inherited) as its standard streams and `env` set in its
// environment; the child is killed when the calling thread ends. Returns the
// child's pid.
absl::StatusOr<pid_t> ForkExec(const std::vector<std::string>& argv,
                               int stdin_fd, int stdout_fd, int stderr_fd,
                               const std::vector<std::string>& env = {}) {
  if (argv.empty()) return absl::InvalidArgumentError("empty argv");
  absl::StatusOr<std::string> executable = ResolveExecutable(argv[0]);
  if (!executable.ok()) return executable.status();
  // Everything the child needs is prepared before fork: after it, only
  // async-signal-safe calls (the parent has threads).
  std::vector<std::string> args = argv;
  std::vector<char*> raw = NullTerminated(args);
  std::vector<std::string> environment = ChildEnvironment(env);
  std::vector<char*> raw_environment = NullTerminated(environment);
  const pid_t parent = ::getpid();

  const pid_t pid = ::fork();
  if (pid < 0) return ErrnoStatus("fork");
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    if (stdin_fd >= 0) ::dup2(stdin_fd, STDIN_FILENO);
    if (stdout_fd >= 0) ::dup2(stdout_fd, STDOUT_FILENO);
    if (stderr_fd >= 0) ::dup2(stderr_fd, STDERR_FILENO);
    ::execve(executable->c_str(), raw.data(), raw_environment.data());
    ::_exit(127);
  }
  return pid;
}

}  // namespace

absl::StatusOr<Subprocess> Subprocess::Spawn(Options options) {
  int in_pipe[2] = {-1, -1};
  int out_pipe[2] = {-1, -1};
  if (options.pipe_stdio) {
    if (::pipe2(in_pipe, O_CLOEXEC) != 0) return ErrnoStatus("pipe2");
    if (::pipe2(out_pipe, O_CLOEXEC) != 0) {
      ::close(in_pipe[0]);
      ::close(in_pipe[1]);
      return ErrnoStatus("pipe2");
    }
  }
  UniqueFd child_in(in_pipe[0]), parent_in(in_pipe[1]);
  UniqueFd parent_out(out_pipe[0]), child_out(out_pipe[1]);
  UniqueFd log;
  if (!options.log_path.empty()) {
    log.reset(::open(options.log_path.c_str(),
                     O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
    if (!log) return ErrnoStatus(absl::StrCat("open ", options.log_path));
  }
  UniqueFd dev_null(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!dev_null) return ErrnoStatus("open /dev/null");

  const int stdin_fd = options.pipe_stdio ? child_in.get() : dev_null.get();
  int stdout_fd = -1;
  if (options.pipe_stdio) {
    stdout_fd = child_out.get();
  } else if (log) {
    stdout_fd = log.get();
  }
  int stderr_fd = -1;
  if (log) {
    stderr_fd = log.get();
  } else if (options.pipe_stdio && options.stderr_to_stdout) {
    stderr_fd = child_out.get();
  }
  absl::StatusOr<pid_t> pid =
      ForkExec(options.argv, stdin_fd, stdout_fd, stderr_fd, options.env);
  if (!pid.ok()) return pid.status();
  Subprocess process;
  process.pid_ = *pid;
  process.pidfd_.reset(static_cast<int>(::syscall(SYS_pidfd_open, *pid, 0)));
  if (!process.pidfd_) return ErrnoStatus("pidfd_open");
  process.stdin_ = std::move(parent_in);
  process.stdout_ = std::move(parent_out);
  return process;
}

Subprocess::Subprocess(Subprocess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      pidfd_(std::move(other.pidfd_)),
      stdin_(std::move(other.stdin_)),
      stdout_(std::move(other.stdout_)),
      buffered_(std::move(other.buffered_)),
      exit_code_(std::exchange(other.exit_code_, std::nullopt)) {}

Subprocess& Subprocess::operator=(Subprocess&& other) noexcept {
  if (this != &other) {
    KillAndReap();
    pid_ = std::exchange(other.pid_, -1);
    pidfd_ = std::move(other.pidfd_);
    stdin_ = std::move(other.stdin_);
    stdout_ = std::move(other.stdout_);
    buffered_ = std::move(other.buffered_);
    exit_code_ = std::exchange(other.exit_code_, std::nullopt);
  }
  return *this;
}

Subprocess::~Subprocess() { KillAndReap(); }

void Subprocess::KillAndReap() {
  if (pid_ > 0 && !exit_code_.has_value()) {
    ::kill(pid_, SIGKILL);
    int status;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
  pid_ = -1;
}

absl::Status Subprocess::WriteLine(absl::string_view line) {
  if (!stdin_) return absl::FailedPreconditionError("stdin is not a pipe");
  std::string data = absl::StrCat(line, "\n");
  absl::string_view left = data;
  while (!left.empty()) {
    const ssize_t n = ::write(stdin_.get(), left.data(), left.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus("write to child");
    left.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Subprocess::ReadLine(absl::Duration timeout) {
  if (!stdout_) return absl::FailedPreconditionError("stdout is not a pipe");
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    const size_t newline = buffered_.find('\n');
    if (newline != std::string::npos) {
      std::string line = buffered_.substr(0, newline);
      buffered_.erase(0, newline + 1);
      return line;
    }
    struct pollfd pfd = {stdout_.get(), POLLIN, 0};
    const int ready = ::poll(&pfd, 1, PollTimeoutMs(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return ErrnoStatus("poll");
    if (ready == 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("no line from child ", pid_, " within ",
                       absl::FormatDuration(timeout)));
    }
    char chunk[4096];
    const ssize_t n = ::read(stdout_.get(), chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus("read from child");
    if (n == 0) {
      return absl::UnavailableError(
          absl::StrCat("child ", pid_, " closed its output"));
    }
    buffered_.append(chunk, static_cast<size_t>(n));
  }
}

absl::Status Subprocess::WaitForLine(
    absl::string_view text, absl::Duration timeout,
    const std::function<void(const std::string&)>& on_line) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    absl::StatusOr<std::string> line = ReadLine(deadline - absl::Now());
    if (!line.ok()) {
      return absl::Status(line.status().code(),
                          absl::StrCat("waiting for \"", text,
                                       "\": ", line.status().message()));
    }
    if (on_line) on_line(*line);
    if (absl::StrContains(*line, text)) return absl::OkStatus();
  }
}

void Subprocess::Signal(int signal) {
  if (pid_ > 0 && !exit_code_.has_value()) ::kill(pid_, signal);
}

bool Subprocess::Running() {
  if (pid_ <= 0 || exit_code_.has_value()) return false;
  struct pollfd pfd = {pidfd_.get(), POLLIN, 0};
  return ::poll(&pfd, 1, 0) == 0;
}

absl::StatusOr<int> Subprocess::Wait(absl::Duration timeout) {
  if (exit_code_.has_value()) return *exit_code_;
  if (pid_ <= 0) return absl::FailedPreconditionError("no child");
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    struct pollfd pfd = {pidfd_.get(), POLLIN, 0};
    const int ready = ::poll(&pfd, 1, PollTimeoutMs(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return ErrnoStatus("poll pidfd");
    if (ready == 0) {
      return absl::DeadlineExceededError(absl::StrCat(
          "child ", pid_, " still runs after ", absl::FormatDuration(timeout)));
    }
    break;
  }
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0) {
    if (errno != EINTR) return ErrnoStatus("waitpid");
  }
  exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return *exit_code_;
}

absl::StatusOr<RunResult> RunToCompletion(const std::vector<std::string>& argv,
                                          absl::string_view input,
                                          absl::Duration timeout) {
  int in_pipe[2], out_pipe[2], err_pipe[2];
  if (::pipe2(in_pipe, O_CLOEXEC) != 0) return ErrnoStatus("pipe2");
  UniqueFd child_in(in_pipe[0]), parent_in(in_pipe[1]);
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) return ErrnoStatus("pipe2");
  UniqueFd parent_out(out_pipe[0]), child_out(out_pipe[1]);
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) return ErrnoStatus("pipe2");
  UniqueFd parent_err(err_pipe[0]), child_err(err_pipe[1]);

  absl::StatusOr<pid_t> spawned =
      ForkExec(argv, child_in.get(), child_out.get(), child_err.get());
  if (!spawned.ok()) return spawned.status();
  const pid_t pid = *spawned;
  child_in.reset();
  child_out.reset();
  child_err.reset();
  // Ignore SIGPIPE-worthy writes: a child that exits early must not kill us.
  ::signal(SIGPIPE, SIG_IGN);
  ::fcntl(parent_in.get(), F_SETFL, O_NONBLOCK);

  RunResult result;
  const absl::Time deadline = absl::Now() + timeout;
  absl::string_view to_write = input;
  if (to_write.empty()) parent_in.reset();
  bool timed_out = false;
  while (parent_out || parent_err) {
    struct pollfd pfds[3];
    int count = 0;
    int out_index = -1, err_index = -1, in_index = -1;
    if (parent_out) {
      out_index = count;
      pfds[count++] = {parent_out.get(), POLLIN, 0};
    }
    if (parent_err) {
      err_index = count;
      pfds[count++] = {parent_err.get(), POLLIN, 0};
    }
    if (parent_in) {
      in_index = count;
      pfds[count++] = {parent_in.get(), POLLOUT, 0};
    }
    const int ready = ::poll(pfds, count, PollTimeoutMs(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return ErrnoStatus("poll");
    if (ready == 0) {
      timed_out = true;
      break;
    }
    auto drain = [](UniqueFd& fd, std::string* into) {
      char chunk[65536];
      const ssize_t n = ::read(fd.get(), chunk, sizeof(chunk));
      if (n > 0) {
        into->append(chunk, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        fd.reset();
      }
    };
    if (out_index >= 0 && pfds[out_index].revents != 0) {
      drain(parent_out, &result.out);
    }
    if (err_index >= 0 && pfds[err_index].revents != 0) {
      drain(parent_err, &result.err);
    }
    if (in_index >= 0 && pfds[in_index].revents != 0) {
      const ssize_t n =
          ::write(parent_in.get(), to_write.data(), to_write.size());
      if (n > 0) {
        to_write.remove_prefix(static_cast<size_t>(n));
      } else if (n < 0 && errno != EINTR && errno != EAGAIN) {
        to_write = {};
      }
      if (to_write.empty()) parent_in.reset();
    }
  }
  if (timed_out) ::kill(pid, SIGKILL);
  // Output has ended, so the child has exited or is about to; a child that
  // closed its output but lingers is bounded by the deadline.
  UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  if (pidfd) {
    struct pollfd pfd = {pidfd.get(), POLLIN, 0};
    if (::poll(&pfd, 1, PollTimeoutMs(deadline)) == 0) {
      timed_out = true;
      ::kill(pid, SIGKILL);
    }
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) {
    return absl::DeadlineExceededError(absl::StrCat(
        argv[0], " did not finish within ", absl::FormatDuration(timeout),
        "; stderr so far: ", result.err));
  }
  result.exit_code =
      WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

absl::StatusOr<std::string> RunCommand(const std::vector<std::string>& argv,
                                       absl::Duration timeout) {
  absl::StatusOr<RunResult> result = RunToCompletion(argv, "", timeout);
  if (!result.ok()) return result.status();
  if (result->exit_code != 0) {
    return absl::InternalError(
        absl::StrCat("`", absl::StrJoin(argv, " "), "` failed (exit ",
                     result->exit_code, "): ", result->out, result->err));
  }
  return std::move(result->out);
}

std::string RunfilePath(absl::string_view path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  if (srcdir == nullptr) return std::string(path);
  const char* workspace = std::getenv("TEST_WORKSPACE");
  return absl::StrCat(
      srcdir, "/", workspace != nullptr ? workspace : "rdma_agentd", "/", path);
}

int64_t ProcessStatusBytes(pid_t pid, absl::string_view field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, field) || !absl::ConsumePrefix(&rest, ":"))
      continue;
    rest = absl::StripAsciiWhitespace(rest);
    absl::ConsumeSuffix(&rest, " kB");
    int64_t kib = 0;
    return absl::SimpleAtoi(rest, &kib) ? kib * 1024 : -1;
  }
  return -1;
}

}  // namespace rdma_agent::testing
