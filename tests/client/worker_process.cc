#include "tests/client/worker_process.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace rdma_agent::testing {

absl::StatusOr<WorkerProcess> WorkerProcess::Start(const AgentProcess& agent,
                                                   Options options) {
  return Start(agent.target(), agent.attach_socket_path(), options);
}

absl::StatusOr<WorkerProcess> WorkerProcess::Start(
    const std::string& target, const std::string& attach_socket,
    Options options) {
  Subprocess::Options spawn;
  spawn.argv = {RunfilePath("tests/client/client_worker"), "--target=" + target,
                "--attach_socket=" + attach_socket};
  if (options.uid >= 0)
    spawn.argv.push_back(absl::StrCat("--uid=", options.uid));
  if (options.gid >= 0)
    spawn.argv.push_back(absl::StrCat("--gid=", options.gid));
  spawn.pipe_stdio = true;
  absl::StatusOr<Subprocess> process = Subprocess::Spawn(std::move(spawn));
  if (!process.ok()) return process.status();
  WorkerProcess worker(std::move(*process));
  absl::StatusOr<std::string> ready =
      worker.process_.ReadLine(absl::Seconds(30));
  if (!ready.ok()) return ready.status();
  if (!absl::StartsWith(*ready, "ready ")) {
    return absl::InternalError(absl::StrCat("worker did not start: ", *ready));
  }
  return worker;
}

absl::StatusOr<std::string> WorkerProcess::Call(absl::string_view command,
                                                absl::Duration timeout) {
  absl::Status written = process_.WriteLine(command);
  if (!written.ok()) return written;
  return process_.ReadLine(timeout);
}

std::string WorkerProcess::Answer(absl::string_view command,
                                  absl::Duration timeout) {
  absl::StatusOr<std::string> line = Call(command, timeout);
  if (!line.ok())
    return absl::StrCat("<transport error: ", line.status().ToString(), ">");
  return *line;
}

absl::StatusOr<std::vector<std::string>> WorkerProcess::CallWords(
    absl::string_view command, absl::Duration timeout) {
  absl::StatusOr<std::string> line = Call(command, timeout);
  if (!line.ok()) return line.status();
  return std::vector<std::string>(absl::StrSplit(*line, ' '));
}

absl::StatusOr<WorkerBuffer> ParseRegistered(
    const std::vector<std::string>& words) {
  if (words.size() < 3 || words[0] != "ok") {
    return absl::InternalError(
        absl::StrCat("registration failed: ", absl::StrJoin(words, " ")));
  }
  return WorkerBuffer{words[1], words[2]};
}

}  // namespace rdma_agent::testing
