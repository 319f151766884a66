// A local client process for the security tests, driven over stdin/stdout
// (one command per line, one answer line per command), optionally running as
// another user. It plays the attacker and the bystander:
//
//   attach_sparse COUNT SIZE   hands COUNT sealed sparse memfds of SIZE bytes
//                              over one attach connection, never registers
//        -> attached N refused M [CODE MESSAGE of the first refusal]
//   attach SIZE                attaches (client library) and registers
//        -> ok ID | error CODE MESSAGE
//   allocate SIZE [HEX_LABEL]  agent-allocated, not mapped here
//        -> ok ID | error CODE MESSAGE
//   fill_registrations SIZE MAX
//                              allocates SIZE-byte buffers until refused or
//                              MAX -> registered N [CODE MESSAGE]
//   release_all                -> released N
//   writebuf ID HEX            -> status CODE
//   readbuf ID LENGTH          -> status CODE [HEX]
//   hold_connections N         opens N attach connections and asks on each
//        -> served S refused R [MESSAGE of the first refusal]
//   drop_connections           -> dropped N
//
// Flags: --target, --attach_socket; --uid/--gid: drop to that user first.

#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/rdma_agent_client.h"
#include "common/fd_message.h"
#include "common/status_util.h"
#include "common/unique_fd.h"
#include "rdma/agent/v1/attach.pb.h"

ABSL_FLAG(std::string, target, "", "agent target");
ABSL_FLAG(std::string, attach_socket, "", "attach socket path");
ABSL_FLAG(int, uid, -1, "drop to this uid before anything else");
ABSL_FLAG(int, gid, -1, "drop to this gid before anything else");

namespace rdma_agent::testing {
namespace {

using client::AgentClient;
namespace v1 = ::rdma::agent::v1;

std::string OneLine(absl::string_view text) {
  std::string line(text);
  for (char& c : line) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return line;
}

std::string CodeName(const absl::Status& status) {
  return absl::StatusCodeToString(status.code());
}

std::string Error(const absl::Status& status) {
  return absl::StrCat("error ", CodeName(status), " ",
                      OneLine(status.message()));
}

absl::Status ResponseStatus(const v1::AttachResponse& response) {
  return StatusFromInt(response.code(), response.message());
}

UniqueFd ConnectUnix(const std::string& path) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return fd;
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  if (::connect(fd.get(), reinterpret_cast<struct sockaddr*>(&addr),
                sizeof(addr)) != 0) {
    return UniqueFd();
  }
  struct timeval timeout = {10, 0};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  return fd;
}

// One request (with `fd` if >= 0) and its response on `sock`.
absl::StatusOr<v1::AttachResponse> Exchange(int sock,
                                            const v1::AttachRequest& request,
                                            int fd) {
  absl::Status sent = SendFdMessage(sock, request, fd);
  v1::AttachResponse response;
  // A refused connection has its answer waiting even when sending failed.
  auto received = ReceiveFdMessage(sock, &response);
  if (!received.ok()) return sent.ok() ? received.status() : sent;
  return response;
}

class Worker {
 public:
  Worker(std::unique_ptr<AgentClient> client, std::string attach_socket)
      : client_(std::move(client)), attach_socket_(std::move(attach_socket)) {}

  std::string Handle(const std::vector<std::string>& words) {
    const std::string& command = words[0];
    std::vector<uint64_t> n;
    for (size_t i = 1; i < words.size(); ++i) {
      uint64_t value = 0;
      if (!absl::SimpleAtoi(words[i], &value)) value = 0;
      n.push_back(value);
    }
    auto need = [&](size_t count) { return words.size() >= count + 1; };
    if (command == "attach_sparse" && need(2)) return AttachSparse(n[0], n[1]);
    if (command == "attach" && need(1)) {
      auto buffer = client_->Attach(n[0], v1::ACCESS_READ_WRITE);
      if (!buffer.ok()) return Error(buffer.status());
      const uint64_t id = buffer->id();
      attached_.emplace(id, std::move(*buffer));
      return absl::StrCat("ok ", id);
    }
    if (command == "allocate" && need(1)) {
      const std::string label =
          need(2) ? absl::HexStringToBytes(words[2]) : std::string();
      auto registration =
          client_->AllocateUnmapped(n[0], v1::ACCESS_READ_WRITE, label);
      if (!registration.ok()) return Error(registration.status());
      allocated_.push_back(registration->id);
      return absl::StrCat("ok ", registration->id);
    }
    if (command == "fill_registrations" && need(2)) {
      uint64_t count = 0;
      for (; count < n[1]; ++count) {
        auto registration =
            client_->AllocateUnmapped(n[0], v1::ACCESS_READ_WRITE);
        if (!registration.ok()) {
          return absl::StrCat("registered ", count, " ",
                              CodeName(registration.status()), " ",
                              OneLine(registration.status().message()));
        }
        allocated_.push_back(registration->id);
      }
      return absl::StrCat("registered ", count);
    }
    if (command == "release_all") {
      size_t released = 0;
      for (uint64_t id : allocated_) released += client_->Release(id).ok();
      allocated_.clear();
      released += attached_.size();
      attached_.clear();
      return absl::StrCat("released ", released);
    }
    if (command == "writebuf" && need(2)) {
      return absl::StrCat("status ",
                          CodeName(client_->WriteBuffer(
                              n[0], 0, absl::HexStringToBytes(words[2]))));
    }
    if (command == "readbuf" && need(2)) {
      auto data = client_->ReadBuffer(n[0], 0, n[1]);
      if (!data.ok()) return absl::StrCat("status ", CodeName(data.status()));
      return absl::StrCat("status OK ", absl::BytesToHexString(*data));
    }
    if (command == "hold_connections" && need(1)) return HoldConnections(n[0]);
    if (command == "drop_connections") {
      const size_t dropped = connections_.size();
      connections_.clear();
      return absl::StrCat("dropped ", dropped);
    }
    return absl::StrCat("error INVALID_ARGUMENT bad command: ", command);
  }

