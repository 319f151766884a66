#include "client/internal/http_get.h"

#include <civetweb.h>

#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/net_address.h"

namespace rdma_agent::client {
namespace {

struct CloseConnection {
  void operator()(mg_connection* connection) const {
    mg_close_connection(connection);
  }
};

}  // namespace

absl::StatusOr<std::string> HttpGet(const std::string& address,
                                    const std::string& path,
                                    absl::Duration timeout) {
  auto where = ParseHostPort(address);
  if (!where.ok() || where->port == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", address, "\" is not host:port"));
  }
  char error[256] = {};
  std::unique_ptr<mg_connection, CloseConnection> connection(
      mg_connect_client(where->host.c_str(), static_cast<int>(where->port),
                        /*use_ssl=*/0, error, sizeof(error)));
  if (connection == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot reach http://", address, ": ", error));
  }
  mg_printf(connection.get(),
            "GET %s HTTP/1.0\r\nHost: %s\r\nConnection: close\r\n\r\n",
            path.c_str(), address.c_str());
  if (mg_get_response(connection.get(), error, sizeof(error),
                      static_cast<int>(absl::ToInt64Milliseconds(timeout))) <
      0) {
    return absl::UnavailableError(
        absl::StrCat("no answer from http://", address, path, ": ", error));
  }
  std::string body;
  char chunk[16384];
  int n;
  while ((n = mg_read(connection.get(), chunk, sizeof(chunk))) > 0) {
    body.append(chunk, static_cast<size_t>(n));
  }
  const mg_response_info* info = mg_get_response_info(connection.get());
  const int code = info == nullptr ? 0 : info->status_code;
  if (code != 200) {
    return absl::Status(
        code == 503 ? absl::StatusCode::kUnavailable
                    : absl::StatusCode::kInternal,
        absl::StrCat("http://", address, path, " answered ", code, ": ",
                     absl::StripAsciiWhitespace(body)));
  }
  return body;
}

}  // namespace rdma_agent::client
