#ifndef RDMA_AGENTD_DAEMON_DIRECTORY_DIRECTORY_OPTIONS_H_
#define RDMA_AGENTD_DAEMON_DIRECTORY_DIRECTORY_OPTIONS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace rdma_agent {

// Where the agent publishes itself (--directory and the flags after it).
struct DirectoryOptions {
  // "local" (this agent alone; nothing else to run) or
  // "etcd://host:port[,host:port...]" (an etcd v3 cluster, tried in order).
  std::string address = "local";
  // Every key the agent writes starts with it; agents sharing an etcd
  // cluster see each other only under the same prefix.
  std::string prefix = "/rdma-agentd";
  // The lease the agent's record lives under: renewed every third of it,
  // and gone this long after the agent dies without saying so.
  absl::Duration lease_ttl = absl::Seconds(10);
  // How long one call to the directory may take.
  absl::Duration call_timeout = absl::Seconds(2);
  // TLS to etcd: the CA that signed the servers' certificates (TLS is on
  // when set), and a client certificate and key for etcd's client-cert
  // authentication (both or neither).
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  // etcd user and a file holding its password (a file, not a flag, so that
  // it never shows in `ps`); no user: no etcd authentication.
  std::string user;
  std::string password_file;
  // ListAgents answers at most this many records; a record over
  // kMaxAgentRecordBytes is skipped as unreadable.
  int max_listed_agents = 4096;
  // Names one local user, and all users together, may publish through this
  // agent (each at most kMaxNameBytes, standing for one of their buffers).
  size_t max_names_per_user = 1024;
  size_t max_names_total = 16384;
  // WatchNames streams open at once, per local user and in total (each
  // holds at most 4 MiB of events its reader has not taken).
  size_t max_name_watches_per_user = 8;
  size_t max_name_watches = 64;
  // Records Resolve and Op.remote_name keep, kept true by the directory's
  // watch (etcd only): at most this many, and this many bytes of names and
  // records. 0 entries: every resolution asks etcd.
  size_t resolve_cache_entries = 16384;
  size_t resolve_cache_bytes = 64 << 20;

  // INVALID_ARGUMENT naming the flag for anything malformed.
  absl::Status Validate() const;
  // The etcd endpoints ("host:port"), empty for the local directory.
  std::vector<std::string> EtcdEndpoints() const;
};

// Largest agent record the directory reads or writes.
inline constexpr size_t kMaxAgentRecordBytes = 64 << 10;

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_DAEMON_DIRECTORY_DIRECTORY_OPTIONS_H_
