#ifndef RDMA_AGENTD_TESTS_TESTING_PROCESS_H_
#define RDMA_AGENTD_TESTS_TESTING_PROCESS_H_

// Real processes for tests: spawning, talking to, and running to completion.

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/unique_fd.h"

namespace rdma_agent::testing {

// A child process for tests: spawned with fork/exec, killed (SIGKILL) if the
// thread that spawned it ends (for a test: the test process dies) or the
// Subprocess is destroyed while it runs. Every wait takes a timeout.
class Subprocess {
 public:
  struct Options {
    // argv[0] is the executable: a path, or a bare name looked up in PATH.
    std::vector<std::string> argv;
    // Talk to the child through pipes on its stdin/stdout (WriteLine,
    // ReadLine). Otherwise its stdin is /dev/null.
    bool pipe_stdio = false;
    // Where the child's stdout (unless piped) and stderr go; empty: inherit.
    std::string log_path;
    // With pipe_stdio and no log_path: stderr goes into the stdout pipe too.
    bool stderr_to_stdout = false;
    // "NAME=value" entries set in the child's environment, on top of (and
    // replacing the same names in) this process's.
    std::vector<std::string> env;
  };

  // NOT_FOUND when argv[0] is a bare name not found in PATH.
  static absl::StatusOr<Subprocess> Spawn(Options options);

  Subprocess(Subprocess&& other) noexcept;
  Subprocess& operator=(Subprocess&& other) noexcept;
  ~Subprocess();

  pid_t pid() const { return pid_; }

  // Writes `line` and a newline to the child's stdin.
  absl::Status WriteLine(absl::string_view line);
  // The next line (without its newline) of the child's stdout.
  // DEADLINE_EXCEEDED after `timeout`, UNAVAILABLE at end of output.
  absl::StatusOr<std::string> ReadLine(absl::Duration timeout);
  // Reads lines until one contains `text`, all within `timeout`; `on_line`
  // (when set) sees every line read, that one included. Fails as ReadLine
  // does (DEADLINE_EXCEEDED, or UNAVAILABLE when the output ends first).
  absl::Status WaitForLine(
      absl::string_view text, absl::Duration timeout,
      const std::function<void(const std::string&)>& on_line = nullptr);
  // Closes the child's stdin (it sees end of input).
  void CloseStdin() { stdin_.reset(); }

  // Sends `signal` to the child, if it still runs.
  void Signal(int signal);
  // Waits for the child to end: its exit code, or 128+signal if a signal
  // killed it. DEADLINE_EXCEEDED (and the child is left running) past
  // `timeout`.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  // True while the child has not ended (does not reap it).
  bool Running();

 private:
  Subprocess() = default;
  void KillAndReap();

  pid_t pid_ = -1;
  UniqueFd pidfd_;  // becomes readable when the child ends
  UniqueFd stdin_;
  UniqueFd stdout_;
  std::string buffered_;  // stdout read but not yet returned as lines
  std::optional<int> exit_code_;
};

// What RunToCompletion gives back.
struct RunResult {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

// Runs `argv` (argv[0] as in Subprocess::Options) to completion with `input`
// on its stdin, capturing stdout and stderr. DEADLINE_EXCEEDED (the child is
// killed) past `timeout`.
absl::StatusOr<RunResult> RunToCompletion(const std::vector<std::string>& argv,
                                          absl::string_view input,
                                          absl::Duration timeout);

// Runs a command (no shell, empty stdin) that must succeed: its stdout, or
// INTERNAL naming the command with its exit code and output when it exits
// non-zero; other failures as RunToCompletion.
absl::StatusOr<std::string> RunCommand(
    const std::vector<std::string>& argv,
    absl::Duration timeout = absl::Seconds(20));

// Path of a runfile of this workspace, e.g. "daemon/rdma-agentd"; outside
// `bazel test` (no TEST_SRCDIR), `path` itself, for runs by hand from the
// runfiles tree.
std::string RunfilePath(absl::string_view path);

// A size field of /proc/PID/status ("VmRSS", "VmHWM", "VmSize", ...) in
// bytes; -1 when the process or the field cannot be read.
int64_t ProcessStatusBytes(pid_t pid, absl::string_view field);

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_TESTING_PROCESS_H_
