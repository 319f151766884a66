// rdma-agentctl: talk to the host's rdma-agentd from a shell.
//
// Exit codes: 0 success; 1 the agent refused or an op failed; 2 bad usage;
// 3 a local file could not be read or written.

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "client/internal/context_text.h"
#include "client/rdma_agent_client.h"
#include "common/unique_fd.h"
#include "google/protobuf/text_format.h"

ABSL_FLAG(std::string, target, "unix:///run/rdma-agentd/agent.sock",
          "gRPC target of the agent");
ABSL_FLAG(std::string, attach_socket, "",
          "attach socket; empty: attach.sock next to the agent socket");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(30),
          "deadline of each RPC, and the op timeout of submit");
ABSL_FLAG(std::optional<uint64_t>, size, std::nullopt,
          "register: bytes to allocate");
ABSL_FLAG(std::string, access, "read_write",
          "register: read, write or read_write");
ABSL_FLAG(std::string, label, "", "register: label shown by list");
ABSL_FLAG(std::string, context_out, "",
          "register: also write the raw remote context to this file");
ABSL_FLAG(uint64_t, offset, 0, "write/read: offset in the buffer");
ABSL_FLAG(std::optional<uint64_t>, length, std::nullopt,
          "read/submit: bytes to move");
ABSL_FLAG(std::string, in, "-", "write: input file, - for stdin");
ABSL_FLAG(std::string, out, "-", "read: output file, - for stdout");
ABSL_FLAG(std::string, op, "",
          "submit: read (READ_INTO_LOCAL) or write (WRITE_FROM_LOCAL)");
ABSL_FLAG(std::optional<uint64_t>, local, std::nullopt,
          "submit: local buffer id");
ABSL_FLAG(uint64_t, local_offset, 0, "submit: offset in the local buffer");
ABSL_FLAG(uint64_t, remote_offset, 0, "submit: offset in the remote buffer");
ABSL_FLAG(std::string, context, "",
          "submit: remote context, base64 (as register prints it)");
ABSL_FLAG(std::string, context_file, "",
          "submit/decode: file holding the raw remote context");

