// The tcp backend alone, without gRPC or the daemon: two in-process agents
// on loopback, ops handed to TcpBackend::Submit as the registry hands them.
// Measures the data plane's own cost per op, next to a plain TCP ping-pong
// in the same run:
//   - 8 B READ, one op per Submit: p50/p99 latency vs the ping-pong's;
//   - 8 B READ, one op per Post (`post`), done awaited by spinning as a
//     ring client does: through the client's loop (--tcp_client_loops=1,
//     the default) and through its workers (0), in alternating slices of
//     the same run, vs the ping-pong's;
//   - 4 KiB WRITE and READ, 1000 ops per Submit: ops/s;
//   - 64 KiB x 256 per Submit (KV-cache-sized blocks) and one 256 MiB op
//     per Submit, WRITE and READ: MiB/s.
//
//   bazel run -c opt //bench:tcp_backend_bench -- [seconds [rows]]
//
// `rows` picks what runs (comma-separated; default all but sizes): latency,
// post, write4k, read4k, kv (or kvwrite, kvread), bulk, sizes (16 MiB per
// Submit in ops of 16 KiB to 4 MiB: what a request costs beyond its bytes). One
// row alone is what to run under `perf stat` / `perf record` to see one kind of
// op's system calls and profile.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "backends/tcp/tcp_backend.h"
#include "backends/testing/harness.h"
#include "bench/socket_peer.h"

