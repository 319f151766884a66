// rdma-agentctl: talk to the host's rdma-agentd from a shell.
//
// Every command has its own --help. Exit codes: 0 success; 1 the agent
// refused, an op failed or the agent is not serving; 2 bad usage; 3 a local
// file could not be read or written.

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/internal/cli_docs.h"
#include "client/internal/context_text.h"
#include "client/internal/conversions.h"
#include "client/internal/http_get.h"
#include "client/internal/progress.h"
#include "client/internal/units.h"
#include "client/rdma_agent_client.h"
#include "common/grpc_status.h"
#include "common/unique_fd.h"
#include "common/version.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "rdma/agent/v1/agent.grpc.pb.h"
#include "rdma/agent/v1/remote_buffer.pb.h"

namespace rdma_agent::client {
namespace {

namespace health = ::grpc::health::v1;

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitLocalIo = 3;

constexpr char kDescription[] =
    "Talks to the host's rdma-agentd.\n\n"
    "The agent is found from --target, else $RDMA_AGENT_SOCKET, else "
    "unix:///run/rdma-agentd/agent.sock; a bare socket path works too.\n"
    "Exit codes: 0 ok, 1 the agent refused or an op failed (for health, the "
    "agent is not serving; for wait, the transfer did not end DONE), 2 bad "
    "usage, 3 a local file could not be read or written.";

// What a command ends with: an exit code and, unless OK, why.
struct Outcome {
  int code = kExitOk;
  std::string message;
};

Outcome Ok() { return {}; }

// SIGINT and SIGTERM, blocked in this thread when `block`. Commands that run
// until interrupted block them before any thread exists (every thread then
// inherits the mask), so that the signals reach their sigtimedwait.
sigset_t StopSignals(bool block) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  if (block) pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}
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
// Bad usage (INVALID_ARGUMENT) or a local file that could not be read (any
// other code, from ReadAll).
Outcome UsageOrLocalIo(absl::string_view what, const absl::Status& status) {
  const std::string message = absl::StrCat(what, ": ", status.message());
  return status.code() == absl::StatusCode::kInvalidArgument ? Usage(message)
                                                             : LocalIo(message);
}

// Turns a size option's text ("4k", "1GiB") into its byte count before
// CLI11 converts it, so that negative or overflowing values are refused
// (exit 2, naming the option) instead of wrapping around.
CLI::Validator SizeValue() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        absl::StatusOr<uint64_t> bytes = internal::ParseByteSize(text);
        if (!bytes.ok()) return std::string(bytes.status().message());
        text = absl::StrCat(*bytes);
        return "";
      },
      "SIZE");
}

// An id option's text: digits only (no sign that would wrap around).
CLI::Validator IdValue() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        uint64_t id;
        return absl::SimpleAtoi(text, &id) && !absl::StartsWith(text, "-") &&
                       !absl::StartsWith(text, "+")
                   ? ""
                   : absl::StrCat(text, " is not an ID");
      },
      "ID");
}

// A duration option's text: seconds ("30", "2.5") or with a unit ("500ms").
CLI::Validator DurationValue(bool positive) {
  return CLI::Validator(
      [positive](std::string& text) -> std::string {
        absl::StatusOr<absl::Duration> value = internal::ParseDuration(text);
        if (!value.ok()) return std::string(value.status().message());
        if (positive && *value == absl::ZeroDuration()) {
          return absl::StrCat(text, " is not positive");
        }
        return "";
      },
      "DURATION");
}