 private:
  std::string AttachSparse(uint64_t count, uint64_t size) {
    UniqueFd sock = ConnectUnix(attach_socket_);
    if (!sock) return absl::StrCat("error UNAVAILABLE connect: ", errno);
    uint64_t attached = 0;
    uint64_t refused = 0;
    std::string first_refusal;
    for (uint64_t i = 0; i < count; ++i) {
      UniqueFd memfd(::memfd_create("sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING));
      if (!memfd || ::ftruncate(memfd.get(), static_cast<off_t>(size)) != 0 ||
          ::fcntl(memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
        return absl::StrCat("error INTERNAL memfd: ", std::strerror(errno));
      }
      v1::AttachRequest request;
      request.mutable_attach();
      auto response = Exchange(sock.get(), request, memfd.get());
      if (!response.ok()) return Error(response.status());
      const absl::Status status = ResponseStatus(*response);
      if (status.ok()) {
        ++attached;
      } else {
        if (refused++ == 0) {
          first_refusal = absl::StrCat(" ", CodeName(status), " ",
                                       OneLine(status.message()));
        }
      }
    }
    return absl::StrCat("attached ", attached, " refused ", refused,
                        first_refusal);
  }

  std::string HoldConnections(uint64_t count) {
    uint64_t served = 0;
    uint64_t refused = 0;
    std::string first_refusal;
    for (uint64_t i = 0; i < count; ++i) {
      UniqueFd sock = ConnectUnix(attach_socket_);
      if (!sock) return absl::StrCat("error UNAVAILABLE connect: ", errno);
      // Buffer 0 never exists: a served connection answers NOT_FOUND.
      v1::AttachRequest request;
      request.mutable_open()->set_buffer_id(0);
      auto response = Exchange(sock.get(), request, -1);
      if (!response.ok()) return Error(response.status());
      const absl::Status status = ResponseStatus(*response);
      if (absl::IsNotFound(status)) {
        ++served;
        connections_.push_back(std::move(sock));
      } else if (refused++ == 0) {
        first_refusal =
            absl::StrCat(" ", CodeName(status), " ", OneLine(status.message()));
      }
    }
    return absl::StrCat("served ", served, " refused ", refused, first_refusal);
  }

  std::unique_ptr<AgentClient> client_;
  const std::string attach_socket_;
  std::vector<uint64_t> allocated_;
  std::map<uint64_t, client::Buffer> attached_;
  std::vector<UniqueFd> connections_;
};

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  ::signal(SIGPIPE, SIG_IGN);
  // Before any other thread exists: the whole process becomes that user.
  const int gid = absl::GetFlag(FLAGS_gid);
  const int uid = absl::GetFlag(FLAGS_uid);
  if (gid >= 0 && (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0)) {
    std::perror("setgid");
    return 3;
  }
  if (uid >= 0 && ::setuid(uid) != 0) {
    std::perror("setuid");
    return 3;
  }
  client::ConnectOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.attach_socket = absl::GetFlag(FLAGS_attach_socket);
  auto client = AgentClient::Connect(options);
  if (!client.ok()) {
    std::cout << Error(client.status()) << std::endl;
    return 1;
  }
  std::cout << "ready " << ::getuid() << std::endl;
  Worker worker(std::move(*client), options.attach_socket);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::vector<std::string> words =
        absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (words.empty()) continue;
    if (words[0] == "exit") return 0;
    std::cout << worker.Handle(words) << std::endl;
  }
  return 0;
}

}  // namespace
}  // namespace rdma_agent::testing

int main(int argc, char** argv) {
  return rdma_agent::testing::Main(argc, argv);
}
