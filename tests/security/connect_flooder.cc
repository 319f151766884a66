// A local user flooding the agent's API socket with connections, for
// connect_flood_test: --threads threads each connect, optionally send a few
// bytes (--hello), and close, as fast as they can; --hold connections are
// kept open besides (up to the per-user cap, so that what follows is
// refused at accept). Prints "flooding" once the held ones are open and
// floods until its stdin closes; --try_socket: a socket it tries to
// connect to first, saying what happened. --uid/--gid: drop to that user first
// (the runfiles are not reachable by other users, so setpriv cannot exec it).

#include <grp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/unique_fd.h"

ABSL_FLAG(std::string, socket, "", "the agent's API socket");
ABSL_FLAG(int, threads, 4, "threads connecting and closing");
ABSL_FLAG(int, hold, 0, "connections kept open throughout");
ABSL_FLAG(int, uid, -1, "drop to this uid before anything else");
ABSL_FLAG(int, gid, -1, "drop to this gid before anything else");
ABSL_FLAG(std::string, try_socket, "",
          "a socket to try once first (reported: connected, or the errno)");
ABSL_FLAG(bool, hello, true, "send the HTTP/2 client preface before closing");

namespace {

using rdma_agent::UniqueFd;

UniqueFd Connect(const std::string& path) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un address = {};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&address),
                sizeof(address)) != 0) {
    return UniqueFd();
  }
  return fd;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
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
  const std::string path = absl::GetFlag(FLAGS_socket);
  const bool hello = absl::GetFlag(FLAGS_hello);
  std::string tried = "-";
  if (const std::string other = absl::GetFlag(FLAGS_try_socket);
      !other.empty()) {
    tried = Connect(other) ? "connected" : std::strerror(errno);
  }
  std::vector<UniqueFd> held;
  for (int i = 0; i < absl::GetFlag(FLAGS_hold); ++i) {
    UniqueFd fd = Connect(path);
    if (fd) held.push_back(std::move(fd));
  }
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> connects{0};
  std::vector<std::thread> threads;
  static const char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  for (int i = 0; i < absl::GetFlag(FLAGS_threads); ++i) {
    threads.emplace_back([&] {
      while (!stop.load(std::memory_order_relaxed)) {
        UniqueFd fd = Connect(path);
        if (!fd) continue;
        if (hello) {
          (void)!::send(fd.get(), kPreface, sizeof(kPreface) - 1,
                        MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        connects.fetch_add(1, std::memory_order_relaxed);
      }
    });
  }
  std::cout << "flooding held " << held.size() << " tried " << tried
            << std::endl;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::cout << "connects " << connects.load() << std::endl;
  }
  stop = true;
  for (std::thread& thread : threads) thread.join();
  return 0;
}