// The bytes of file `path` ("-": stdin). Its errors are local I/O (exit 3),
// never INVALID_ARGUMENT, which the callers keep for bad usage (exit 2).
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
    const std::string& base64, const std::string& file,
    const std::vector<std::string>& args) {
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

// One or more buffer ids; all must parse before any is used.
absl::StatusOr<std::vector<uint64_t>> BufferIdsArgument(
    const std::vector<std::string>& args) {
  if (args.empty()) {
    return absl::InvalidArgumentError("expected one or more buffer IDs");
  }
  std::vector<uint64_t> ids;
  for (const std::string& arg : args) {
    uint64_t id;
    if (!absl::SimpleAtoi(arg, &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", arg, "' is not a buffer ID"));
    }
    ids.push_back(id);
  }
  return ids;
}

// Options every command shares.
struct Global {
  std::string target;
  std::string attach_socket;
  std::string timeout = "30s";
  std::string output = "text";
  bool progress = false;

  bool json() const { return output == "json"; }
  // A progress line for bytes this tool moves: on a TTY once the work runs
  // over a second, from the start with --progress, never with -o json.
  internal::ProgressLine Progress(uint64_t total) const {
    return internal::ProgressLine(total, !json() && ::isatty(STDERR_FILENO),
                                  progress && !json(), stderr);
  }
  // Checked by the option's validator.
  absl::Duration rpc_timeout() const {
    return internal::ParseDuration(timeout).value_or(absl::Seconds(30));
  }
};

// `message` as JSON (proto field names, every field), one object; on one
// line unless `indented`.
std::string ToJson(const google::protobuf::Message& message,
                   bool indented = true) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = indented;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

void Print(const Global& global, const google::protobuf::Message& message) {
  std::string text;
  if (global.json()) {
    text = ToJson(message);
  } else {
    google::protobuf::TextFormat::PrintToString(message, &text);
  }
  std::fputs(text.c_str(), stdout);
}

// Connects on first use, so that usage errors are reported without an agent.
class LazyClient {
 public:
  explicit LazyClient(const Global& global) : global_(global) {}

  absl::StatusOr<AgentClient*> Get() {
    if (client_ == nullptr) {
      ConnectOptions options;
      options.target = global_.target;
      options.attach_socket = global_.attach_socket;
      options.rpc_timeout = global_.rpc_timeout();
      options.connect_timeout = std::min(options.rpc_timeout, absl::Seconds(5));
      absl::StatusOr<std::unique_ptr<AgentClient>> client =
          AgentClient::Connect(options);
      if (!client.ok()) return client.status();
      client_ = std::move(*client);
    }
    return client_.get();
  }

 private:
  const Global& global_;
  std::unique_ptr<AgentClient> client_;
};

// One subcommand: its options (bound into the CLI11 parser) and its action.
class Command {
 public:
  virtual ~Command() = default;
  virtual Outcome Run(LazyClient& lazy, const Global& global) = 0;
};

// What a backend reaches and with what, on one line: its addresses, its
// devices ("mlx5_0:1 ACTIVE 4096B mlx5") and attributes ("key=value"); for
// an unavailable one, why.
std::string BackendDetails(const v1::BackendInfo& backend) {
  if (!backend.available()) return backend.unavailable_reason();
  const v1::TransportInfo& transport = backend.transport_info();
  std::vector<std::string> parts(transport.addresses().begin(),
                                 transport.addresses().end());
  for (const v1::DeviceInfo& device : transport.devices()) {
    parts.push_back(absl::StrCat(device.name(), ":", device.port(), " ",
                                 device.state(), " ", device.mtu_bytes(), "B ",
                                 device.profile()));
  }
  // Sorted: a proto map's order is not stable.
  const std::map<std::string, std::string> attributes(
      transport.attributes().begin(), transport.attributes().end());
  for (const auto& [key, value] : attributes) {
    parts.push_back(absl::StrCat(key, "=", value));
  }
  return absl::StrJoin(parts, ", ");
}

// GetInfo for people: "key: value" lines, then one line per backend.
void PrintInfoText(const v1::AgentInfo& info) {
  std::printf(
      "agent_id: %s\nhostname: %s\nversion: %s\nepoch: %llu\n"
      "metrics: %s\n",
      absl::CEscape(info.agent_id()).c_str(),
      absl::CEscape(info.hostname()).c_str(),
      absl::CEscape(info.version()).c_str(),
      static_cast<unsigned long long>(info.epoch()),
      info.metrics_address().empty()
          ? "none"
          : absl::CEscape(info.metrics_address()).c_str());
  std::vector<std::string> lines = {absl::StrFormat(
      "%-8s %-7s %-9s %s", "BACKEND", "LEVEL", "AVAILABLE", "DETAILS")};
  for (const v1::BackendInfo& backend : info.backends()) {
    absl::string_view level =
        v1::TransportLevel_Name(backend.transport_level());
    absl::ConsumePrefix(&level, "TRANSPORT_LEVEL_");
    lines.push_back(absl::StrFormat("%-8s %-7s %-9s %s",
                                    absl::CEscape(backend.name()), level,
                                    backend.available() ? "yes" : "no",
                                    absl::CEscape(BackendDetails(backend))));
  }
  for (const std::string& line : lines) {
    std::printf("%s\n",
                std::string(absl::StripTrailingAsciiWhitespace(line)).c_str());
  }
}

class InfoCommand : public Command {
 public:
  explicit InfoCommand(CLI::App& app) {
    app.add_subcommand("info",
                       "agent id, host, version, epoch and backends (-o json: "
                       "its AgentInfo)");
  }
  Outcome Run(LazyClient& lazy, const Global& global) override {
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    absl::StatusOr<v1::AgentInfo> info = (*client)->GetInfo();
    if (!info.ok()) return Failed("info", info.status());
    if (global.json()) {
      Print(global, *info);
    } else {
      PrintInfoText(*info);
    }
    return Ok();
  }
};

class AgentsCommand : public Command {
 public:
  explicit AgentsCommand(CLI::App& app) {
    app.add_subcommand("agents",
                       "the agents the agent's directory knows (--directory), "
                       "one line each: id, host, epoch, start time, backends "
                       "and their addresses");
  }
  Outcome Run(LazyClient& lazy, const Global& global) override {
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    absl::StatusOr<v1::ListAgentsResponse> agents = (*client)->ListAgents();
    if (!agents.ok()) return Failed("agents", agents.status());
    if (global.json()) {
      Print(global, *agents);
      return Ok();
    }
    std::printf("%-24s %-20s %-16s %-20s %s\n", "AGENT", "HOST", "EPOCH",
                "STARTED", "BACKENDS");
    for (const v1::AgentRecord& agent : agents->agents()) {
      std::vector<std::string> backends;
      for (const v1::BackendInfo& backend : agent.info().backends()) {
        if (!backend.available()) continue;
        std::vector<std::string> where(
            backend.transport_info().addresses().begin(),
            backend.transport_info().addresses().end());
        for (const v1::DeviceInfo& device :
             backend.transport_info().devices()) {
          where.push_back(absl::StrCat(device.name(), ":", device.port()));
        }
        backends.push_back(where.empty()
                               ? backend.name()
                               : absl::StrCat(backend.name(), "(",
                                              absl::StrJoin(where, ","), ")"));
      }
      const absl::Time started =
          absl::FromUnixSeconds(agent.start_time().seconds());
      std::printf(
          "%-24s %-20s %016llx %-20s %s\n", agent.info().agent_id().c_str(),
          agent.info().hostname().c_str(),
          static_cast<unsigned long long>(agent.info().epoch()),
          absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", started, absl::UTCTimeZone())
              .c_str(),
          absl::StrJoin(backends, " ").c_str());
    }
    if (agents->unreadable() > 0) {
      std::fprintf(stderr, "agents: %u unreadable records skipped\n",
                   agents->unreadable());
    }
    if (agents->truncated()) {
      std::fprintf(stderr,
                   "agents: more are published than the agent lists "
                   "(--directory_max_listed_agents)\n");
    }
    return Ok();
  }
};

// probe.sock next to the agent's socket `target` ("unix:///run/x/agent.sock"),
// when it is a socket this process may connect to.
std::optional<std::string> ProbeSocketNextTo(const std::string& target) {
  absl::string_view path = target;
  if (!absl::ConsumePrefix(&path, "unix://") &&
      !absl::ConsumePrefix(&path, "unix:")) {
    return std::nullopt;
  }
  const size_t slash = path.rfind('/');
  const std::string probe = absl::StrCat(
      slash == absl::string_view::npos ? "" : path.substr(0, slash + 1),
      "probe.sock");
  struct stat st;
  if (::stat(probe.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode) ||
      ::access(probe.c_str(), W_OK) != 0) {
    return std::nullopt;
  }
  return probe;
}

class HealthCommand : public Command {
 public:
  explicit HealthCommand(CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "health",
        "the agent's grpc.health.v1 status; exit 0 only when SERVING "
        "(for probes)");
    sub->add_option("--service", service_,
                    "service to check; empty: the agent as a whole");
  }
  Outcome Run(LazyClient& lazy, const Global& global) override {
    // The agent's probe socket when this user may connect to it (the
    // agent's own user, root): no other user's connections queue there.
    const std::optional<std::string> path =
        ProbeSocketNextTo(ResolveAgentTarget(global.target));
    Global probe = global;
    if (path.has_value()) probe.target = "unix://" + *path;
    LazyClient probe_client(probe);
    absl::StatusOr<AgentClient*> client =
        path.has_value() ? probe_client.Get() : lazy.Get();
    if (!client.ok()) return Failed("health", client.status());
    auto stub = health::Health::NewStub((*client)->channel());
    grpc::ClientContext context;
    context.set_deadline(
        absl::ToChronoTime(absl::Now() + global.rpc_timeout()));
    health::HealthCheckRequest request;
    request.set_service(service_);
    health::HealthCheckResponse response;
    const grpc::Status status = stub->Check(&context, request, &response);
    if (!status.ok()) {
      return Failed("health", FromGrpcStatus(status));
    }
    if (global.json()) {
      Print(global, response);
    } else {
      std::printf("%s\n", health::HealthCheckResponse::ServingStatus_Name(
                              response.status())
                              .c_str());
    }
    if (response.status() != health::HealthCheckResponse::SERVING) {
      return {kExitFailed, "health: the agent is not serving"};
    }
    return Ok();
  }

 private:
  std::string service_;
};

class MetricsCommand : public Command {
 public:
  explicit MetricsCommand(CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "metrics",
        "the agent's Prometheus metrics (text format), from the endpoint "
        "GetInfo names (rdma-agentd --metrics_listen)");
    sub->add_option("--address", address_,
                    "host:port of the endpoint; default: the one the agent "
                    "reports");
  }
  Outcome Run(LazyClient& lazy, const Global& global) override {
    std::string address = address_;
    if (address.empty()) {
      absl::StatusOr<AgentClient*> client = lazy.Get();
      if (!client.ok()) return Failed("connect", client.status());
      absl::StatusOr<v1::AgentInfo> info = (*client)->GetInfo();
      if (!info.ok()) return Failed("metrics", info.status());
      address = info->metrics_address();
      if (address.empty()) {
        return Failed("metrics",
                      absl::FailedPreconditionError(
                          "the agent serves no metrics (start it with "
                          "--metrics_listen=host:port)"));
      }
    }
    auto text = HttpGet(address, "/metrics", global.rpc_timeout());
    if (!text.ok()) return Failed("metrics", text.status());
    std::fputs(text->c_str(), stdout);
    return Ok();
  }

 private:
  std::string address_;
};

