#ifndef RDMA_AGENTD_TESTS_TESTING_TEMP_DIR_H_
#define RDMA_AGENTD_TESTS_TESTING_TEMP_DIR_H_

#include <string>

#include "absl/status/statusor.h"

namespace rdma_agent::testing {

// A fresh directory (mode 0700) with a short path under /tmp: Unix socket
// paths inside it must stay under 108 bytes, and TEST_TMPDIR can be long.
// The caller removes it, e.g. with RemoveTree.
absl::StatusOr<std::string> MakeShortTempDir();

// Removes `path` and everything below it; errors are ignored (cleanup).
void RemoveTree(const std::string& path);

// RAII over MakeShortTempDir: the directory is made mode 0755 (processes of
// other users can reach sockets inside) and removed with its contents on
// destruction. Aborts the test process if no directory can be made.
class TempDir {
 public:
  TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir();

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_TESTING_TEMP_DIR_H_
