// rdma-agent-bench: bandwidth between two running rdma-agentd processes, as a
// client of the first one sees it.
//
//   rdma-agent-bench --local=unix:///tmp/a/agent.sock
//                    --remote=unix:///tmp/b/agent.sock
//
// Registers a buffer on each agent (memfd attached by this process), then
// measures, after one untimed warm-up of each:
//   write  --size bytes as one op (local -> remote), --iterations times
//   read   --size bytes as one op (remote -> local)
//   put    --op_bytes ops (local -> remote), --ops in all, --batch per Submit
//   get    the same, remote -> local
// and, as references, a plain loopback TCP stream in this process with cold
// (--size) and hot (1 MiB) buffers; prints "name bytes seconds MiB/s Gbit/s".

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/rdma_agent_client.h"
#include "common/shared_memory.h"
#include "common/unique_fd.h"

ABSL_FLAG(std::string, local, "unix:///run/rdma-agentd/agent.sock",
          "gRPC target of the agent that runs the ops.");
ABSL_FLAG(std::string, remote, "",
          "gRPC target of the agent that owns the remote buffer.");
ABSL_FLAG(uint64_t, size, 256ull << 20, "Bytes of the single-op tests.");
ABSL_FLAG(int, iterations, 8, "Timed repetitions of the single-op tests.");
ABSL_FLAG(uint64_t, op_bytes, 1ull << 20, "Bytes per op of put/get.");
ABSL_FLAG(int, ops, 2048, "Timed put (and get) ops in all.");
ABSL_FLAG(int, batch, 64, "put/get ops per Submit.");
ABSL_FLAG(uint64_t, put_window_bytes, 8ull << 20,
          "put/get ops cycle through this many bytes of each buffer (like "
          "ucx_perftest, which reuses one message buffer).");
ABSL_FLAG(std::string, tests, "write,read,put,get,socket_cold,socket_hot",
          "Tests to run. socket_cold/socket_hot are references without any "
          "agent: one loopback TCP stream in this process moving --size "
          "bytes between two memfd mappings of --size bytes (cold) or of "
          "1 MiB reused (hot, what iperf3 -l 1M does).");

