#ifndef RDMA_AGENTD_TESTS_TESTING_TEST_PKI_H_
#define RDMA_AGENTD_TESTS_TESTING_TEST_PKI_H_

#include <string>

namespace rdma_agent::testing {

// Certificates made at test time with the openssl CLI, in `dir`: CAs and
// certificates they sign (P-256, valid two days), as <name>.pem and
// <name>.key. openssl's output goes to <dir>/openssl.log.
class TestPki {
 public:
  explicit TestPki(std::string dir) : dir_(std::move(dir)) {}

  // A self-signed CA `name`.
  bool MakeCa(const std::string& name) const;
  // A certificate `name` (subject CN `name`) for server and client use,
  // signed by `ca`, with subjectAltName `san` (e.g. "IP:127.0.0.1").
  bool MakeCert(const std::string& name, const std::string& ca,
                const std::string& san) const;

  std::string Path(const std::string& file) const { return dir_ + "/" + file; }
  // What openssl printed, for a failure message.
  std::string Log() const;

 private:
  bool Run(const std::string& command) const;

  const std::string dir_;
};

}  // namespace rdma_agent::testing

#endif  // RDMA_AGENTD_TESTS_TESTING_TEST_PKI_H_
