#include "tests/testing/test_pki.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace rdma_agent::testing {

bool TestPki::Run(const std::string& command) const {
  const std::string line =
      absl::StrCat("cd '", dir_, "' && ", command, " >>openssl.log 2>&1");
  return std::system(line.c_str()) == 0;
}

bool TestPki::MakeCa(const std::string& name) const {
  return Run(absl::StrCat(
      "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes "
      "-days 2 -subj '/CN=",
      name, "' -keyout ", name, ".key -out ", name, ".pem"));
}

bool TestPki::MakeCert(const std::string& name, const std::string& ca,
                       const std::string& san) const {
  std::ofstream(Path(name + ".ext"))
      << "subjectAltName=" << san << "\n"
      << "extendedKeyUsage=serverAuth,clientAuth\n";
  return Run(absl::StrCat("openssl req -newkey ec -pkeyopt "
                          "ec_paramgen_curve:P-256 -nodes -subj '/CN=",
                          name, "' -keyout ", name, ".key -out ", name,
                          ".csr")) &&
         Run(absl::StrCat("openssl x509 -req -in ", name, ".csr -CA ", ca,
                          ".pem -CAkey ", ca,
                          ".key -CAcreateserial -days 2 -extfile ", name,
                          ".ext -out ", name, ".pem"));
}

std::string TestPki::Log() const {
  std::ifstream in(Path("openssl.log"));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace rdma_agent::testing
