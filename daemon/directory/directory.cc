#include "daemon/directory/directory.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/log_text.h"
#include "daemon/directory/etcd_client.h"
#include "daemon/directory/etcd_directory.h"
#include "daemon/directory/local_directory.h"

namespace rdma_agent {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path,
                                     const char* flag) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream contents;
  if (in) contents << in.rdbuf();
  if (!in || in.bad()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read ", path));
  }
  return contents.str();
}

}  // namespace

std::string AgentRecordKey(const DirectoryOptions& options,
                           const std::string& agent_id) {
  return absl::StrCat(options.prefix, "/agents/", agent_id);
}

std::string NameKey(const DirectoryOptions& options, const std::string& name) {
  return absl::StrCat(options.prefix, "/names/", name);
}

bool VisibleTo(const v1::NameRecord& record, uint32_t uid) {
  return record.visibility() == v1::VISIBILITY_ANY_USER ||
         record.owner_uid() == uid;
}

absl::Status NameNotPublished(const std::string& name) {
  return absl::NotFoundError(
      absl::StrCat("no agent publishes the name \"", LogSafe(name), "\""));
}

absl::Status SnapshotTooLarge(const std::string& prefix) {
  return absl::ResourceExhaustedError(
      absl::StrCat("more than ", kMaxWatchSnapshot, " names start with \"",
                   LogSafe(prefix), "\"; watch a narrower prefix"));
}

absl::Status ValidateName(const std::string& name) {
  auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("name \"", LogSafe(name), "\" ", why));
  };
  if (name.empty() || name.size() > kMaxNameBytes) {
    return invalid(absl::StrCat("must be 1 to ", kMaxNameBytes, " bytes"));
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '_' && c != '-' &&
        c != ':' && c != '/') {
      return invalid("may hold only letters, digits and . _ - : /");
    }
  }
  for (absl::string_view segment : absl::StrSplit(name, '/')) {
    if (segment.empty() || segment == "." || segment == "..") {
      return invalid("has an empty, \".\" or \"..\" path segment");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Directory>> OpenDirectory(
    const DirectoryOptions& options) {
  absl::Status status = options.Validate();
  if (!status.ok()) return status;
  if (options.address == "local") return std::make_unique<LocalDirectory>();
  EtcdClient::Options client;
  client.endpoints = options.EtcdEndpoints();
  client.call_timeout = options.call_timeout;
  client.user = options.user;
  const std::pair<const std::string*, std::string*> files[] = {
      {&options.ca_file, &client.ca_pem},
      {&options.cert_file, &client.cert_pem},
      {&options.key_file, &client.key_pem},
      {&options.password_file, &client.password}};
  const char* const flags[] = {"--directory_ca_file", "--directory_cert_file",
                               "--directory_key_file",
                               "--directory_password_file"};
  for (size_t i = 0; i < 4; ++i) {
    if (files[i].first->empty()) continue;
    auto contents = ReadFile(*files[i].first, flags[i]);
    if (!contents.ok()) return contents.status();
    *files[i].second = std::move(*contents);
  }
  // A password file ends with a newline more often than not.
  client.password =
      std::string(absl::StripTrailingAsciiWhitespace(client.password));
  return std::make_unique<EtcdDirectory>(
      options, std::make_unique<EtcdClient>(std::move(client)));
}

}  // namespace rdma_agent
