#include "tests/testing/etcd_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/unique_fd.h"

namespace rdma_agent::testing {

absl::StatusOr<uint16_t> FreeLoopbackPort() {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (!fd.valid() ||
      ::bind(fd.get(), reinterpret_cast<sockaddr*>(&address), length) != 0 ||
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&address), &length) !=
          0) {
    return absl::InternalError("cannot find a free loopback port");
  }
  return ntohs(address.sin_port);
}

namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdServer>> EtcdServer::Start(Options options) {
  std::unique_ptr<EtcdServer> server(new EtcdServer(std::move(options)));
  server->dir_.emplace();
  auto client_port = FreeLoopbackPort();
  auto peer_port = FreeLoopbackPort();
  if (!client_port.ok()) return client_port.status();
  if (!peer_port.ok()) return peer_port.status();
  server->endpoint_ = absl::StrCat(server->options_.host, ":", *client_port);
  server->peer_endpoint_ = absl::StrCat(server->options_.host, ":", *peer_port);
  EtcdClient::Options client;
  client.endpoints = {server->endpoint_};
  client.call_timeout = absl::Seconds(2);
  if (!server->options_.ca_file.empty()) {
    client.ca_pem = ReadFile(server->options_.ca_file);
    client.cert_pem = ReadFile(server->options_.cert_file);
    client.key_pem = ReadFile(server->options_.key_file);
  }
  server->client_ = std::make_unique<EtcdClient>(std::move(client));
  absl::Status status = server->Launch();
  if (!status.ok()) return status;
  return server;
}

EtcdServer::~EtcdServer() { Kill(); }

absl::Status EtcdServer::Launch() {
  Subprocess::Options options;
  options.argv = {
      "etcd",
      "--name=test",
      absl::StrCat("--data-dir=", dir_->path(), "/data"),
      absl::StrCat("--listen-client-urls=", scheme(), endpoint_),
      absl::StrCat("--advertise-client-urls=", scheme(), endpoint_),
      absl::StrCat("--listen-peer-urls=http://", peer_endpoint_),
      absl::StrCat("--initial-advertise-peer-urls=http://", peer_endpoint_),
      absl::StrCat("--initial-cluster=test=http://", peer_endpoint_),
      "--logger=zap",
      "--log-level=error"};
  if (!options_.ca_file.empty()) {
    options.argv.push_back("--cert-file=" + options_.cert_file);
    options.argv.push_back("--key-file=" + options_.key_file);
    options.argv.push_back("--trusted-ca-file=" + options_.ca_file);
    options.argv.push_back("--client-cert-auth");
  }
  options.argv.insert(options.argv.end(), options_.extra_flags.begin(),
                      options_.extra_flags.end());
  if (!options_.netns.empty()) {
    options.argv.insert(options.argv.begin(),
                        {"ip", "netns", "exec", options_.netns});
  }
  options.log_path = dir_->path() + "/etcd.log";
  auto process = Subprocess::Spawn(std::move(options));
  if (!process.ok()) return process.status();
  process_ = std::move(*process);
  // Asked with etcdctl, a new connection each time: etcd accepts
  // connections before it serves, and a gRPC channel that connected that
  // early waits long for its first answer.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  absl::Status last;
  while (absl::Now() < deadline) {
    auto health = Etcdctl({"--command-timeout=1s", "endpoint", "health"});
    if (health.ok()) return absl::OkStatus();
    last = health.status();
    if (!process_->Running()) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return absl::UnavailableError(
      absl::StrCat("etcd did not answer at ", endpoint_, ": ", last.message(),
                   " (log: ", dir_->path(), "/etcd.log)"));
}

void EtcdServer::Kill() {
  if (!process_.has_value()) return;
  process_->Signal(SIGKILL);
  (void)process_->Wait(absl::Seconds(10));
  process_.reset();
}

absl::Status EtcdServer::Restart() {
  Kill();
  return Launch();
}

absl::StatusOr<std::string> EtcdServer::Etcdctl(std::vector<std::string> args) {
  std::vector<std::string> argv = {
      "env", "ETCDCTL_API=3", "etcdctl",
      absl::StrCat("--endpoints=", scheme(), endpoint_)};
  if (!options_.ca_file.empty()) {
    argv.push_back("--cacert=" + options_.ca_file);
    argv.push_back("--cert=" + options_.cert_file);
    argv.push_back("--key=" + options_.key_file);
  }
  if (!etcdctl_user_.empty()) argv.push_back("--user=" + etcdctl_user_);
  argv.insert(argv.end(), args.begin(), args.end());
  if (!options_.netns.empty()) {
    argv.insert(argv.begin(), {"ip", "netns", "exec", options_.netns});
  }
  return RunCommand(argv);
}

}  // namespace rdma_agent::testing