class RegisterCommand : public Command {
 public:
  explicit RegisterCommand(CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "register",
        "register an agent-allocated buffer; prints its id and base64 remote "
        "context");
    sub->add_option("--size", size_, "bytes to allocate (4096, 4k, 1GiB)")
        ->transform(SizeValue());
    sub->add_option("--access", access_, "read, write or read_write")
        ->capture_default_str();
    sub->add_option("--label", label_, "label shown by list");
    sub->add_option("--context_out", context_out_,
                    "also write the raw remote context to this file");
    sub->add_option("--name", name_,
                    "also publish it under this name in the agent's "
                    "directory (both or neither)");
    sub->add_flag("--any_user", any_user_,
                  "with --name: every user of the directory finds it; "
                  "default: only you");
  }
  Outcome Run(LazyClient& lazy, const Global& global) override {
    if (!size_.has_value()) return Usage("register needs --size N");
    const std::optional<v1::Access> access = ParseAccess(access_);
    if (!access.has_value()) {
      return Usage("--access must be read, write or read_write");
    }
    if (any_user_ && name_.empty()) return Usage("--any_user needs --name");
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    absl::StatusOr<Registration> registration =
        name_.empty() ? (*client)->AllocateUnmapped(*size_, *access, label_)
                      : RegisterNamed(**client, *access, global);
    if (!registration.ok()) return Failed("register", registration.status());
    if (global.json()) {
      v1::RegisterResponse response;
      response.set_buffer_id(registration->id);
      response.set_size_bytes(registration->size);
      response.set_remote_context(registration->remote_context);
      for (const std::string& name : registration->backends) {
        response.add_backends(name);
      }
      Print(global, response);
    } else {
      std::printf(
          "buffer_id: %llu\nsize_bytes: %llu\nbackends: %s\ncontext: %s\n",
          static_cast<unsigned long long>(registration->id),
          static_cast<unsigned long long>(registration->size),
          absl::StrJoin(registration->backends, ",").c_str(),
          absl::Base64Escape(registration->remote_context).c_str());
    }
    if (!context_out_.empty()) {
      absl::Status written =
          WriteAll(context_out_, registration->remote_context);
      if (!written.ok()) {
        return LocalIo(absl::StrCat("register: buffer ", registration->id,
                                    " is registered, but ", written.message()));
      }
    }
    return Ok();
  }

 private:
  // Register with a name, straight on the RdmaAgent service (LIFETIME_AGENT,
  // as AllocateUnmapped).
  absl::StatusOr<Registration> RegisterNamed(AgentClient& client,
                                             v1::Access access,
                                             const Global& global) const {
    auto stub = v1::RdmaAgent::NewStub(client.channel());
    grpc::ClientContext context;
    context.set_deadline(
        absl::ToChronoTime(absl::Now() + global.rpc_timeout()));
    v1::RegisterRequest request;
    request.set_allocate_bytes(*size_);
    request.set_access(access);
    request.set_label(label_);
    request.set_lifetime(v1::LIFETIME_AGENT);
    request.set_name(name_);
    request.set_name_visibility(any_user_ ? v1::VISIBILITY_ANY_USER
                                          : v1::VISIBILITY_OWNER);
    v1::RegisterResponse response;
    const grpc::Status status = stub->Register(&context, request, &response);
    if (!status.ok()) return FromGrpcStatus(status);
    Registration registration;
    registration.id = response.buffer_id();
    registration.size = response.size_bytes();
    registration.remote_context = response.remote_context();
    registration.backends.assign(response.backends().begin(),
                                 response.backends().end());
    registration.lifetime = response.lifetime();
    return registration;
  }

  std::optional<uint64_t> size_;
  std::string access_ = "read_write";
  std::string label_;
  std::string context_out_;
  std::string name_;
  bool any_user_ = false;
};

// A lifetime as the list shows it.
const char* LifetimeText(v1::Lifetime lifetime) {
  switch (lifetime) {
    case v1::LIFETIME_CLIENT_PROCESS:
      return "process";
    case v1::LIFETIME_CLIENT_CONNECTION:
      return "connection";
    default:
      return "agent";
  }
}

// Where a buffer's bytes live, as the list shows it: "host", or the device
// memory's kind and device ("cuda:0").
std::string MemoryText(const v1::BufferInfo& buffer) {
  switch (buffer.memory_kind()) {
    case v1::MEMORY_KIND_HOST:
      return "host";
    case v1::MEMORY_KIND_CUDA:
      return absl::StrCat("cuda:", buffer.device_index());
    case v1::MEMORY_KIND_ROCM:
      return absl::StrCat("rocm:", buffer.device_index());
    default:
      return absl::StrCat("device:", buffer.device_index());
  }
}

// A timestamp as the list shows it: UTC, to the second.
std::string TimeText(const google::protobuf::Timestamp& time) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ",
                          absl::FromUnixSeconds(time.seconds()),
                          absl::UTCTimeZone());
}

class ListCommand : public Command {
 public:
  explicit ListCommand(CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "list", "this user's buffers, with owner, lifetime and times");
    sub->add_flag("--all-users,--all_users", all_users_,
                  "every user's buffers (root only)");
  }
  Outcome Run(LazyClient& lazy, const Global& global) override {
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    absl::StatusOr<std::vector<v1::BufferInfo>> buffers =
        (*client)->ListBuffers(all_users_);
    if (!buffers.ok()) return Failed("list", buffers.status());
    if (global.json()) {
      v1::ListBuffersResponse response;
      for (const v1::BufferInfo& buffer : *buffers) {
        *response.add_buffers() = buffer;
      }
      Print(global, response);
      return Ok();
    }
    std::printf(
        "%-20s %14s %-18s %-9s %-9s %-20s %14s %14s %10s %10s %-10s %-20s "
        "%-20s %s\n",
        "ID", "SIZE", "ACCESS", "ALLOCATED", "MEMORY", "BACKENDS", "MOVED",
        "SERVED", "UID", "PID", "LIFETIME", "CREATED", "LAST_USE", "LABEL");
    for (const v1::BufferInfo& buffer : *buffers) {
      std::printf(
          "%-20llu %14llu %-18s %-9s %-9s %-20s %14llu %14llu %10u %10u "
          "%-10s %-20s %-20s %s\n",
          static_cast<unsigned long long>(buffer.buffer_id()),
          static_cast<unsigned long long>(buffer.size_bytes()),
          v1::Access_Name(buffer.access()).c_str(),
          buffer.agent_allocated() ? "agent" : "client",
          MemoryText(buffer).c_str(),
          absl::StrJoin(buffer.backends(), ",").c_str(),
          static_cast<unsigned long long>(buffer.bytes_moved()),
          static_cast<unsigned long long>(buffer.bytes_served()),
          buffer.owner_uid(), buffer.owner_pid(),
          LifetimeText(buffer.lifetime()),
          TimeText(buffer.create_time()).c_str(),
          TimeText(buffer.last_use_time()).c_str(), buffer.label().c_str());
    }
    return Ok();
  }

 private:
  bool all_users_ = false;
};

class SessionsCommand : public Command {
 public:
  explicit SessionsCommand(CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "sessions",
        "this user's shared-memory ring sessions: owner, size, batches and "
        "ops in flight, ops completed");
    sub->add_flag("--all-users,--all_users", all_users_,
                  "every user's sessions (root only)");
  }
  Outcome Run(LazyClient& lazy, const Global& global) override {
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    absl::StatusOr<std::vector<v1::RingSession>> sessions =
        (*client)->ListRingSessions(all_users_);
    if (!sessions.ok()) return Failed("sessions", sessions.status());
    if (global.json()) {
      v1::ListRingSessionsResponse response;
      for (const v1::RingSession& session : *sessions) {
        *response.add_sessions() = session;
      }
      Print(global, response);
      return Ok();
    }
    std::printf("%10s %10s %8s %-20s %8s %8s %14s %s\n", "UID", "PID",
                "ENTRIES", "OPENED", "BATCHES", "OPS", "COMPLETED", "STOPPED");
    for (const v1::RingSession& session : *sessions) {
      std::printf("%10u %10u %8u %-20s %8llu %8llu %14llu %s\n",
                  session.owner_uid(), session.owner_pid(), session.entries(),
                  TimeText(session.open_time()).c_str(),
                  static_cast<unsigned long long>(session.batches_in_flight()),
                  static_cast<unsigned long long>(session.ops_in_flight()),
                  static_cast<unsigned long long>(session.ops_completed()),
                  session.stopped_reason().empty()
                      ? "-"
                      : absl::CEscape(session.stopped_reason()).c_str());
    }
    return Ok();
  }

 private:
  bool all_users_ = false;
};

// Bytes read or write move per ReadBuffer/WriteBuffer call: the progress
// line moves in steps of this.
constexpr uint64_t kChunkBytes = 4 << 20;

// Commands that take one buffer ID.
class BufferCommand : public Command {
 protected:
  void AddId(CLI::App* sub) { sub->add_option("ID", ids_, "buffer id"); }
  absl::StatusOr<uint64_t> Id() const { return BufferIdArgument(ids_); }

 private:
  std::vector<std::string> ids_;
};

class PublishCommand : public Command {
 public:
  explicit PublishCommand(CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "publish", "publish a buffer under a name in the agent's directory");
    sub->add_option("ID", id_, "buffer id")->required();
    sub->add_option("NAME", name_, "the name")->required();
    sub->add_flag("--any_user", any_user_,
                  "every user of the directory finds it (it carries the "
                  "buffer's token); default: only you");
  }
  Outcome Run(LazyClient& lazy, const Global&) override {
    absl::StatusOr<uint64_t> id =
        BufferIdArgument(std::vector<std::string>{id_});
    if (!id.ok())
      return Usage(absl::StrCat("publish: ", id.status().message()));
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    absl::Status status = (*client)->Publish(
        *id, name_, any_user_ ? v1::VISIBILITY_ANY_USER : v1::VISIBILITY_OWNER);
    if (!status.ok()) return Failed(absl::StrCat("publish ", name_), status);
    return Ok();
  }

 private:
  std::string id_;
  std::string name_;
  bool any_user_ = false;
};

