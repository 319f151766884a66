// The C ABI of rdma_agent_attach.h over the client's attach-socket exchange
// (client/internal/attach_socket.h). No exception or C++ type crosses it.

#include "client/c/rdma_agent_attach.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/internal/attach_socket.h"
#include "common/unique_fd.h"
#include "rdma/agent/v1/attach.pb.h"

namespace {

namespace v1 = ::rdma::agent::v1;
using rdma_agent::UniqueFd;
using rdma_agent::client::internal::AttachReply;
using rdma_agent::client::internal::AttachSocketNextTo;
using rdma_agent::client::internal::ExchangeOnAttachSocket;
using rdma_agent::client::internal::ResponseStatus;

constexpr char kDefaultTarget[] = "unix:///run/rdma-agentd/agent.sock";

// Copies `text` into `out` of `capacity` bytes, cut and NUL-terminated.
void CopyCut(const std::string& text, char* out, size_t capacity) {
  if (capacity == 0) return;
  const size_t n = std::min(text.size(), capacity - 1);
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

// Records `status` in `result` (when given) and returns its code.
int Finish(const absl::Status& status, rdma_agent_attach_result* result) {
  if (result != nullptr) {
    result->code = static_cast<int>(status.code());
    CopyCut(std::string(status.message()), result->message,
            sizeof(result->message));
  }
  return static_cast<int>(status.code());
}

void Reset(rdma_agent_attach_result* result) {
  if (result == nullptr) return;
  std::memset(result, 0, sizeof(*result));
  result->fd = -1;
}

absl::Duration Timeout(int timeout_ms) {
  return timeout_ms > 0 ? absl::Milliseconds(timeout_ms) : absl::Seconds(30);
}

// One exchange; fills size, token and fd of `result` from the answer.
int Exchange(const char* attach_socket, const v1::AttachRequest& request,
             int fd, int timeout_ms, bool wants_token,
             rdma_agent_attach_result* result) {
  Reset(result);
  if (attach_socket == nullptr || result == nullptr) {
    return Finish(
        absl::InvalidArgumentError("attach_socket and result must not be NULL"),
        result);
  }
  absl::StatusOr<AttachReply> reply =
      ExchangeOnAttachSocket(attach_socket, request, fd, Timeout(timeout_ms));
  if (!reply.ok()) return Finish(reply.status(), result);
  if (absl::Status answered = ResponseStatus(reply->response); !answered.ok()) {
    return Finish(answered, result);
  }
  if (wants_token) {
    const std::string& token = reply->response.attach_token();
    if (token.empty() || token.size() >= sizeof(result->token)) {
      return Finish(absl::InternalError(absl::StrCat(
                        "the agent answered a token of ", token.size(),
                        " bytes (1 to ", sizeof(result->token) - 1, ")")),
                    result);
    }
    CopyCut(token, result->token, sizeof(result->token));
  }
  result->size_bytes = reply->response.size_bytes();
  if (reply->fd) result->fd = reply->fd.release();
  return Finish(absl::OkStatus(), result);
}

}  // namespace

extern "C" {

uint32_t rdma_agent_attach_abi_version(void) {
  return RDMA_AGENT_ATTACH_ABI_VERSION;
}

int rdma_agent_attach_socket_path(const char* agent_target, char* path,
                                  size_t capacity,
                                  rdma_agent_attach_result* result) {
  Reset(result);
  std::string target = agent_target != nullptr ? agent_target : "";
  if (target.empty()) {
    const char* env = std::getenv("RDMA_AGENT_SOCKET");
    target = env != nullptr && *env != '\0' ? env : kDefaultTarget;
  }
  if (!absl::StartsWith(target, "unix:")) target = "unix:" + target;
  absl::StatusOr<std::string> attach = AttachSocketNextTo(target);
  if (!attach.ok()) return Finish(attach.status(), result);
  if (path == nullptr || attach->size() >= capacity) {
    return Finish(absl::InvalidArgumentError(absl::StrCat(
                      "the attach socket path needs ", attach->size() + 1,
                      " bytes; the buffer has ", path ? capacity : 0)),
                  result);
  }
  CopyCut(*attach, path, capacity);
  return Finish(absl::OkStatus(), result);
}

int rdma_agent_memfd_create(const char* name, uint64_t size_bytes,
                            rdma_agent_attach_result* result) {
  Reset(result);
  if (size_bytes == 0) {
    return Finish(absl::InvalidArgumentError("memfd size must be positive"),
                  result);
  }
  UniqueFd fd(::memfd_create(name != nullptr && *name ? name : "rdma-agent",
                             MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd || ::ftruncate(fd.get(), static_cast<off_t>(size_bytes)) != 0 ||
      ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
    return Finish(
        absl::InternalError(absl::StrCat("memfd of ", size_bytes,
                                         " bytes: ", std::strerror(errno))),
        result);
  }
  if (result != nullptr) {
    result->size_bytes = size_bytes;
    result->fd = fd.release();
  }
  return Finish(absl::OkStatus(), result);
}

int rdma_agent_attach_memfd(const char* attach_socket, int memfd,
                            int timeout_ms, rdma_agent_attach_result* result) {
  v1::AttachRequest request;
  request.mutable_attach();
  return Exchange(attach_socket, request, memfd, timeout_ms, true, result);
}

int rdma_agent_attach_dmabuf(const char* attach_socket, int dmabuf_fd,
                             uint64_t offset, uint64_t length, int memory_kind,
                             uint32_t device_index, const char* pci_bus_id,
                             int timeout_ms, rdma_agent_attach_result* result) {
  v1::AttachRequest request;
  v1::AttachDeviceMemory* device = request.mutable_attach_device_memory();
  device->set_offset(offset);
  device->set_length(length);
  // The agent judges the kind (HOST and unknown kinds: INVALID_ARGUMENT).
  device->set_kind(static_cast<v1::MemoryKind>(memory_kind));
  device->set_device_index(device_index);
  if (pci_bus_id != nullptr) device->set_pci_bus_id(pci_bus_id);
  return Exchange(attach_socket, request, dmabuf_fd, timeout_ms, true, result);
}

int rdma_agent_open_buffer(const char* attach_socket, uint64_t buffer_id,
                           int timeout_ms, rdma_agent_attach_result* result) {
  v1::AttachRequest request;
  request.mutable_open()->set_buffer_id(buffer_id);
  const int code =
      Exchange(attach_socket, request, -1, timeout_ms, false, result);
  if (code == 0 && result->fd < 0) {
    return Finish(absl::InternalError(absl::StrCat("OpenBuffer ", buffer_id,
                                                   ": the agent sent no fd")),
                  result);
  }
  return code;
}

}  // extern "C"
