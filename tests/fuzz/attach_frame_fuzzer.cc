// Fuzz target: what a local client sends on the attach socket, received with
// ReceiveFdMessage into an AttachRequest over a Unix socketpair: length
// prefixes, proto bodies, and SCM_RIGHTS fds on any chunk (more than the
// receiver's control buffer holds, too).
//
// Input: byte 0 = fds on the first chunk (bits 0-2) and on the second
// (bits 3-5); byte 1 = where the stream is split into the two chunks; the
// rest = the stream.
//
// Oracle: no crash or undefined behaviour; every outcome is OK,
// INVALID_ARGUMENT or UNAVAILABLE; a parsed request re-serialises stably; no
// fd the client sent stays open in the receiver once its result is dropped.
#include <dirent.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/fd_message.h"
#include "google/protobuf/stubs/logging.h"
#include "rdma/agent/v1/attach.pb.h"
#include "tests/fuzz/fuzz_check.h"

namespace rdma_agent {
namespace {

namespace v1 = ::rdma::agent::v1;

int OpenFdCount() {
  int count = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  FUZZ_CHECK(dir != nullptr);
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  ::closedir(dir);
  return count;
}

// A memfd the client hands over (any number of times).
int MemoryFd() {
  static const int fd = [] {
    const int memfd = ::memfd_create("fuzz-attach", MFD_CLOEXEC);
    FUZZ_CHECK(memfd >= 0);
    FUZZ_CHECK(::ftruncate(memfd, 4096) == 0);
    return memfd;
  }();
  return fd;
}

// Sends `bytes` with `fds` copies of MemoryFd() on the first sendmsg.
void SendChunk(int sock, const std::string& bytes, int fds) {
  if (bytes.empty()) return;  // SCM_RIGHTS needs at least one data byte
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)];
  size_t sent = 0;
  while (sent < bytes.size()) {
    iovec iov{const_cast<char*>(bytes.data()) + sent, bytes.size() - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (fds > 0) {
      std::memset(control, 0, sizeof(control));
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds);
      cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
      cmsg->cmsg_level = SOL_SOCKET;
      cmsg->cmsg_type = SCM_RIGHTS;
      cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds);
      for (int i = 0; i < fds; ++i) {
        const int fd = MemoryFd();
        std::memcpy(CMSG_DATA(cmsg) + i * sizeof(int), &fd, sizeof(int));
      }
    }
    const ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
    FUZZ_CHECK(n > 0);
    sent += static_cast<size_t>(n);
    fds = 0;
  }
}

void FuzzOne(const uint8_t* data, size_t size) {
  if (size < 2) return;
  const int first_fds = data[0] & 7;
  const int second_fds = (data[0] >> 3) & 7;
  const std::string stream(reinterpret_cast<const char*>(data) + 2, size - 2);
  const size_t split = data[1] % (stream.size() + 1);

  MemoryFd();  // opened once, before counting
  const int fds_before = OpenFdCount();
  int pair[2];
  FUZZ_CHECK(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
  // Inputs are far smaller than the socket buffer: send it all up front,
  // then end the stream so the receiver never blocks.
  const int big = 1 << 20;
  ::setsockopt(pair[0], SOL_SOCKET, SO_SNDBUF, &big, sizeof(big));
  SendChunk(pair[0], stream.substr(0, split), first_fds);
  SendChunk(pair[0], stream.substr(split), second_fds);
  ::shutdown(pair[0], SHUT_WR);

  // As the attach server does: one message after another until one fails.
  for (int i = 0; i < 64; ++i) {
    v1::AttachRequest request;
    auto fd = ReceiveFdMessage(pair[1], &request);
    if (!fd.ok()) {
      const absl::StatusCode code = fd.status().code();
      FUZZ_CHECK(code == absl::StatusCode::kInvalidArgument ||
                 code == absl::StatusCode::kUnavailable);
      break;
    }
    const std::string serialized = request.SerializeAsString();
    v1::AttachRequest again;
    FUZZ_CHECK(again.ParseFromString(serialized));
    FUZZ_CHECK(again.SerializeAsString() == serialized);
    FUZZ_CHECK(serialized.size() <= kMaxFdMessageBytes);
    if (fd->valid()) {
      // What arrived is the memory the client sent.
      FUZZ_CHECK(::lseek(fd->get(), 0, SEEK_END) == 4096);
    }
  }
  ::close(pair[0]);
  ::close(pair[1]);
  FUZZ_CHECK(OpenFdCount() == fds_before);
}

}  // namespace
}  // namespace rdma_agent

// Invalid UTF-8 in a string field makes libprotobuf log an error line per
// parse; millions of them would only slow fuzzing down.
extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  rdma_agent::FuzzOne(data, size);
  return 0;
}