class UnpublishCommand : public Command {
 public:
  explicit UnpublishCommand(CLI::App& app) {
    CLI::App* sub =
        app.add_subcommand("unpublish", "withdraw one of your names");
    sub->add_option("NAME", name_, "the name")->required();
  }
  Outcome Run(LazyClient& lazy, const Global&) override {
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    absl::Status status = (*client)->Unpublish(name_);
    if (!status.ok()) return Failed(absl::StrCat("unpublish ", name_), status);
    return Ok();
  }

 private:
  std::string name_;
};

class ResolveCommand : public Command {
 public:
  explicit ResolveCommand(CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "resolve",
        "who publishes a name, and the remote context it stands for");
    sub->add_option("NAME", name_, "the name")->required();
    sub->add_option("--context_out", context_out_,
                    "write the remote context (binary) to this file");
  }
  Outcome Run(LazyClient& lazy, const Global& global) override {
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    absl::StatusOr<v1::NameRecord> record = (*client)->Resolve(name_);
    if (!record.ok()) {
      return Failed(absl::StrCat("resolve ", name_), record.status());
    }
    if (!context_out_.empty()) {
      absl::Status written = WriteAll(context_out_, record->remote_context());
      if (!written.ok()) {
        return LocalIo(absl::StrCat("resolve: ", written.message()));
      }
    }
    if (global.json()) {
      Print(global, *record);
    } else {
      std::printf("%s: buffer %llu of uid %u on agent %s (epoch %016llx)\n",
                  record->name().c_str(),
                  static_cast<unsigned long long>(record->buffer_id()),
                  record->owner_uid(), record->agent_id().c_str(),
                  static_cast<unsigned long long>(record->agent_epoch()));
    }
    return Ok();
  }

 private:
  std::string name_;
  std::string context_out_;
};

class ReleaseCommand : public Command {
 public:
  explicit ReleaseCommand(CLI::App& app) {
    CLI::App* sub = app.add_subcommand("release", "drop registrations");
    sub->footer(
        "Releases every ID given, also after one fails; exit 1 when any "
        "failed (each named).");
    sub->add_option("ID", ids_, "buffer ids");
  }
  Outcome Run(LazyClient& lazy, const Global&) override {
    absl::StatusOr<std::vector<uint64_t>> ids = BufferIdsArgument(ids_);
    if (!ids.ok()) {
      return Usage(absl::StrCat("release: ", ids.status().message()));
    }
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    std::vector<std::string> failures;
    for (uint64_t id : *ids) {
      absl::Status status = (*client)->Release(id);
      if (!status.ok()) {
        failures.push_back(
            Failed(absl::StrCat("release ", id), status).message);
      }
    }
    if (!failures.empty()) {
      return {kExitFailed, absl::StrJoin(failures, "\nrdma-agentctl: ")};
    }
    return Ok();
  }

 private:
  std::vector<std::string> ids_;
};

class WriteCommand : public BufferCommand {
 public:
  explicit WriteCommand(CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "write", "bytes from a file (or stdin) into a buffer, over gRPC");
    AddId(sub);
    sub->add_option("--offset", offset_, "offset in the buffer")
        ->transform(SizeValue());
    sub->add_option("--in", in_, "input file, - for stdin")
        ->capture_default_str();
  }
  Outcome Run(LazyClient& lazy, const Global& global) override {
    absl::StatusOr<uint64_t> id = Id();
    if (!id.ok()) return Usage(absl::StrCat("write: ", id.status().message()));
    absl::StatusOr<std::string> data = ReadAll(in_);
    if (!data.ok()) {
      return LocalIo(absl::StrCat("write: ", data.status().message()));
    }
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    internal::ProgressLine progress = global.Progress(data->size());
    // At least one call, even for no bytes: the agent still checks the id
    // and the offset, as it did when the whole input was one call.
    uint64_t done = 0;
    do {
      const uint64_t n = std::min<uint64_t>(kChunkBytes, data->size() - done);
      absl::Status status = (*client)->WriteBuffer(
          *id, offset_ + done, absl::string_view(*data).substr(done, n));
      if (!status.ok()) return Failed(absl::StrCat("write ", *id), status);
      done += n;
      progress.Update(done);
    } while (done < data->size());
    progress.Finish(data->size());
    std::fprintf(stderr, "wrote %zu bytes into buffer %llu at offset %llu\n",
                 data->size(), static_cast<unsigned long long>(*id),
                 static_cast<unsigned long long>(offset_));
    return Ok();
  }

 private:
  uint64_t offset_ = 0;
  std::string in_ = "-";
};

class ReadCommand : public BufferCommand {
 public:
  explicit ReadCommand(CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "read", "bytes of a buffer to a file (or stdout), over gRPC");
    AddId(sub);
    sub->add_option("--offset", offset_, "offset in the buffer")
        ->transform(SizeValue());
    sub->add_option("--length", length_, "bytes to read")
        ->transform(SizeValue());
    sub->add_option("--out", out_, "output file, - for stdout")
        ->capture_default_str();
  }
  Outcome Run(LazyClient& lazy, const Global& global) override {
    absl::StatusOr<uint64_t> id = Id();
    if (!id.ok()) return Usage(absl::StrCat("read: ", id.status().message()));
    if (!length_.has_value()) return Usage("read needs --length L");
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    internal::ProgressLine progress = global.Progress(*length_);
    std::string data;
    // At least one call: the agent judges the range, even an empty one.
    uint64_t done = 0;
    do {
      const uint64_t n = std::min<uint64_t>(kChunkBytes, *length_ - done);
      absl::StatusOr<std::string> chunk =
          (*client)->ReadBuffer(*id, offset_ + done, n);
      if (!chunk.ok()) {
        return Failed(absl::StrCat("read ", *id), chunk.status());
      }
      data.append(*chunk);
      done += n;
      progress.Update(done);
    } while (done < *length_);
    progress.Finish(data.size());
    absl::Status written = WriteAll(out_, data);
    if (!written.ok())
      return LocalIo(absl::StrCat("read: ", written.message()));
    return Ok();
  }

 private:
  uint64_t offset_ = 0;
  std::optional<uint64_t> length_;
  std::string out_ = "-";
};

// "op I: CODE backend=NAME[ message=...]", as submit, wait and watch print
// each op's result.
void PrintOpResult(size_t i, const OpResult& result) {
  std::printf("op %zu: %s backend=%s%s%s\n", i,
              absl::StatusCodeToString(result.status.code()).c_str(),
              result.backend.empty() ? "-" : result.backend.c_str(),
              result.status.ok() ? "" : " message=",
              std::string(result.status.message()).c_str());
}

// "notification to buffer B of agent A: CODE backend=NAME[ message=...]".
void PrintNotificationResult(const NotificationResult& result) {
  std::printf("notification to buffer %llu of agent %s: %s backend=%s%s%s\n",
              static_cast<unsigned long long>(result.buffer_id),
              absl::CEscape(result.agent_id).c_str(),
              absl::StatusCodeToString(result.status.code()).c_str(),
              result.backend.empty() ? "-" : result.backend.c_str(),
              result.status.ok() ? "" : " message=",
              std::string(result.status.message()).c_str());
}

// A transfer as wait, cancel and watch print it: "transfer ID: STATE" and
// its ops' results, or its Transfer message as JSON (on one line for watch's
// stream of them).
void PrintTransfer(const Global& global, const TransferResult& transfer,
                   bool one_line = false) {
  if (global.json()) {
    const v1::Transfer message = internal::ToProto(transfer);
    std::string text;
    if (one_line) {
      v1::TransferEvent event;
      *event.mutable_transfer() = message;
      text = ToJson(event, /*indented=*/false) + "\n";
    } else {
      text = ToJson(message);
    }
    std::fputs(text.c_str(), stdout);
  } else {
    std::printf("transfer %llu: %s\n",
                static_cast<unsigned long long>(transfer.id),
                TransferStateName(transfer.state));
    for (size_t i = 0; i < transfer.results.size(); ++i) {
      PrintOpResult(i, transfer.results[i]);
    }
    for (const NotificationResult& sent : transfer.notifications) {
      PrintNotificationResult(sent);
    }
  }
  std::fflush(stdout);
}