namespace rdma_agent {
namespace {

using ::rdma_agent::testing::MakeOp;
using ::rdma_agent::testing::TestAgent;
using ::rdma_agent::testing::TestBuffer;

std::unique_ptr<TestAgent> Agent(uint64_t epoch, int loops = 1) {
  tcp::TcpOptions options;
  options.listen = "127.0.0.1:0";
  options.client.loops = loops;
  auto agent = TestAgent::Create(
      absl::StrCat("agent-", epoch),
      [options](const BackendEnvironment& env)
          -> absl::StatusOr<std::unique_ptr<Backend>> {
        auto backend = tcp::TcpBackend::Create(options, env);
        if (!backend.ok()) return backend.status();
        return std::unique_ptr<Backend>(std::move(*backend));
      },
      epoch);
  if (!agent.ok()) {
    std::fprintf(stderr, "agent: %s\n", agent.status().ToString().c_str());
    std::exit(1);
  }
  return std::move(*agent);
}

// CPU time of the whole process (both agents), user and system.
absl::Duration ProcessCpu() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return absl::DurationFromTimeval(usage.ru_utime) +
         absl::DurationFromTimeval(usage.ru_stime);
}

double Percentile(std::vector<double> values, double p) {
  std::sort(values.begin(), values.end());
  return values[static_cast<size_t>(p *
                                    static_cast<double>(values.size() - 1))];
}

// p50 and p99 in microseconds of `iterations` calls of `call`.
std::pair<double, double> Latency(int iterations,
                                  const std::function<void()>& call) {
  for (int i = 0; i < iterations / 10; ++i) call();  // warm-up
  std::vector<double> us;
  us.reserve(static_cast<size_t>(iterations));
  for (int i = 0; i < iterations; ++i) {
    const absl::Time start = absl::Now();
    call();
    us.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
  }
  return {Percentile(us, 0.5), Percentile(us, 0.99)};
}

[[noreturn]] void Die(const absl::Status& status) {
  std::fprintf(stderr, "ping-pong: %s\n", status.ToString().c_str());
  std::exit(1);
}

// 8-byte round trips over one loopback TCP connection (the bench's own
// ping-pong peer, as compare.sh measures the floor): p50 and p99 in us.
std::pair<double, double> PingPong(int iterations) {
  auto peer = bench::StartLoopbackSocketPeer();
  if (!peer.ok()) Die(peer.status());
  auto connection = bench::PingPong::Connect(*peer);
  if (!connection.ok()) Die(connection.status());
  return Latency(iterations, [&] {
    absl::Status trip = (*connection)->RoundTrip().status();
    if (!trip.ok()) Die(trip);
  });
}

int Main(double seconds, const std::string& rows) {
  auto wanted = [&](absl::string_view row) {
    return absl::StrContains(absl::StrCat(",", rows, ","),
                             absl::StrCat(",", row, ","));
  };
  // As rdma-agentd does (daemon/main.cc): Debian's abseil checks lock order
  // on every lock, which would be measured here otherwise.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  auto a = Agent(11);
  auto b = Agent(12);
  const uint64_t kBytes = 8 << 20;
  TestBuffer local = a->Register(kBytes, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote = b->Register(kBytes, v1::ACCESS_READ_WRITE, 2);
  Backend& tcp = a->backend();

  if (wanted("latency")) {
    const auto [ping50, ping99] = PingPong(20000);
    std::vector<Op> one = {
        MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 0, 8, remote, 0)};
    const auto [read50, read99] = Latency(20000, [&] {
      if (!tcp.Submit(one, absl::Now() + absl::Seconds(10))[0].ok()) {
        std::fprintf(stderr, "8 B READ failed\n");
        std::exit(1);
      }
    });
    std::printf(
        "8 B READ  p50 %.1f us p99 %.1f us | TCP ping-pong p50 %.1f us "
        "p99 %.1f us | p50 ratio %.2f\n",
        read50, read99, ping50, ping99, read50 / ping50);
  }

  if (wanted("post")) {
    const auto [ping50, ping99] = PingPong(20000);
    // The same op posted by a client with loops and by one without, to
    // the same peer; done is awaited by spinning, so that the waiter's own
    // wake-up is not measured.
    auto workers_only = Agent(13, /*loops=*/0);
    TestBuffer local0 =
        workers_only->Register(kBytes, v1::ACCESS_READ_WRITE, 1);
    Backend& tcp0 = workers_only->backend();
    const std::vector<Op> loop_op = {
        MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local, 0, 8, remote, 0)};
    const std::vector<Op> worker_op = {
        MakeOp(0, v1::OP_TYPE_READ_INTO_LOCAL, local0, 0, 8, remote, 0)};
    auto post = [](Backend& backend, const std::vector<Op>& op) {
      std::atomic<bool> ended{false};
      bool ok = false;
      backend.Post(op, absl::Now() + absl::Seconds(10),
                   [&](std::vector<absl::Status> statuses) {
                     ok = statuses[0].ok();
                     ended.store(true, std::memory_order_release);
                   });
      while (!ended.load(std::memory_order_acquire)) {
      }
      if (!ok) {
        std::fprintf(stderr, "posted 8 B READ failed\n");
        std::exit(1);
      }
    };
    // Alternating slices of 1000, so that both see the same noise.
    std::vector<double> loop_us, worker_us;
    for (int slice = 0; slice < 20; ++slice) {
      for (auto [backend, op, us] :
           {std::make_tuple(&tcp, &loop_op, &loop_us),
            std::make_tuple(&tcp0, &worker_op, &worker_us)}) {
        const auto [p50, p99] = Latency(1000, [&] { post(*backend, *op); });
        (void)p99;
        us->push_back(p50);
      }
    }
    const double loop50 = Percentile(loop_us, 0.5);
    const double worker50 = Percentile(worker_us, 0.5);
    std::printf(
        "8 B READ Post p50 (median of 20 slices): loop %.1f us, workers "
        "%.1f us | TCP ping-pong p50 %.1f us | over the ping-pong: loop "
        "%.1f us, workers %.1f us\n",
        loop50, worker50, ping50, loop50 - ping50, worker50 - ping50);
  }

