#ifndef RDMA_AGENTD_TESTS_TESTING_TEMP_DIR_H_
#define RDMA_AGENTD_TESTS_TESTING_TEMP_DIR_H_

#include <string>

namespace rdma_agent::testing {

// A fresh directory under /tmp (short, so Unix socket paths inside it fit in
// sun_path), removed with its contents on destruction.
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