// Options naming a remote context: --context BASE64 or --context_file FILE.
struct ContextOptions {
  std::string base64;
  std::string file;
  void Add(CLI::App* sub) {
    sub->add_option("--context", base64,
                    "remote context, base64 (as register prints it)");
    sub->add_option("--context_file", file,
                    "file holding the raw remote context");
  }
};

// One op as --op or a line of --ops_file gives it:
// "TYPE[,key=value...]", TYPE read or write, keys local, local_offset,
// length, remote_offset, context (base64) and context_file. A key it leaves
// out takes the command's flag of the same name.
struct OpFields {
  std::optional<uint64_t> local;
  uint64_t local_offset = 0;
  std::optional<uint64_t> length;
  uint64_t remote_offset = 0;
  std::string context;
  std::string context_file;
};

// The op `text` says, with `defaults` for what it leaves out. Errors are
// INVALID_ARGUMENT naming the key; the context is not read yet.
absl::StatusOr<std::pair<v1::OpType, OpFields>> ParseOpText(
    absl::string_view text, const OpFields& defaults) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, ',');
  v1::OpType type;
  if (parts[0] == "read") {
    type = v1::OP_TYPE_READ_INTO_LOCAL;
  } else if (parts[0] == "write") {
    type = v1::OP_TYPE_WRITE_FROM_LOCAL;
  } else {
    return absl::InvalidArgumentError("the op is read or write");
  }
  OpFields fields = defaults;
  bool context_given = false;
  for (size_t i = 1; i < parts.size(); ++i) {
    std::pair<absl::string_view, absl::string_view> key_value =
        absl::StrSplit(parts[i], absl::MaxSplits('=', 1));
    const absl::string_view key = key_value.first;
    const absl::string_view value = key_value.second;
    if (!absl::StrContains(parts[i], '=') || value.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", key, "' has no value"));
    }
    if (key == "local") {
      uint64_t id;
      if (!absl::SimpleAtoi(value, &id)) {
        return absl::InvalidArgumentError(
            absl::StrCat("local: ", value, " is not a buffer ID"));
      }
      fields.local = id;
      continue;
    }
    if (key == "context" || key == "context_file") {
      if (!context_given) fields.context = fields.context_file = "";
      context_given = true;
      (key == "context" ? fields.context : fields.context_file) =
          std::string(value);
      continue;
    }
    if (key != "local_offset" && key != "length" && key != "remote_offset") {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown key '", key,
                       "' (local, local_offset, length, remote_offset, "
                       "context, context_file)"));
    }
    absl::StatusOr<uint64_t> bytes = internal::ParseByteSize(value);
    if (!bytes.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(key, ": ", bytes.status().message()));
    }
    if (key == "local_offset") fields.local_offset = *bytes;
    if (key == "remote_offset") fields.remote_offset = *bytes;
    if (key == "length") fields.length = *bytes;
  }
  if (!fields.local.has_value()) {
    return absl::InvalidArgumentError(
        "no local buffer (local=ID, or --local ID for every op)");
  }
  if (!fields.length.has_value()) {
    return absl::InvalidArgumentError(
        "no length (length=L, or --length L for every op)");
  }
  return std::make_pair(type, fields);
}

class SubmitCommand : public Command {
 public:
  explicit SubmitCommand(CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "submit",
        "one-sided ops between local buffers and remote ones, as one batch "
        "(--async: as a transfer, printing its id)");
    sub->footer(
        "Each --op is TYPE[,key=value...]: TYPE read (READ_INTO_LOCAL) or "
        "write (WRITE_FROM_LOCAL); keys local, local_offset, length, "
        "remote_offset, context, context_file; a key left out takes the flag "
        "of the same name, so --op read --local 2 --length 4k --context_file "
        "a.ctx is one op and --local 2 --context_file a.ctx --op "
        "read,length=4k --op read,local_offset=4k,remote_offset=8k,length=4k "
        "two. --ops_file holds one op a line in the same form (# comments). "
        "Sizes take binary suffixes (4k, 1GiB).\n\n"
        "The global --timeout (default 30s) bounds the batch. With --async "
        "the command returns once the agent has accepted the ops, printing "
        "transfer_id: ID; the agent runs them after the command has exited. "
        "Follow it with wait ID, cancel ID or watch. On a terminal (after a "
        "second) or with --progress, a progress line shows the bytes landed, "
        "rate and ETA: the batch then runs as a transfer the agent reports "
        "on, and SIGINT cancels it (its ops end CANCELLED).");
    sub->add_option("--op", ops_,
                    "an op: read or write, then ,key=value for what differs "
                    "from the flags below (repeatable)");
    sub->add_option("--ops_file", ops_file_,
                    "file of ops, one a line (as --op takes them)");
    sub->add_option("--local", defaults_.local, "local buffer id")
        ->check(IdValue());
    sub->add_option("--local_offset", defaults_.local_offset,
                    "offset in the local buffer")
        ->transform(SizeValue());
    sub->add_option("--length", defaults_.length, "bytes to move")
        ->transform(SizeValue());
    sub->add_option("--remote_offset", defaults_.remote_offset,
                    "offset in the remote buffer")
        ->transform(SizeValue());
    sub->add_flag("--async", async_,
                  "return at once with the transfer id (SubmitAsync); the "
                  "agent runs it after this command has exited");
    sub->add_option("--notify", notify_,
                    "bytes for the remote buffers' owners, delivered once the "
                    "ops succeeded (read there with notifications)");
    sub->add_option("--context", defaults_.context,
                    "remote context, base64 (as register prints it)");
    sub->add_option("--context_file", defaults_.context_file,
                    "file holding the raw remote context");
  }

  Outcome Run(LazyClient& lazy, const Global& global) override {
    absl::StatusOr<std::vector<OpSpec>> ops = Ops();
    if (!ops.ok()) return UsageOrLocalIo("submit", ops.status());
    uint64_t total = 0;
    for (const OpSpec& op : *ops) total += op.length;
    internal::ProgressLine progress = global.Progress(total);
    // A batch followed with a progress line runs as a transfer the agent
    // reports on while it runs; SIGINT cancels it.
    const bool followed = !async_ && progress.enabled();
    const sigset_t stop_signals = StopSignals(/*block=*/followed);
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    SubmitOptions options;
    options.timeout = global.rpc_timeout();
    options.notification = notify_;
    if (async_) {
      absl::StatusOr<Transfer> transfer = (*client)->SubmitAsync(*ops, options);
      if (!transfer.ok()) return Failed("submit", transfer.status());
      if (global.json()) {
        v1::SubmitAsyncResponse response;
        response.set_transfer_id(transfer->id());
        Print(global, response);
      } else {
        std::printf("transfer_id: %llu\n",
                    static_cast<unsigned long long>(transfer->id()));
      }
      return Ok();
    }
    if (followed) {
      absl::StatusOr<TransferResult> end =
          Follow(**client, *ops, options, stop_signals, progress);
      if (!end.ok()) return Failed("submit", end.status());
      return PrintEnd(global, end->results, end->notifications);
    }
    absl::StatusOr<SubmitResult> submitted = (*client)->Submit(*ops, options);
    if (!submitted.ok()) return Failed("submit", submitted.status());
    return PrintEnd(global, submitted->results, submitted->notifications);
  }

 private:
  // Runs `ops` as a transfer, drawing its bytes done ten times a second,
  // until it ends (or is cancelled by SIGINT/SIGTERM): its end.
  static absl::StatusOr<TransferResult> Follow(
      AgentClient& client, const std::vector<OpSpec>& ops,
      const SubmitOptions& options, const sigset_t& stop_signals,
      internal::ProgressLine& progress) {
    absl::StatusOr<Transfer> transfer = client.SubmitAsync(ops, options);
    if (!transfer.ok()) return transfer.status();
    const timespec tick = {0, 100000000L};  // 100 ms
    absl::StatusOr<TransferResult> now = transfer->Poll();
    while (now.ok() && !now->ended()) {
      progress.Update(now->bytes_done);
      if (sigtimedwait(&stop_signals, nullptr, &tick) > 0) {
        now = transfer->Cancel();
        break;
      }
      now = transfer->Poll();
    }
    if (now.ok()) progress.Finish(now->bytes_done);
    return now;
  }

  // Prints a batch's end as Submit answers it; exit 1 when an op failed or
  // a notification was not delivered.
  static Outcome PrintEnd(const Global& global,
                          const std::vector<OpResult>& results,
                          const std::vector<NotificationResult>& sent) {
    bool all_ok = true;
    v1::SubmitResponse response;
    for (size_t i = 0; i < results.size(); ++i) {
      const OpResult& result = results[i];
      all_ok = all_ok && result.status.ok();
      v1::OpResult* printed = response.add_results();
      printed->set_code(static_cast<int>(result.status.code()));
      printed->set_message(std::string(result.status.message()));
      printed->set_backend(result.backend);
      if (!global.json()) PrintOpResult(i, result);
    }
    for (const NotificationResult& one : sent) {
      all_ok = all_ok && one.status.ok();
      *response.add_notifications() = internal::ToProto(one);
      if (!global.json()) PrintNotificationResult(one);
    }
    if (global.json()) Print(global, response);
    if (!all_ok) {
      return {kExitFailed,
              "submit: an op failed or the notification was not "
              "delivered"};
    }
    return Ok();
  }

  // Every op of --op and --ops_file, in that order, with its context read.
  // INVALID_ARGUMENT for bad usage (naming the op), another code for a file
  // that could not be read.
  absl::StatusOr<std::vector<OpSpec>> Ops() {
    // (where it came from, its text)
    std::vector<std::pair<std::string, std::string>> texts;
    for (const std::string& text : ops_) {
      texts.emplace_back(absl::StrCat("--op ", text), text);
    }
    if (!ops_file_.empty()) {
      absl::StatusOr<std::string> file = ReadAll(ops_file_);
      if (!file.ok()) return file.status();
      int number = 0;
      for (absl::string_view line : absl::StrSplit(*file, '\n')) {
        ++number;
        line = absl::StripAsciiWhitespace(line);
        if (line.empty() || absl::StartsWith(line, "#")) continue;
        texts.emplace_back(absl::StrCat(ops_file_, ":", number, ": ", line),
                           std::string(line));
      }
    }
    if (texts.empty()) {
      return absl::InvalidArgumentError(
          "needs --op read or --op write (or --ops_file FILE)");
    }
    std::vector<OpSpec> ops;
    std::map<std::string, std::string> files_read;  // context_file -> bytes
    for (const auto& [where, text] : texts) {
      absl::StatusOr<std::pair<v1::OpType, OpFields>> parsed =
          ParseOpText(text, defaults_);
      if (!parsed.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": ", parsed.status().message()));
      }
      const OpFields& fields = parsed->second;
      absl::StatusOr<std::string> context;
      if (!fields.context_file.empty() &&
          files_read.count(fields.context_file) > 0 && fields.context.empty()) {
        context = files_read[fields.context_file];
      } else {
        context =
            RemoteContextArgument(fields.context, fields.context_file, {});
      }
      if (!context.ok()) {
        if (context.status().code() != absl::StatusCode::kInvalidArgument) {
          return context.status();
        }
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": ", context.status().message()));
      }
      if (!fields.context_file.empty()) {
        files_read[fields.context_file] = *context;
      }
      OpSpec op;
      op.type = parsed->first;
      op.local_buffer_id = *fields.local;
      op.local_offset = fields.local_offset;
      op.length = *fields.length;
      op.remote_context = *std::move(context);
      op.remote_offset = fields.remote_offset;
      ops.push_back(std::move(op));
    }
    return ops;
  }

  std::vector<std::string> ops_;
  std::string ops_file_;
  OpFields defaults_;
  bool async_ = false;
  std::string notify_;
};