namespace rdma_agent::client {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitLocalIo = 3;

constexpr char kUsage[] = R"(talks to the host's rdma-agentd.

usage: rdma-agentctl [--target=unix:///run/rdma-agentd/agent.sock] COMMAND ...

  info                                   agent id, epoch, version, backends
  register --size N [--access read|write|read_write] [--label L]
           [--context_out FILE]          agent-allocated buffer; prints its id
                                         and base64 remote context
  list                                   this user's buffers
  release ID                             drop a registration
  write ID [--offset O] [--in FILE|-]    bytes from a file (or stdin) into ID
  read ID [--offset O] --length L [--out FILE|-]
                                         bytes of ID to a file (or stdout)
  submit --op read|write --local ID [--local_offset O] --length L
         [--remote_offset R] (--context BASE64 | --context_file FILE)
                                         one one-sided op; prints its result
  decode (BASE64 | --context_file FILE)  print a remote context

exit codes: 0 ok, 1 the agent refused or an op failed, 2 bad usage,
3 a local file could not be read or written.)";

// What a command ends with: an exit code and, unless OK, why.
struct Outcome {
  int code = kExitOk;
  std::string message;
};

Outcome Ok() { return {}; }
Outcome Usage(absl::string_view message) {
  return {kExitUsage, std::string(message)};
}
Outcome Failed(absl::string_view what, const absl::Status& status) {
  return {kExitFailed,
          absl::StrCat(what, ": ", absl::StatusCodeToString(status.code()),
                       ": ", status.message())};
}
Outcome LocalIo(absl::string_view message) {
  return {kExitLocalIo, std::string(message)};
}

absl::StatusOr<std::string> ReadAll(const std::string& path) {
  UniqueFd owned;
  int fd = STDIN_FILENO;
  if (path != "-") {
    owned.reset(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!owned) {
      return absl::NotFoundError(
          absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
    }
    fd = owned.get();
  }
  std::string data;
  char chunk[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::InternalError(
          absl::StrCat("cannot read ", path, ": ", std::strerror(errno)));
    }
    if (n == 0) return data;
    data.append(chunk, static_cast<size_t>(n));
  }
}

absl::Status WriteAll(const std::string& path, absl::string_view data) {
  UniqueFd owned;
  int fd = STDOUT_FILENO;
  if (path != "-") {
    owned.reset(
        ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!owned) {
      return absl::InternalError(
          absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
    }
    fd = owned.get();
  }
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::InternalError(
          absl::StrCat("cannot write ", path, ": ", std::strerror(errno)));
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

std::optional<v1::Access> ParseAccess(absl::string_view text) {
  if (text == "read") return v1::ACCESS_READ;
  if (text == "write") return v1::ACCESS_WRITE;
  if (text == "read_write") return v1::ACCESS_READ_WRITE;
  return std::nullopt;
}

// A remote context from --context (base64), --context_file (raw bytes) or
// the positional argument (base64), exactly one of them.
absl::StatusOr<std::string> RemoteContextArgument(
    const std::vector<std::string>& args) {
  const std::string base64 = absl::GetFlag(FLAGS_context);
  const std::string file = absl::GetFlag(FLAGS_context_file);
  const int given = !base64.empty() + !file.empty() + !args.empty();
  if (given != 1) {
    return absl::InvalidArgumentError(
        "give the remote context exactly once: as base64 or with "
        "--context_file FILE");
  }
  if (!file.empty()) {
    absl::StatusOr<std::string> raw = ReadAll(file);
    if (!raw.ok()) return raw.status();
    if (raw->empty()) {
      return absl::InvalidArgumentError(absl::StrCat(file, " is empty"));
    }
    return raw;
  }
  return internal::DecodeBase64(base64.empty() ? args[0] : base64);
}

absl::StatusOr<uint64_t> BufferIdArgument(
    const std::vector<std::string>& args) {
  uint64_t id;
  if (args.size() != 1 || !absl::SimpleAtoi(args[0], &id)) {
    return absl::InvalidArgumentError("expected exactly one buffer ID");
  }
  return id;
}

// Connects on first use, so that usage errors are reported without an agent.
class LazyClient {
 public:
  absl::StatusOr<AgentClient*> Get() {
    if (client_ == nullptr) {
      ConnectOptions options;
      options.target = absl::GetFlag(FLAGS_target);
      options.attach_socket = absl::GetFlag(FLAGS_attach_socket);
      options.rpc_timeout = absl::GetFlag(FLAGS_timeout);
      options.connect_timeout = std::min(options.rpc_timeout, absl::Seconds(5));
      absl::StatusOr<std::unique_ptr<AgentClient>> client =
          AgentClient::Connect(options);
      if (!client.ok()) return client.status();
      client_ = std::move(*client);
    }
    return client_.get();
  }

 private:
  std::unique_ptr<AgentClient> client_;
};

Outcome Info(LazyClient& lazy, const std::vector<std::string>& args) {
  if (!args.empty()) return Usage("info takes no arguments");
  absl::StatusOr<AgentClient*> client = lazy.Get();
  if (!client.ok()) return Failed("connect", client.status());
  absl::StatusOr<v1::AgentInfo> info = (*client)->GetInfo();
  if (!info.ok()) return Failed("info", info.status());
  std::string text;
  google::protobuf::TextFormat::PrintToString(*info, &text);
  std::fputs(text.c_str(), stdout);
  return Ok();
}

Outcome Register(LazyClient& lazy, const std::vector<std::string>& args) {
  if (!args.empty()) return Usage("register takes no positional arguments");
  const std::optional<uint64_t> size = absl::GetFlag(FLAGS_size);
  if (!size.has_value()) return Usage("register needs --size N");
  const std::optional<v1::Access> access =
      ParseAccess(absl::GetFlag(FLAGS_access));
  if (!access.has_value()) {
    return Usage("--access must be read, write or read_write");
  }
  absl::StatusOr<AgentClient*> client = lazy.Get();
  if (!client.ok()) return Failed("connect", client.status());
  absl::StatusOr<Registration> registration =
      (*client)->AllocateUnmapped(*size, *access, absl::GetFlag(FLAGS_label));
  if (!registration.ok()) return Failed("register", registration.status());
  std::printf("buffer_id: %llu\nsize_bytes: %llu\nbackends: %s\ncontext: %s\n",
              static_cast<unsigned long long>(registration->id),
              static_cast<unsigned long long>(registration->size),
              absl::StrJoin(registration->backends, ",").c_str(),
              absl::Base64Escape(registration->remote_context).c_str());
  const std::string context_out = absl::GetFlag(FLAGS_context_out);
  if (!context_out.empty()) {
    absl::Status written = WriteAll(context_out, registration->remote_context);
    if (!written.ok()) {
      return LocalIo(absl::StrCat("register: buffer ", registration->id,
                                  " is registered, but ", written.message()));
    }
  }
  return Ok();
}

Outcome List(LazyClient& lazy, const std::vector<std::string>& args) {
  if (!args.empty()) return Usage("list takes no arguments");
  absl::StatusOr<AgentClient*> client = lazy.Get();
  if (!client.ok()) return Failed("connect", client.status());
  absl::StatusOr<std::vector<v1::BufferInfo>> buffers =
      (*client)->ListBuffers();
  if (!buffers.ok()) return Failed("list", buffers.status());
  std::printf("%-20s %14s %-18s %-9s %-20s %14s %14s %s\n", "ID", "SIZE",
              "ACCESS", "ALLOCATED", "BACKENDS", "MOVED", "SERVED", "LABEL");
  for (const v1::BufferInfo& buffer : *buffers) {
    std::printf("%-20llu %14llu %-18s %-9s %-20s %14llu %14llu %s\n",
                static_cast<unsigned long long>(buffer.buffer_id()),
                static_cast<unsigned long long>(buffer.size_bytes()),
                v1::Access_Name(buffer.access()).c_str(),
                buffer.agent_allocated() ? "agent" : "client",
                absl::StrJoin(buffer.backends(), ",").c_str(),
                static_cast<unsigned long long>(buffer.bytes_moved()),
                static_cast<unsigned long long>(buffer.bytes_served()),
                buffer.label().c_str());
  }
  return Ok();
}

Outcome Release(LazyClient& lazy, const std::vector<std::string>& args) {
  absl::StatusOr<uint64_t> id = BufferIdArgument(args);
  if (!id.ok()) return Usage(absl::StrCat("release: ", id.status().message()));
  absl::StatusOr<AgentClient*> client = lazy.Get();
  if (!client.ok()) return Failed("connect", client.status());
  absl::Status status = (*client)->Release(*id);
  if (!status.ok()) return Failed(absl::StrCat("release ", *id), status);
  return Ok();
}

Outcome Write(LazyClient& lazy, const std::vector<std::string>& args) {
  absl::StatusOr<uint64_t> id = BufferIdArgument(args);
  if (!id.ok()) return Usage(absl::StrCat("write: ", id.status().message()));
  absl::StatusOr<std::string> data = ReadAll(absl::GetFlag(FLAGS_in));
  if (!data.ok())
    return LocalIo(absl::StrCat("write: ", data.status().message()));
  const uint64_t offset = absl::GetFlag(FLAGS_offset);
  absl::StatusOr<AgentClient*> client = lazy.Get();
  if (!client.ok()) return Failed("connect", client.status());
  absl::Status status = (*client)->WriteBuffer(*id, offset, *data);
  if (!status.ok()) return Failed(absl::StrCat("write ", *id), status);
  std::fprintf(stderr, "wrote %zu bytes into buffer %llu at offset %llu\n",
               data->size(), static_cast<unsigned long long>(*id),
               static_cast<unsigned long long>(offset));
  return Ok();
}

Outcome Read(LazyClient& lazy, const std::vector<std::string>& args) {
  absl::StatusOr<uint64_t> id = BufferIdArgument(args);
  if (!id.ok()) return Usage(absl::StrCat("read: ", id.status().message()));
  const std::optional<uint64_t> length = absl::GetFlag(FLAGS_length);
  if (!length.has_value()) return Usage("read needs --length L");
  absl::StatusOr<AgentClient*> client = lazy.Get();
  if (!client.ok()) return Failed("connect", client.status());
  absl::StatusOr<std::string> data =
      (*client)->ReadBuffer(*id, absl::GetFlag(FLAGS_offset), *length);
  if (!data.ok()) return Failed(absl::StrCat("read ", *id), data.status());
  absl::Status written = WriteAll(absl::GetFlag(FLAGS_out), *data);
  if (!written.ok()) return LocalIo(absl::StrCat("read: ", written.message()));
  return Ok();
}

Outcome Submit(LazyClient& lazy, const std::vector<std::string>& args) {
  if (!args.empty()) return Usage("submit takes no positional arguments");
  OpSpec op;
  const std::string type = absl::GetFlag(FLAGS_op);
  if (type == "read") {
    op.type = v1::OP_TYPE_READ_INTO_LOCAL;
  } else if (type == "write") {
    op.type = v1::OP_TYPE_WRITE_FROM_LOCAL;
  } else {
    return Usage("submit needs --op read or --op write");
  }
  const std::optional<uint64_t> local = absl::GetFlag(FLAGS_local);
  if (!local.has_value()) return Usage("submit needs --local ID");
  const std::optional<uint64_t> length = absl::GetFlag(FLAGS_length);
  if (!length.has_value()) return Usage("submit needs --length L");
  absl::StatusOr<std::string> context = RemoteContextArgument({});
  if (!context.ok()) {
    return Usage(absl::StrCat("submit: ", context.status().message()));
  }
  op.local_buffer_id = *local;
  op.local_offset = absl::GetFlag(FLAGS_local_offset);
  op.length = *length;
  op.remote_context = *std::move(context);
  op.remote_offset = absl::GetFlag(FLAGS_remote_offset);
  absl::StatusOr<AgentClient*> client = lazy.Get();
  if (!client.ok()) return Failed("connect", client.status());
  absl::StatusOr<std::vector<OpResult>> results =
      (*client)->Submit({op}, absl::GetFlag(FLAGS_timeout));
  if (!results.ok()) return Failed("submit", results.status());
  bool all_ok = true;
  for (size_t i = 0; i < results->size(); ++i) {
    const OpResult& result = (*results)[i];
    all_ok = all_ok && result.status.ok();
    std::printf("op %zu: %s backend=%s%s%s\n", i,
                absl::StatusCodeToString(result.status.code()).c_str(),
                result.backend.empty() ? "-" : result.backend.c_str(),
                result.status.ok() ? "" : " message=",
                std::string(result.status.message()).c_str());
  }
  if (!all_ok) return {kExitFailed, "submit: an op failed"};
  return Ok();
}

Outcome Decode(const std::vector<std::string>& args) {
  if (args.size() > 1) return Usage("decode takes at most one argument");
  absl::StatusOr<std::string> context = RemoteContextArgument(args);
  if (!context.ok()) {
    return Usage(absl::StrCat("decode: ", context.status().message()));
  }
  absl::StatusOr<std::string> text = internal::RemoteContextToText(*context);
  if (!text.ok())
    return Usage(absl::StrCat("decode: ", text.status().message()));
  std::fputs(text->c_str(), stdout);
  return Ok();
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() < 2) {
    std::fprintf(stderr, "rdma-agentctl: no command given\n\n%s\n", kUsage);
    return kExitUsage;
  }
  const std::string command = positional[1];
  const std::vector<std::string> args(positional.begin() + 2, positional.end());

  using Command =
      std::function<Outcome(LazyClient&, const std::vector<std::string>&)>;
  const std::map<std::string, Command> commands = {
      {"info", Info},       {"register", Register}, {"list", List},
      {"release", Release}, {"write", Write},       {"read", Read},
      {"submit", Submit},
  };
  Outcome outcome;
  LazyClient lazy;
  if (command == "decode") {
    outcome = Decode(args);  // offline: needs no agent
  } else if (auto it = commands.find(command); it != commands.end()) {
    outcome = it->second(lazy, args);
  } else {
    outcome = Usage(absl::StrCat("unknown command '", command,
                                 "' (see rdma-agentctl --help)"));
  }
  if (outcome.code != kExitOk) {
    std::fprintf(stderr, "rdma-agentctl: %s\n", outcome.message.c_str());
  }
  return outcome.code;
}

}  // namespace
}  // namespace rdma_agent::client

int main(int argc, char** argv) { return rdma_agent::client::Main(argc, argv); }
