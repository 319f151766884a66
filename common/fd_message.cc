#include "common/fd_message.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"

namespace rdma_agent {
namespace {

absl::Status SocketError(absl::string_view what) {
  const int err = errno;
  if (err == EPIPE || err == ECONNRESET) {
    return absl::UnavailableError(absl::StrCat(what, ": connection closed"));
  }
  return ErrnoStatus(absl::StatusCode::kInternal, what, err);
}

// Sends all of [data, data+size); the first sendmsg carries `fd`.
absl::Status SendAll(int sock, const char* data, size_t size, int fd) {
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  while (size > 0) {
    struct iovec iov = {const_cast<char*>(data), size};
    struct msghdr msg = {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (fd >= 0) {
      std::memset(control, 0, sizeof(control));
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      struct cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
      cmsg->cmsg_level = SOL_SOCKET;
      cmsg->cmsg_type = SCM_RIGHTS;
      cmsg->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
    }
    const ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return SocketError("sendmsg");
    }
    fd = -1;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Receives exactly `size` bytes, collecting any fds that arrive.
absl::Status ReceiveAll(int sock, char* data, size_t size, UniqueFd* fd) {
  while (size > 0) {
    alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
    struct iovec iov = {data, size};
    struct msghdr msg = {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR) continue;
      return SocketError("recvmsg");
    }
    for (struct cmsghdr* cmsg = CMSG_FIRSTHDR(&msg); cmsg != nullptr;
         cmsg = CMSG_NXTHDR(&msg, cmsg)) {
      if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) {
        continue;
      }
      const size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int received;
        std::memcpy(&received, CMSG_DATA(cmsg) + i * sizeof(int), sizeof(int));
        // Keep the first; close any extra so a client cannot leak fds into us.
        if (!fd->valid()) {
          fd->reset(received);
        } else {
          ::close(received);
        }
      }
    }
    if (n == 0) return absl::UnavailableError("connection closed by peer");
    data += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SendFdMessage(int sock,
                           const google::protobuf::MessageLite& message,
                           int fd) {
  std::string body;
  if (!message.SerializeToString(&body)) {
    return absl::InternalError("cannot serialize attach message");
  }
  const uint32_t size = static_cast<uint32_t>(body.size());
  std::string frame(4, '\0');
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>(size >> (8 * i));
  frame += body;
  return SendAll(sock, frame.data(), frame.size(), fd);
}

absl::StatusOr<UniqueFd> ReceiveFdMessage(
    int sock, google::protobuf::MessageLite* message) {
  UniqueFd fd;
  unsigned char prefix[4];
  absl::Status status =
      ReceiveAll(sock, reinterpret_cast<char*>(prefix), sizeof(prefix), &fd);
  if (!status.ok()) return status;
  uint32_t size = 0;
  for (int i = 0; i < 4; ++i)
    size |= static_cast<uint32_t>(prefix[i]) << (8 * i);
  if (size > kMaxFdMessageBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("attach message of ", size, " bytes is too large"));
  }
  std::string body(size, '\0');
  status = ReceiveAll(sock, body.data(), body.size(), &fd);
  if (!status.ok()) return status;
  if (!message->ParseFromString(body)) {
    return absl::InvalidArgumentError("malformed attach message");
  }
  return fd;
}

}  // namespace rdma_agent