// Commands that take one transfer ID.
class TransferCommand : public Command {
 protected:
  void AddId(CLI::App* sub) {
    sub->add_option("ID", ids_, "transfer id (as submit --async prints it)");
  }
  absl::StatusOr<uint64_t> Id() const {
    uint64_t id;
    if (ids_.size() != 1 || !absl::SimpleAtoi(ids_[0], &id)) {
      return absl::InvalidArgumentError("expected exactly one transfer ID");
    }
    return id;
  }

 private:
  std::vector<std::string> ids_;
};

class WaitCommand : public TransferCommand {
 public:
  explicit WaitCommand(CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "wait", "wait for a transfer to end; exit 0 only when it ended DONE");
    sub->footer(
        "Waits up to the global --timeout (default 30s; e.g. wait 7 --timeout "
        "5m), then prints the transfer's state and each op's result (-o json: "
        "its Transfer). Exit 1 when it ended FAILED or CANCELLED or is still "
        "PENDING. Once ended it is read: the agent forgets it, and a "
        "second wait answers NOT_FOUND.");
    AddId(sub);
  }
  Outcome Run(LazyClient& lazy, const Global& global) override {
    absl::StatusOr<uint64_t> id = Id();
    if (!id.ok()) return Usage(absl::StrCat("wait: ", id.status().message()));
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    Transfer transfer = (*client)->TransferById(*id);
    absl::StatusOr<TransferResult> end = transfer.Wait(global.rpc_timeout());
    if (end.status().code() == absl::StatusCode::kDeadlineExceeded) {
      end = transfer.Poll();  // PENDING, with its times
    }
    if (!end.ok()) return Failed(absl::StrCat("wait ", *id), end.status());
    PrintTransfer(global, *end);
    if (!end->ok()) {
      return {kExitFailed, absl::StrCat("wait: transfer ", *id, " is ",
                                        TransferStateName(end->state))};
    }
    return Ok();
  }
};

class CancelCommand : public TransferCommand {
 public:
  explicit CancelCommand(CLI::App& app) {
    CLI::App* sub =
        app.add_subcommand("cancel", "stop a transfer and print its end");
    sub->footer(
        "Ops not started never start, ops in flight stop; returns once "
        "nothing of the transfer touches local memory, printing its final "
        "state: CANCELLED, or the state it had already ended in (exit 0 "
        "either way; 1 when the agent does not know the id). The end stays "
        "readable by wait and watch.");
    AddId(sub);
  }
  Outcome Run(LazyClient& lazy, const Global& global) override {
    absl::StatusOr<uint64_t> id = Id();
    if (!id.ok()) return Usage(absl::StrCat("cancel: ", id.status().message()));
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    absl::StatusOr<TransferResult> end = (*client)->TransferById(*id).Cancel();
    if (!end.ok()) return Failed(absl::StrCat("cancel ", *id), end.status());
    PrintTransfer(global, *end);
    return Ok();
  }
};

class WatchCommand : public Command {
 public:
  explicit WatchCommand(CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "watch", "print this user's transfers as they end, until interrupted");
    sub->footer(
        "Streams WatchTransfers: each transfer that ends after the watch "
        "started, whoever submitted it (with --backlog, first the ended "
        "transfers the agent still keeps, not read yet by wait or another "
        "client); -o json prints one TransferEvent per line. Runs until "
        "SIGINT or SIGTERM (exit 0), --count ends (exit 0) or the agent goes "
        "away (exit 1). Watching reads nothing: wait still finds each end, "
        "and other watches see it too.");
    sub->add_option("--count", count_, "stop after this many ends");
    sub->add_flag("--backlog", backlog_,
                  "start with the ends that came before the watch");
  }
  Outcome Run(LazyClient& lazy, const Global& global) override {
    if (count_.has_value() && *count_ < 1) {
      return Usage("watch: --count must be at least 1");
    }
    const sigset_t stop_signals = StopSignals(/*block=*/true);
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    absl::Mutex mu;
    uint64_t printed = 0;
    // The agent's clock is this host's: an end stamped before now came
    // before the watch.
    const absl::Time start = absl::Now();
    absl::StatusOr<TransferWatch> watch =
        (*client)->WatchTransfers([&](const TransferResult& end) {
          absl::MutexLock lock(&mu);
          if (count_.has_value() && printed >= *count_) return;
          if (!backlog_ && end.end_time < start) return;
          PrintTransfer(global, end, /*one_line=*/true);
          ++printed;
        });
    if (!watch.ok()) return Failed("watch", watch.status());
    const timespec tick = {0, 100000000L};  // 100 ms
    while (true) {
      if (sigtimedwait(&stop_signals, nullptr, &tick) > 0) return Ok();
      {
        absl::MutexLock lock(&mu);
        if (count_.has_value() && printed >= *count_) return Ok();
      }
      if (absl::Status status = watch->status(); !status.ok()) {
        return Failed("watch", status);
      }
    }
  }

 private:
  std::optional<uint64_t> count_;
  bool backlog_ = false;
};

