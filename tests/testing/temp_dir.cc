#include "tests/testing/temp_dir.h"

#include <stdlib.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>

namespace rdma_agent::testing {

TempDir::TempDir() {
  char pattern[] = "/tmp/rat.XXXXXX";
  if (::mkdtemp(pattern) == nullptr) std::abort();
  ::chmod(pattern, 0755);
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

}  // namespace rdma_agent::testing