namespace rdma_agent::bench {
namespace {

namespace v1 = ::rdma::agent::v1;
using client::AgentClient;
using client::Buffer;
using client::OpSpec;

struct Result {
  std::string name;
  uint64_t bytes = 0;
  absl::Duration time;
};

absl::Status RunBatch(AgentClient& agent, const std::vector<OpSpec>& ops) {
  auto results = agent.Submit(ops, absl::Seconds(120));
  if (!results.ok()) return results.status();
  for (const auto& result : *results) {
    if (!result.status.ok()) return result.status;
    if (result.backend != "tcp") {
      return absl::FailedPreconditionError(
          absl::StrCat("op ran on ", result.backend, ", not tcp"));
    }
  }
  return absl::OkStatus();
}

// The socket ceiling with no agent involved: one loopback TCP stream moving
// `total` bytes from a memfd mapping of `window` bytes into another, 1 MiB
// per call, cycling through the window.
absl::StatusOr<Result> MeasureSocket(const std::string& name, uint64_t window,
                                     uint64_t total) {
  auto src = SharedMemory::Allocate(window, "bench-src");
  auto dst = SharedMemory::Allocate(window, "bench-dst");
  if (!src.ok()) return src.status();
  if (!dst.ok()) return dst.status();
  std::fill_n(src->data(), window, std::byte{1});
  std::fill_n(dst->data(), window, std::byte{2});
  UniqueFd listener(socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (bind(listener.get(), reinterpret_cast<sockaddr*>(&address),
           sizeof(address)) != 0 ||
      listen(listener.get(), 1) != 0 ||
      getsockname(listener.get(), reinterpret_cast<sockaddr*>(&address),
                  &length) != 0) {
    return absl::InternalError("socket reference: cannot listen");
  }
  UniqueFd sender(socket(AF_INET, SOCK_STREAM, 0));
  if (connect(sender.get(), reinterpret_cast<sockaddr*>(&address),
              sizeof(address)) != 0) {
    return absl::InternalError("socket reference: cannot connect");
  }
  UniqueFd receiver(accept(listener.get(), nullptr, nullptr));
  constexpr uint64_t kIo = 1 << 20;
  const absl::Time start = absl::Now();
  std::thread reader([&] {
    for (uint64_t got = 0, offset = 0; got < total;) {
      const ssize_t n = recv(receiver.get(), dst->data() + offset,
                             std::min(kIo, window - offset), 0);
      if (n <= 0) return;
      got += n;
      offset = (offset + n) % window;
    }
  });
  for (uint64_t sent = 0, offset = 0; sent < total;) {
    const ssize_t n = send(sender.get(), src->data() + offset,
                           std::min(kIo, window - offset), MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += n;
    offset = (offset + n) % window;
  }
  reader.join();
  return Result{name, total, absl::Now() - start};
}

// Builds `count` ops of `op_bytes`, cycling through the first `window` bytes.
std::vector<OpSpec> MakeOps(v1::OpType type, const Buffer& local,
                            const Buffer& remote, uint64_t op_bytes,
                            int count, uint64_t window) {
  const uint64_t slots =
      std::max<uint64_t>(1, std::min(window, local.size()) / op_bytes);
  std::vector<OpSpec> ops;
  for (int i = 0; i < count; ++i) {
    OpSpec op;
    op.type = type;
    op.local_buffer_id = local.id();
    op.local_offset = (i % slots) * op_bytes;
    op.length = op_bytes;
    op.remote_context = remote.remote_context();
    op.remote_offset = (i % slots) * op_bytes;
    ops.push_back(std::move(op));
  }
  return ops;
}

// Runs `batches` once untimed, then timed; bytes = all ops' lengths.
absl::StatusOr<Result> Measure(const std::string& name, AgentClient& agent,
                               const std::vector<std::vector<OpSpec>>& warmup,
                               const std::vector<std::vector<OpSpec>>& timed) {
  for (const auto& batch : warmup) {
    if (absl::Status s = RunBatch(agent, batch); !s.ok()) return s;
  }
  Result result;
  result.name = name;
  const absl::Time start = absl::Now();
  for (const auto& batch : timed) {
    if (absl::Status s = RunBatch(agent, batch); !s.ok()) return s;
    for (const auto& op : batch) result.bytes += op.length;
  }
  result.time = absl::Now() - start;
  return result;
}

int Main() {
  client::ConnectOptions local_options;
  local_options.target = absl::GetFlag(FLAGS_local);
  client::ConnectOptions remote_options;
  remote_options.target = absl::GetFlag(FLAGS_remote);
  auto local_agent = AgentClient::Connect(local_options);
  auto remote_agent = AgentClient::Connect(remote_options);
  if (!local_agent.ok() || !remote_agent.ok()) {
    std::fprintf(stderr, "connect: %s / %s\n",
                 local_agent.status().ToString().c_str(),
                 remote_agent.status().ToString().c_str());
    return 1;
  }
  const uint64_t size = absl::GetFlag(FLAGS_size);
  auto local = (*local_agent)->Attach(size, v1::ACCESS_READ_WRITE, "bench");
  auto remote = (*remote_agent)->Attach(size, v1::ACCESS_READ_WRITE, "bench");
  if (!local.ok() || !remote.ok()) {
    std::fprintf(stderr, "attach: %s / %s\n",
                 local.status().ToString().c_str(),
                 remote.status().ToString().c_str());
    return 1;
  }
  // Touch every page so first-use page faults are not measured.
  for (uint64_t i = 0; i < size; i += 4096) {
    local->data()[i] = std::byte{1};
    remote->data()[i] = std::byte{2};
  }

  const std::string tests = absl::GetFlag(FLAGS_tests);
  const int iterations = absl::GetFlag(FLAGS_iterations);
  const uint64_t op_bytes = absl::GetFlag(FLAGS_op_bytes);
  const int batch = std::max(1, absl::GetFlag(FLAGS_batch));
  const int total_ops = absl::GetFlag(FLAGS_ops);
  std::vector<Result> results;
  auto run = [&](const std::string& name, v1::OpType type, bool single) {
    if (tests.find(name) == std::string::npos) return true;
    std::vector<std::vector<OpSpec>> timed;
    std::vector<std::vector<OpSpec>> warmup;
    if (single) {
      auto op = MakeOps(type, *local, *remote, size, 1, size);
      warmup.push_back(op);
      timed.assign(iterations, op);
    } else {
      for (int done = 0; done < total_ops; done += batch) {
        timed.push_back(MakeOps(type, *local, *remote, op_bytes,
                                std::min(batch, total_ops - done),
                                absl::GetFlag(FLAGS_put_window_bytes)));
      }
      warmup.push_back(timed.front());
    }
    auto result = Measure(
        single ? absl::StrCat(name, "_", size >> 20, "MiB")
               : absl::StrCat(name, "_", op_bytes >> 10, "KiB_x", batch),
        **local_agent, warmup, timed);
    if (!result.ok()) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(),
                   result.status().ToString().c_str());
      return false;
    }
    results.push_back(*result);
    return true;
  };
  bool ok = run("write", v1::OP_TYPE_WRITE_FROM_LOCAL, true) &&
            run("read", v1::OP_TYPE_READ_INTO_LOCAL, true) &&
            run("put", v1::OP_TYPE_WRITE_FROM_LOCAL, false) &&
            run("get", v1::OP_TYPE_READ_INTO_LOCAL, false);
  const uint64_t socket_bytes = size * std::max(1, iterations);
  for (const auto& [name, window] :
       {std::pair<std::string, uint64_t>{"socket_cold", size},
        std::pair<std::string, uint64_t>{"socket_hot", 1 << 20}}) {
    if (!ok || tests.find(name) == std::string::npos) continue;
    auto result = MeasureSocket(
        absl::StrCat(name, "_", window >> 20, "MiB"), window, socket_bytes);
    if (!result.ok()) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(),
                   result.status().ToString().c_str());
      ok = false;
      continue;
    }
    results.push_back(*result);
  }
  std::printf("%-20s %14s %10s %10s %9s\n", "test", "bytes", "seconds",
              "MiB/s", "Gbit/s");
  for (const Result& r : results) {
    const double seconds = absl::ToDoubleSeconds(r.time);
    std::printf("%-20s %14llu %10.4f %10.1f %9.2f\n", r.name.c_str(),
                static_cast<unsigned long long>(r.bytes), seconds,
                r.bytes / seconds / (1 << 20), r.bytes * 8 / seconds / 1e9);
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace rdma_agent::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return rdma_agent::bench::Main();
}