// "notification #SEQ from AGENT to buffer ID: DATA" (C-escaped), or the
// NotificationEvent as one JSON line.
void PrintNotification(const Global& global, const Notification* notification,
                       uint64_t dropped) {
  if (global.json()) {
    v1::NotificationEvent event;
    if (notification != nullptr) {
      v1::Notification* out = event.mutable_notification();
      out->set_from_agent_id(notification->from_agent_id);
      out->set_buffer_id(notification->buffer_id);
      out->set_data(notification->data);
      out->set_sequence(notification->sequence);
      out->mutable_receive_time()->set_seconds(
          absl::ToUnixSeconds(notification->receive_time));
    }
    event.set_dropped(dropped);
    std::fputs((ToJson(event, /*indented=*/false) + "\n").c_str(), stdout);
  } else {
    if (dropped > 0) {
      std::printf("dropped: %llu\n", static_cast<unsigned long long>(dropped));
    }
    if (notification != nullptr) {
      std::printf("notification #%llu from %s to buffer %llu: %s\n",
                  static_cast<unsigned long long>(notification->sequence),
                  absl::CEscape(notification->from_agent_id).c_str(),
                  static_cast<unsigned long long>(notification->buffer_id),
                  absl::CEscape(notification->data).c_str());
    }
  }
  std::fflush(stdout);
}

class NotificationsCommand : public Command {
 public:
  explicit NotificationsCommand(CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "notifications",
        "print the notifications peers sent to this user's buffers");
    sub->footer(
        "Takes the queued notifications (GetNotifications), waiting up to "
        "--wait for the first, and prints each once (data C-escaped; -o "
        "json: one NotificationEvent per line). With --watch, streams them "
        "(WatchNotifications) until SIGINT or SIGTERM (exit 0), --count "
        "notifications (exit 0) or the agent goes away (exit 1). 'dropped: "
        "N' says N were lost to a full queue.");
    sub->add_option("--wait", wait_,
                    "longest wait for the first one (e.g. 10s or 10; "
                    "default 0)")
        ->transform(DurationValue(/*positive=*/false));
    sub->add_flag("--watch", watch_, "stream them until interrupted");
    sub->add_option("--count", count_,
                    "with --watch: stop after this many notifications");
  }
  Outcome Run(LazyClient& lazy, const Global& global) override {
    // Checked by the option's validator.
    const absl::Duration wait =
        internal::ParseDuration(wait_).value_or(absl::ZeroDuration());
    if (count_.has_value() && (*count_ < 1 || !watch_)) {
      return Usage("notifications: --count needs --watch and at least 1");
    }
    if (!watch_) {
      absl::StatusOr<AgentClient*> client = lazy.Get();
      if (!client.ok()) return Failed("connect", client.status());
      absl::StatusOr<NotificationBatch> batch =
          (*client)->GetNotifications(wait);
      if (!batch.ok()) return Failed("notifications", batch.status());
      if (batch->notifications.empty() && batch->dropped > 0) {
        PrintNotification(global, nullptr, batch->dropped);
      }
      for (size_t i = 0; i < batch->notifications.size(); ++i) {
        PrintNotification(global, &batch->notifications[i],
                          i == 0 ? batch->dropped : 0);
      }
      return Ok();
    }
    const sigset_t stop_signals = StopSignals(/*block=*/true);
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    absl::Mutex mu;
    uint64_t printed = 0;
    absl::StatusOr<NotificationWatch> stream = (*client)->WatchNotifications(
        [&](const Notification* notification, uint64_t dropped) {
          absl::MutexLock lock(&mu);
          if (count_.has_value() && printed >= *count_) return;
          PrintNotification(global, notification, dropped);
          if (notification != nullptr) ++printed;
        });
    if (!stream.ok()) return Failed("notifications", stream.status());
    const timespec tick = {0, 100000000L};  // 100 ms
    while (true) {
      if (sigtimedwait(&stop_signals, nullptr, &tick) > 0) return Ok();
      {
        absl::MutexLock lock(&mu);
        if (count_.has_value() && printed >= *count_) return Ok();
      }
      if (absl::Status status = stream->status(); !status.ok()) {
        return Failed("notifications", status);
      }
    }
  }

 private:
  std::string wait_ = "0s";
  bool watch_ = false;
  std::optional<uint64_t> count_;
};

// A name event as names prints it: "NAME: buffer ID of uid U on agent A
// (epoch E)" for a published name (after "published " while watching),
// "withdrawn NAME", "synced"; -o json: the NameEvent on one line.
void PrintNameEvent(const Global& global, const v1::NameEvent& event,
                    bool watching) {
  if (global.json()) {
    std::fputs((ToJson(event, /*indented=*/false) + "\n").c_str(), stdout);
  } else if (event.kind() == v1::NameEvent::PUBLISHED) {
    const v1::NameRecord& record = event.record();
    std::printf("%s%s: buffer %llu of uid %u on agent %s (epoch %016llx)\n",
                watching ? "published " : "", record.name().c_str(),
                static_cast<unsigned long long>(record.buffer_id()),
                record.owner_uid(), record.agent_id().c_str(),
                static_cast<unsigned long long>(record.agent_epoch()));
  } else if (event.kind() == v1::NameEvent::WITHDRAWN) {
    std::printf("withdrawn %s\n", event.record().name().c_str());
  } else if (event.kind() == v1::NameEvent::SYNCED && watching) {
    std::printf("synced\n");
  }
  std::fflush(stdout);
}

class NamesCommand : public Command {
 public:
  explicit NamesCommand(CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "names", "list the names you may see in the agent's directory");
    sub->footer(
        "Prints every name published under PREFIX now, one line each (-o "
        "json: one NameEvent per line). With --watch, then 'synced' and each "
        "name published or withdrawn (WatchNames) until SIGINT or SIGTERM "
        "(exit 0), --count changes (exit 0) or the agent goes away (exit "
        "1).");
    sub->add_option("PREFIX", prefix_, "names starting with it; default: all");
    sub->add_flag("--watch", watch_, "then stream changes until interrupted");
    sub->add_option("--count", count_,
                    "with --watch: stop after this many changes");
  }
  Outcome Run(LazyClient& lazy, const Global& global) override {
    if (count_.has_value() && (*count_ < 1 || !watch_)) {
      return Usage("names: --count needs --watch and at least 1");
    }
    const sigset_t stop_signals = StopSignals(/*block=*/true);
    absl::StatusOr<AgentClient*> client = lazy.Get();
    if (!client.ok()) return Failed("connect", client.status());
    absl::Mutex mu;
    bool synced = false;
    uint64_t changes = 0;
    absl::StatusOr<NameWatch> stream =
        (*client)->WatchNames(prefix_, [&](const v1::NameEvent& event) {
          absl::MutexLock lock(&mu);
          if (synced && (!watch_ || (count_.has_value() && changes >= *count_)))
            return;
          PrintNameEvent(global, event, watch_);
          if (event.kind() == v1::NameEvent::SYNCED) {
            synced = true;
          } else if (synced) {
            ++changes;
          }
        });
    if (!stream.ok()) return Failed("names", stream.status());
    const timespec tick = {0, 100000000L};  // 100 ms
    while (true) {
      if (sigtimedwait(&stop_signals, nullptr, &tick) > 0) return Ok();
      {
        absl::MutexLock lock(&mu);
        if (synced && !watch_) return Ok();
        if (count_.has_value() && changes >= *count_) return Ok();
      }
      if (absl::Status status = stream->status(); !status.ok()) {
        return Failed("names", status);
      }
    }
  }

 private:
  std::string prefix_;
  bool watch_ = false;
  std::optional<uint64_t> count_;
};

class DecodeCommand : public Command {
 public:
  explicit DecodeCommand(CLI::App& app) {
    CLI::App* sub = app.add_subcommand(
        "decode", "print a remote context (offline: needs no agent)");
    sub->add_option("BASE64", args_, "remote context, base64");
    context_.Add(sub);
  }
  Outcome Run(LazyClient&, const Global& global) override {
    if (args_.size() > 1) return Usage("decode takes at most one argument");
    absl::StatusOr<std::string> context =
        RemoteContextArgument(context_.base64, context_.file, args_);
    if (!context.ok()) return UsageOrLocalIo("decode", context.status());
    absl::StatusOr<std::string> text = internal::RemoteContextToText(*context);
    if (!text.ok()) {
      return Usage(absl::StrCat("decode: ", text.status().message()));
    }
    if (global.json()) {
      v1::RemoteBuffer remote;
      remote.ParseFromString(*context);  // checked by RemoteContextToText
      Print(global, remote);
    } else {
      std::fputs(text->c_str(), stdout);
    }
    return Ok();
  }