  // Ops of `size` bytes, `count` per Submit, laid out back to back (wrapping
  // within `span` bytes of both buffers): ops per second, and in `*cpu_us`
  // the process's CPU time (both agents) per op, which a busy shared
  // machine disturbs far less than the rate.
  double cpu_us = 0;
  auto rate = [&](v1::OpType type, uint64_t size, size_t count, uint64_t span,
                  const TestBuffer& from, const TestBuffer& to) -> double {
    std::vector<Op> batch;
    for (size_t i = 0; i < count; ++i) {
      const uint64_t offset = (i * size) % span;
      batch.push_back(MakeOp(i, type, from, offset, size, to, offset));
    }
    (void)tcp.Submit(batch, absl::Now() + absl::Seconds(60));  // warm-up
    uint64_t ops = 0;
    const absl::Duration cpu_start = ProcessCpu();
    const absl::Time start = absl::Now();
    while (absl::Now() - start < absl::Seconds(seconds)) {
      for (const absl::Status& status :
           tcp.Submit(batch, absl::Now() + absl::Seconds(60))) {
        if (!status.ok()) {
          std::fprintf(stderr, "%lu-byte op failed: %s\n",
                       static_cast<unsigned long>(size),
                       status.ToString().c_str());
          std::exit(1);
        }
      }
      ops += batch.size();
    }
    const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
    cpu_us = absl::ToDoubleMicroseconds(ProcessCpu() - cpu_start) /
             static_cast<double>(ops);
    return static_cast<double>(ops) / elapsed;
  };
  auto kind = [](v1::OpType type) {
    return type == v1::OP_TYPE_WRITE_FROM_LOCAL ? "WRITE" : "READ";
  };
  if (wanted("write4k")) {
    const double ops =
        rate(v1::OP_TYPE_WRITE_FROM_LOCAL, 4096, 1000, kBytes, local, remote);
    std::printf("4 KiB WRITE x1000/Submit: %.0f ops/s, CPU %.2f us/op\n", ops,
                cpu_us);
  }
  if (wanted("read4k")) {
    const double ops =
        rate(v1::OP_TYPE_READ_INTO_LOCAL, 4096, 1000, kBytes, local, remote);
    std::printf("4 KiB READ  x1000/Submit: %.0f ops/s, CPU %.2f us/op\n", ops,
                cpu_us);
  }
  if (!wanted("kv") && !wanted("kvwrite") && !wanted("kvread") &&
      !wanted("bulk") && !wanted("sizes")) {
    return 0;
  }
  constexpr uint64_t kBulk = 256 << 20;
  TestBuffer bulk_local = a->Register(kBulk, v1::ACCESS_READ_WRITE, 3);
  TestBuffer bulk_remote = b->Register(kBulk, v1::ACCESS_READ_WRITE, 4);
  for (v1::OpType type :
       {v1::OP_TYPE_WRITE_FROM_LOCAL, v1::OP_TYPE_READ_INTO_LOCAL}) {
    if (!wanted("kv") &&
        !wanted(type == v1::OP_TYPE_WRITE_FROM_LOCAL ? "kvwrite" : "kvread")) {
      continue;
    }
    const double ops =
        rate(type, 64 << 10, 256, kBulk, bulk_local, bulk_remote);
    std::printf("64 KiB %-5s x256/Submit: %.0f MiB/s, CPU %.0f us/MiB\n",
                kind(type), ops / 16.0, cpu_us * 16.0);
  }
  for (v1::OpType type :
       {v1::OP_TYPE_WRITE_FROM_LOCAL, v1::OP_TYPE_READ_INTO_LOCAL}) {
    if (!wanted("sizes")) break;
    for (uint64_t size = 16 << 10; size <= (4 << 20); size *= 4) {
      const size_t count = static_cast<size_t>((16 << 20) / size);
      const double ops =
          rate(type, size, count, kBulk, bulk_local, bulk_remote);
      std::printf("%5lu KiB %-5s x%zu/Submit: %.0f MiB/s, CPU %.0f us/MiB\n",
                  static_cast<unsigned long>(size >> 10), kind(type), count,
                  ops * static_cast<double>(size) / (1 << 20),
                  cpu_us * static_cast<double>(count) / 16.0);
    }
  }
  for (v1::OpType type :
       {v1::OP_TYPE_WRITE_FROM_LOCAL, v1::OP_TYPE_READ_INTO_LOCAL}) {
    if (!wanted("bulk")) break;
    const double ops = rate(type, kBulk, 1, kBulk, bulk_local, bulk_remote);
    std::printf("256 MiB %-5s x1/Submit: %.0f MiB/s, CPU %.0f us/MiB\n",
                kind(type), ops * 256.0, cpu_us / 256.0);
  }
  return 0;
}

}  // namespace
}  // namespace rdma_agent

int main(int argc, char** argv) {
  const std::string rows =
      argc > 2 ? argv[2] : "latency,write4k,read4k,kv,bulk";
  return rdma_agent::Main(argc > 1 ? std::atof(argv[1]) : 3.0, rows);
}
