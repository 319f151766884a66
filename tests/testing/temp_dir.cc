#include "tests/testing/temp_dir.h"

#include <stdlib.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace rdma_agent::testing {

absl::StatusOr<std::string> MakeShortTempDir() {
  char name[] = "/tmp/rat.XXXXXX";
  if (::mkdtemp(name) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: ", std::strerror(errno)));
  }
  return std::string(name);
}

void RemoveTree(const std::string& path) {
  std::error_code ignored;
  std::filesystem::remove_all(path, ignored);
}

TempDir::TempDir() {
  absl::StatusOr<std::string> dir = MakeShortTempDir();
  if (!dir.ok()) {
    std::fprintf(stderr, "TempDir: %s\n", dir.status().ToString().c_str());
    std::abort();
  }
  path_ = *std::move(dir);
  ::chmod(path_.c_str(), 0755);
}

TempDir::~TempDir() { RemoveTree(path_); }

}  // namespace rdma_agent::testing