 private:
  std::vector<std::string> args_;
  ContextOptions context_;
};

class CompletionCommand : public Command {
 public:
  explicit CompletionCommand(CLI::App& app) : app_(app) {
    CLI::App* sub = app.add_subcommand(
        "completion", "print a shell completion script (bash)");
    sub->footer(
        "source <(rdma-agentctl completion bash), or install it as "
        "/usr/share/bash-completion/completions/rdma-agentctl. Generated "
        "from the tool's own parser: it always matches --help.");
    sub->add_option("SHELL", shell_, "bash");
  }
  Outcome Run(LazyClient&, const Global&) override {
    if (shell_ != "bash") {
      return Usage("completion: the shell is bash (completion bash)");
    }
    std::fputs(internal::BashCompletion(app_).c_str(), stdout);
    return Ok();
  }

 private:
  const CLI::App& app_;
  std::string shell_;
};

// The man page, from the parser (hidden: `rdma-agentctl man >
// rdma-agentctl.1`).
class ManCommand : public Command {
 public:
  explicit ManCommand(CLI::App& app) : app_(app) {
    app.add_subcommand("man", "print the man page (troff)")->group("");
  }
  Outcome Run(LazyClient&, const Global&) override {
    const std::string extra = absl::StrCat(
        ".SH EXIT STATUS\n0 ok; 1 the agent refused or an op failed (for "
        "health, the agent is not serving; for wait, the transfer did not "
        "end DONE); 2 bad usage; 3 a local file could not be read or "
        "written.\n",
        ".SH ENVIRONMENT\n.TP\n.B RDMA_AGENT_SOCKET\nThe agent's socket when "
        "\\-\\-target is not given (a gRPC target or a path).\n",
        ".SH SEE ALSO\n\\fBrdma\\-agentd\\fR \\-\\-help; docs/API.md and "
        "docs/OPERATING.md of rdma\\-agentd (installed in "
        "/usr/local/share/doc/rdma\\-agentd/).\n");
    std::fputs(internal::ManPage(app_, kProjectVersion, extra).c_str(), stdout);
    return Ok();
  }

 private:
  const CLI::App& app_;
};

// Options of the whole tool that take a value in the next argument.
bool TakesValue(absl::string_view option) {
  return option == "--target" || option == "--attach_socket" ||
         option == "--timeout" || option == "-o" || option == "--output";
}

// "help" and "help COMMAND" as CLI11 understands them: "--help" and
// "COMMAND --help". Returns the arguments reversed, as CLI11 parses them.
std::vector<std::string> HelpAsFlag(std::vector<std::string> args,
                                    const std::vector<CLI::App*>& commands) {
  size_t i = 0;
  while (i < args.size() && absl::StartsWith(args[i], "-")) {
    i += TakesValue(args[i]) ? 2 : 1;
  }
  if (i < args.size() && args[i] == "help") {
    const bool known_topic =
        i + 1 < args.size() &&
        std::any_of(commands.begin(), commands.end(), [&](CLI::App* command) {
          return command->get_name() == args[i + 1];
        });
    if (i + 1 == args.size() || known_topic) {
      args.erase(args.begin() + i);
      args.insert(
          args.begin() + std::min(args.size(), i + (known_topic ? 1 : 0)),
          "--help");
    } else {
      args[i] = args[i + 1];  // an unknown topic is an unknown command
      args.erase(args.begin() + i + 1);
    }
  }
  std::reverse(args.begin(), args.end());
  return args;
}

int Main(int argc, char** argv) {
  CLI::App app(kDescription, "rdma-agentctl");
  app.fallthrough();  // global options may follow the command too
  Global global;
  app.add_option("--target", global.target,
                 "the agent: a gRPC target (unix:///path) or a socket path; "
                 "default $RDMA_AGENT_SOCKET, else "
                 "unix:///run/rdma-agentd/agent.sock");
  app.add_option("--attach_socket", global.attach_socket,
                 "attach socket; default: attach.sock next to the agent "
                 "socket");
  app.add_option("--timeout", global.timeout,
                 "deadline of each RPC, the op timeout of submit (with "
                 "--async too), and how long wait waits (e.g. 30s, 500ms, "
                 "or seconds: 30); the last one given wins")
      ->capture_default_str()
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->transform(DurationValue(/*positive=*/true));
  app.set_version_flag("--version",
                       absl::StrCat("rdma-agentctl ", kProjectVersion),
                       "print the tool's version and exit");
  app.add_flag("--progress", global.progress,
               "show a progress line (bytes, rate, ETA) for read, write and "
               "submit "
               "even when stderr is no terminal or the work is short; never "
               "with -o json");
  app.add_option("-o,--output", global.output, "output format")
      ->capture_default_str()
      ->check(CLI::IsMember({"text", "json"}));

  // Each command adds its subcommand; `subs` and `owned` stay in step.
  std::vector<std::unique_ptr<Command>> owned;
  owned.push_back(std::make_unique<InfoCommand>(app));
  owned.push_back(std::make_unique<AgentsCommand>(app));
  owned.push_back(std::make_unique<PublishCommand>(app));
  owned.push_back(std::make_unique<UnpublishCommand>(app));
  owned.push_back(std::make_unique<ResolveCommand>(app));
  owned.push_back(std::make_unique<NamesCommand>(app));
  owned.push_back(std::make_unique<HealthCommand>(app));
  owned.push_back(std::make_unique<MetricsCommand>(app));
  owned.push_back(std::make_unique<RegisterCommand>(app));
  owned.push_back(std::make_unique<ListCommand>(app));
  owned.push_back(std::make_unique<SessionsCommand>(app));
  owned.push_back(std::make_unique<ReleaseCommand>(app));
  owned.push_back(std::make_unique<WriteCommand>(app));
  owned.push_back(std::make_unique<ReadCommand>(app));
  owned.push_back(std::make_unique<SubmitCommand>(app));
  owned.push_back(std::make_unique<WaitCommand>(app));
  owned.push_back(std::make_unique<CancelCommand>(app));
  owned.push_back(std::make_unique<WatchCommand>(app));
  owned.push_back(std::make_unique<NotificationsCommand>(app));
  owned.push_back(std::make_unique<DecodeCommand>(app));
  owned.push_back(std::make_unique<CompletionCommand>(app));
  owned.push_back(std::make_unique<ManCommand>(app));
  // Subcommands are kept in the order they were added.
  const std::vector<CLI::App*> subs = app.get_subcommands({});
  app.footer(
      "rdma-agentctl help COMMAND (or COMMAND --help): a command's "
      "options.");

  try {
    app.parse(
        HelpAsFlag(std::vector<std::string>(argv + 1, argv + argc), subs));
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ExtrasError& e) {
    const std::vector<std::string> extras = app.remaining();
    if (app.get_subcommands().empty() && !extras.empty()) {
      std::fprintf(stderr,
                   "rdma-agentctl: unknown command '%s' (see rdma-agentctl "
                   "--help)\n",
                   extras.front().c_str());
    } else {
      std::fprintf(stderr, "rdma-agentctl: %s\n", e.what());
    }
    return kExitUsage;
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "rdma-agentctl: %s\n", e.what());
    return kExitUsage;
  }

  const std::vector<CLI::App*> chosen = app.get_subcommands();
  if (chosen.empty()) {
    std::fprintf(stderr, "rdma-agentctl: no command given\n\n%s",
                 app.help().c_str());
    return kExitUsage;
  }
  LazyClient lazy(global);
  Outcome outcome;
  for (size_t i = 0; i < subs.size(); ++i) {
    if (subs[i] == chosen.front()) outcome = owned[i]->Run(lazy, global);
  }
  if (outcome.code != kExitOk) {
    std::fprintf(stderr, "rdma-agentctl: %s\n", outcome.message.c_str());
  }
  return outcome.code;
}

}  // namespace
}  // namespace rdma_agent::client

int main(int argc, char** argv) { return rdma_agent::client::Main(argc, argv); }
