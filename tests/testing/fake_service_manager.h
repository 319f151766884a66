#ifndef RDMA_AGENTD_TESTS_TESTING_FAKE_SERVICE_MANAGER_H_
#define RDMA_AGENTD_TESTS_TESTING_FAKE_SERVICE_MANAGER_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/unique_fd.h"

namespace rdma_agent::testing {

// Stands in for systemd's notify socket: a Unix datagram socket bound at a
// path, which a process told NOTIFY_SOCKET=<path> sends sd_notify(3)
// messages to.
class FakeServiceManager {
 public:
  // Binds `path` (which must not exist; removed on destruction).
  static absl::StatusOr<FakeServiceManager> Bind(const std::string& path);

  FakeServiceManager(FakeServiceManager&&) = default;
  FakeServiceManager& operator=(FakeServiceManager&&) = default;
  ~FakeServiceManager();

  // "NOTIFY_SOCKET=<path>", for a child's environment.
  std::string Environment() const { return "NOTIFY_SOCKET=" + path_; }

  // The next message ("READY=1\nSTATUS=..."); DEADLINE_EXCEEDED when none
  // comes within `timeout`.
  absl::StatusOr<std::string> Next(absl::Duration timeout);

 private:
  FakeServiceManager(std::string path, UniqueFd fd)
      : path_(std::move(path)), fd_(std::move(fd)) {}

  std::string path_;
  UniqueFd fd_;
};

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_TESTING_FAKE_SERVICE_MANAGER_H_
