// rdma-agent-bench: what a client of one rdma-agentd sees when it moves bytes
// to and from a second agent (tcp backend), next to the references the
// numbers are judged by. See bench/README.md for the table compare.sh makes.
//
//   rdma-agent-bench --local=unix:///tmp/a/agent.sock
//                    --remote=unix:///tmp/b/agent.sock
//                    --socket_peer=10.77.0.2:7479      # see
//                    --serve_socket_peer
//
// Registers a buffer on each agent (memfds attached by this process,
// pre-faulted), then runs --tests, each after an untimed warm-up. Prints one
// line per result: "name key=value ...".

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/agent_ops.h"
#include "bench/clients.h"
#include "bench/socket_peer.h"
#include "client/rdma_agent_client.h"
#include "client/ring.h"

ABSL_FLAG(std::string, local, "unix:///run/rdma-agentd/agent.sock",
          "gRPC target of the agent that runs the ops (agent A).");
ABSL_FLAG(std::string, remote, "",
          "gRPC target of the agent that owns the remote buffers (agent B). "
          "Its Unix socket is a file: it is reachable from any network "
          "namespace.");
ABSL_FLAG(std::string, socket_peer, "",
          "ipv4:port of a `rdma-agent-bench --serve_socket_peer` on agent B's "
          "host, for the TCP round trip of the latency floor and the socket "
          "references. Empty: one started in this process on loopback.");
ABSL_FLAG(std::string, serve_socket_peer, "",
          "Serve ping-pong and sink connections on this ipv4:port until "
          "killed, and do nothing else (run it on agent B's host).");
ABSL_FLAG(bool, client_child, false,
          "Internal: one of the processes of the `clients` test.");
ABSL_FLAG(std::string, tests,
          "latency,ops,async,kv,bulk,memory,prepared,ring,ring_tcp,register,"
          "clients,socket",
          "Comma-separated tests to run (see bench/README.md); `info` alone "
          "only prints agent A's tcp settings (every run prints them).");
ABSL_FLAG(double, seconds, 2.0,
          "Length of each throughput measurement, in seconds.");
ABSL_FLAG(int, latency_iterations, 5000,
          "Timed round trips of each kind in `latency` (after the warm-up).");
ABSL_FLAG(int, warmup_iterations, 500,
          "Untimed round trips of each kind before `latency` measures.");
ABSL_FLAG(uint64_t, latency_bytes, 8, "Bytes of the latency ops.");
ABSL_FLAG(std::string, latency_kinds,
          "getinfo,tcp_rtt,read,write,submit_rejected,mem_write",
          "Round trips `latency` times (all of them for the floor line), "
          "e.g. one alone under perf.");
ABSL_FLAG(uint64_t, small_op_bytes, 4096,
          "Bytes per op of ops/memory/clients.");
ABSL_FLAG(int, small_batch, 1000, "Ops per Submit of ops/memory/clients.");
ABSL_FLAG(uint64_t, kv_op_bytes, 64 << 10, "Bytes per op of kv.");
ABSL_FLAG(int, kv_batch, 256, "Ops per Submit of kv.");
ABSL_FLAG(uint64_t, size, 256ull << 20,
          "Bytes of the bulk op, and of each registered buffer.");
ABSL_FLAG(uint64_t, prepared_op_bytes, 64, "Bytes per op of prepared.");
ABSL_FLAG(int, prepared_batch, 256, "Ops per Submit of prepared.");
ABSL_FLAG(int, ring_batch, 256,
          "Ops per ring batch (and per Submit beside it) of ring_tcp's op "
          "rate; 4 batches are kept in flight.");
ABSL_FLAG(int, ring_spin_us, 20,
          "How long ring_tcp's client spins for a completion before it "
          "blocks on the session (Ring::Wait's spin), in microseconds.");
ABSL_FLAG(int, clients, 8, "Client processes of `clients`.");
ABSL_FLAG(int, streams, 0,
          "Connections of the socket references; 0: agent A's "
          "tcp connections_per_peer.");
ABSL_FLAG(int, socket_passes, 8,
          "The socket references move --size bytes this many times.");

namespace rdma_agent::bench {
namespace {

using client::AgentClient;
using client::Buffer;
using client::OpSpec;

// Everything the tests run against.
struct Setup {
  std::unique_ptr<AgentClient> local_agent;
  std::unique_ptr<AgentClient> remote_agent;
  std::unique_ptr<Buffer> local;   // on agent A
  std::unique_ptr<Buffer> remote;  // on agent B
  std::string socket_peer;         // ip:port of the socket peer
  int connections_per_peer = 0;    // agent A's tcp setting
};

absl::Duration Seconds() { return absl::Seconds(absl::GetFlag(FLAGS_seconds)); }

void Print(const Report& report) {
  std::printf("%s\n", report.Line().c_str());
  std::fflush(stdout);
}

absl::StatusOr<Buffer> AttachPrefaulted(AgentClient& agent, uint64_t bytes,
                                        char fill) {
  auto buffer = agent.Attach(bytes, v1::ACCESS_READ_WRITE, "bench");
  if (!buffer.ok()) return buffer.status();
  for (uint64_t i = 0; i < bytes; i += 4096) {
    buffer->data()[i] = std::byte{static_cast<uint8_t>(fill)};
  }
  return buffer;
}

// Agent A's tcp settings, printed for the record ("info" line).
absl::StatusOr<int> ReportInfo(AgentClient& agent) {
  auto info = agent.GetInfo();
  if (!info.ok()) return info.status();
  Report report("info");
  int connections = 0;
  std::vector<std::string> backends;
  for (const v1::BackendInfo& backend : info->backends()) {
    if (backend.available()) backends.push_back(backend.name());
    if (backend.name() != "tcp") continue;
    for (const auto& [key, value] : backend.transport_info().attributes()) {
      report.Add(absl::StrCat("tcp_", key), value);
      if (key == "connections_per_peer")
        (void)absl::SimpleAtoi(value, &connections);
    }
  }
  report.Add("backends", absl::StrJoin(backends, ","));
  report.Add("version", info->version());
  Print(report);
  if (connections <= 0) {
    return absl::FailedPreconditionError("agent A has no tcp backend");
  }
  return connections;
}

// ---- latency: one op per Submit, next to its floor -------------------------

// Named kinds of one timed call.
using TimedKinds =
    std::vector<std::pair<std::string, std::function<absl::Status()>>>;

// Times --latency_iterations calls of each kind `timed` keeps (all when
// unset) after --warmup_iterations, interleaved in blocks of 100 so that a
// noisy moment of a shared machine hits every kind alike: one summary per
// kind, in order (a kind left out has no samples). The first failed call
// ends it.
absl::StatusOr<std::vector<Latency>> TimeInterleaved(
    const TimedKinds& kinds,
    const std::function<bool(size_t)>& timed = nullptr) {
  std::vector<std::vector<absl::Duration>> samples(kinds.size());
  const int iterations = absl::GetFlag(FLAGS_latency_iterations);
  const int warmup = absl::GetFlag(FLAGS_warmup_iterations);
  constexpr int kBlock = 100;
  for (int done = -warmup; done < iterations; done += kBlock) {
    for (size_t k = 0; k < kinds.size(); ++k) {
      if (timed && !timed(k)) continue;
      for (int i = done; i < std::min(done + kBlock, iterations); ++i) {
        const absl::Time start = absl::Now();
        if (absl::Status s = kinds[k].second(); !s.ok()) return s;
        if (i >= 0) samples[k].push_back(absl::Now() - start);
      }
    }
  }
  std::vector<Latency> latency;
  for (std::vector<absl::Duration>& kind : samples) {
    latency.push_back(Summarize(std::move(kind)));
  }
  return latency;
}

// One timed call of each kind; interleaved in blocks so that a noisy moment
// of a shared machine hits every kind alike. The floor is GetInfo (a gRPC
// unary call to agent A) plus one TCP round trip to B's host; the rejected
// Submit and the memory-backend op split the rest into the Submit machinery
// and the tcp data plane.
absl::Status TestLatency(Setup& setup) {
  const uint64_t bytes = absl::GetFlag(FLAGS_latency_bytes);
  auto ping = PingPong::Connect(setup.socket_peer);
  if (!ping.ok()) return ping.status();
  const auto read =
      MakeOps(v1::OP_TYPE_READ_INTO_LOCAL, setup.local->id(),
              setup.remote->remote_context(), bytes, 1, bytes, bytes);
  const auto write =
      MakeOps(v1::OP_TYPE_WRITE_FROM_LOCAL, setup.local->id(),
              setup.remote->remote_context(), bytes, 1, bytes, bytes);
  AgentClient& agent = *setup.local_agent;
  // For the breakdown: the same op between two buffers of agent A (memory
  // backend), and a Submit whose op the agent rejects before any backend
  // sees it (length 0: INVALID_ARGUMENT in the op's result).
  auto other = AttachPrefaulted(agent, 4096, 3);
  if (!other.ok()) return other.status();
  const auto memory_write =
      MakeOps(v1::OP_TYPE_WRITE_FROM_LOCAL, setup.local->id(),
              other->remote_context(), bytes, 1, bytes, bytes);
  auto rejected = write;
  rejected.front().length = 0;
  auto submit_rejected = [&]() -> absl::Status {
    auto results = agent.Submit(rejected, absl::Seconds(120));
    if (!results.ok()) return results.status();
    if (!absl::IsInvalidArgument(results->front().status)) {
      return absl::InternalError("an op of length 0 was not rejected");
    }
    return absl::OkStatus();
  };
  const TimedKinds kinds = {
      {"lat_getinfo", [&] { return agent.GetInfo().status(); }},
      {"lat_tcp_rtt", [&] { return (*ping)->RoundTrip().status(); }},
      {"lat_read", [&] { return RunBatch(agent, read, "tcp"); }},
      {"lat_write", [&] { return RunBatch(agent, write, "tcp"); }},
      {"lat_submit_rejected", submit_rejected},
      {"lat_mem_write",
       [&] { return RunBatch(agent, memory_write, "memory"); }},
  };
  const std::vector<std::string> wanted = absl::StrSplit(
      absl::GetFlag(FLAGS_latency_kinds), ',', absl::SkipEmpty());
  auto timed = [&](size_t k) {
    return std::find(wanted.begin(), wanted.end(), kinds[k].first.substr(4)) !=
           wanted.end();
  };
  absl::StatusOr<std::vector<Latency>> timings = TimeInterleaved(kinds, timed);
  if (!timings.ok()) return timings.status();
  const std::vector<Latency>& latency = *timings;
  for (size_t k = 0; k < kinds.size(); ++k) {
    if (!timed(k)) continue;
    Report report(kinds[k].first);
    if (k >= 2 && k != 4) report.Add("bytes", static_cast<double>(bytes), 0);
    Print(report.AddLatency("", latency[k]));
  }
  if (!timed(0) || !timed(1) || !timed(2) || !timed(3)) return absl::OkStatus();
  const double floor = latency[0].p50_us + latency[1].p50_us;
  Print(Report("lat_floor")
            .Add("p50_us", floor)
            .Add("read_ratio", latency[2].p50_us / floor, 2)
            .Add("write_ratio", latency[3].p50_us / floor, 2));
  return absl::OkStatus();
}

// ---- throughput of batches --------------------------------------------------

// Runs `ops` as one Submit after one untimed one, for --seconds.
absl::Status MeasureBatches(const std::string& name, AgentClient& agent,
                            const std::vector<OpSpec>& ops,
                            const std::string& backend) {
  if (absl::Status s = RunBatch(agent, ops, backend); !s.ok()) return s;
  auto timed =
      RunFor(Seconds(), 2, [&] { return RunBatch(agent, ops, backend); });
  if (!timed.ok()) return timed.status();
  const double seconds = absl::ToDoubleSeconds(timed->elapsed);
  const double count = static_cast<double>(timed->steps * ops.size());
  const double bytes = count * static_cast<double>(ops.front().length);
  Print(Report(name)
            .Add("ops_per_s", count / seconds, 0)
            .Add("MiB_per_s", bytes / seconds / (1 << 20))
            .Add("op_bytes", static_cast<double>(ops.front().length), 0)
            .Add("batch", static_cast<double>(ops.size()), 0)
            .Add("submits", static_cast<double>(timed->steps), 0)
            .Add("seconds", seconds, 3)
            .Add("backend", backend));
  return absl::OkStatus();
}

// WRITE then READ of `count` ops of `op_bytes` per Submit, over tcp.
absl::Status TestBatches(Setup& setup, const std::string& prefix,
                         uint64_t op_bytes, int count) {
  const uint64_t window = op_bytes * count;
  for (const auto& [suffix, type] :
       {std::pair<std::string, v1::OpType>{"_write",
                                           v1::OP_TYPE_WRITE_FROM_LOCAL},
        std::pair<std::string, v1::OpType>{"_read",
                                           v1::OP_TYPE_READ_INTO_LOCAL}}) {
    const auto ops =
        MakeOps(type, setup.local->id(), setup.remote->remote_context(),
                op_bytes, count, window, setup.local->size());
    if (absl::Status s =
            MeasureBatches(prefix + suffix, *setup.local_agent, ops, "tcp");
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status TestOps(Setup& setup) {
  return TestBatches(setup, "ops", absl::GetFlag(FLAGS_small_op_bytes),
                     absl::GetFlag(FLAGS_small_batch));
}

absl::Status TestKv(Setup& setup) {
  return TestBatches(setup, "kv", absl::GetFlag(FLAGS_kv_op_bytes),
                     absl::GetFlag(FLAGS_kv_batch));
}

absl::Status TestBulk(Setup& setup) {
  return TestBatches(setup, "bulk", setup.local->size(), 1);
}

// Asynchronous transfers of --small_batch WRITEs of --small_op_bytes over
// tcp, 8 kept in flight for --seconds: the oldest is waited for and
// replaced, so the agent always has the next transfers queued.
absl::Status TestAsync(Setup& setup) {
  constexpr size_t kInFlight = 8;
  const uint64_t op_bytes = absl::GetFlag(FLAGS_small_op_bytes);
  const int count = absl::GetFlag(FLAGS_small_batch);
  const auto ops = MakeOps(v1::OP_TYPE_WRITE_FROM_LOCAL, setup.local->id(),
                           setup.remote->remote_context(), op_bytes, count,
                           op_bytes * count, setup.local->size());
  AgentClient& agent = *setup.local_agent;
  const auto finish = [](client::Transfer& transfer) -> absl::Status {
    auto result = transfer.Wait(absl::Seconds(120));
    if (!result.ok()) return result.status();
    for (const client::OpResult& op : result->results) {
      if (!op.status.ok()) return op.status;
      if (op.backend != "tcp") {
        return absl::FailedPreconditionError(
            absl::StrCat("op ran on ", op.backend, ", not tcp"));
      }
    }
    return result->ok() ? absl::OkStatus()
                        : absl::InternalError(absl::StrCat(
                              "transfer ended ",
                              client::TransferStateName(result->state)));
  };
  std::deque<client::Transfer> in_flight;
  const auto submit = [&]() -> absl::Status {
    auto transfer = agent.SubmitAsync(ops, absl::Seconds(120));
    if (!transfer.ok()) return transfer.status();
    in_flight.push_back(std::move(*transfer));
    return absl::OkStatus();
  };
  // Untimed warm-up: kInFlight transfers, all finished.
  for (size_t i = 0; i < kInFlight; ++i) {
    if (absl::Status s = submit(); !s.ok()) return s;
  }
  for (; !in_flight.empty(); in_flight.pop_front()) {
    if (absl::Status s = finish(in_flight.front()); !s.ok()) return s;
  }
  uint64_t done = 0;
  const absl::Time start = absl::Now();
  while (absl::Now() - start < Seconds()) {
    if (in_flight.size() == kInFlight) {
      if (absl::Status s = finish(in_flight.front()); !s.ok()) return s;
      in_flight.pop_front();
      ++done;
    }
    if (absl::Status s = submit(); !s.ok()) return s;
  }
  for (; !in_flight.empty(); in_flight.pop_front(), ++done) {
    if (absl::Status s = finish(in_flight.front()); !s.ok()) return s;
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const double ops_done = static_cast<double>(done) * count;
  Print(Report("async_write")
            .Add("ops_per_s", ops_done / seconds, 0)
            .Add("MiB_per_s",
                 ops_done * static_cast<double>(op_bytes) / seconds / (1 << 20))
            .Add("op_bytes", static_cast<double>(op_bytes), 0)
            .Add("batch", static_cast<double>(count), 0)
            .Add("in_flight", static_cast<double>(kInFlight), 0)
            .Add("transfers", static_cast<double>(done), 0)
            .Add("seconds", seconds, 3)
            .Add("backend", "tcp"));
  return absl::OkStatus();
}

// Both buffers on agent A: the memory backend.
absl::Status TestMemory(Setup& setup) {
  const uint64_t op_bytes = absl::GetFlag(FLAGS_small_op_bytes);
  const int count = absl::GetFlag(FLAGS_small_batch);
  auto other = AttachPrefaulted(*setup.local_agent, op_bytes * count, 3);
  if (!other.ok()) return other.status();
  const auto ops =
      MakeOps(v1::OP_TYPE_WRITE_FROM_LOCAL, setup.local->id(),
              other->remote_context(), op_bytes, count, op_bytes * count,
              std::min(setup.local->size(), other->size()));
  return MeasureBatches("mem_write", *setup.local_agent, ops, "memory");
}

// ---- prepared transfers and imported remotes, memory backend ----------------

// What the prepared tests run: --prepared_batch WRITEs of
// --prepared_op_bytes from agent A's local buffer into `other`, a buffer of
// agent A made for them, each carrying its context.
struct PreparedOps {
  Buffer other;
  std::vector<OpSpec> with_contexts;
};

absl::StatusOr<PreparedOps> MakePreparedOps(Setup& setup) {
  const uint64_t op_bytes = absl::GetFlag(FLAGS_prepared_op_bytes);
  const int count = absl::GetFlag(FLAGS_prepared_batch);
  auto other = AttachPrefaulted(*setup.local_agent, op_bytes * count, 3);
  if (!other.ok()) return other.status();
  std::vector<OpSpec> ops =
      MakeOps(v1::OP_TYPE_WRITE_FROM_LOCAL, setup.local->id(),
              other->remote_context(), op_bytes, count, op_bytes * count,
              std::min(setup.local->size(), other->size()));
  return PreparedOps{std::move(*other), std::move(ops)};
}

// The same --prepared_batch WRITEs of --prepared_op_bytes between two
// buffers of agent A, three ways: every op carrying its remote context in
// each Submit, every op naming an imported handle, and one prepared
// transfer run by id. Alternating 100 ms slices, so all see the same noise.
absl::Status TestPrepared(Setup& setup) {
  AgentClient& agent = *setup.local_agent;
  const uint64_t op_bytes = absl::GetFlag(FLAGS_prepared_op_bytes);
  const int count = absl::GetFlag(FLAGS_prepared_batch);
  auto made = MakePreparedOps(setup);
  if (!made.ok()) return made.status();
  const Buffer* other = &made->other;
  const std::vector<OpSpec>& with_contexts = made->with_contexts;
  auto handle = agent.ImportRemote(other->remote_context());
  if (!handle.ok()) return handle.status();
  std::vector<OpSpec> with_handles = with_contexts;
  for (OpSpec& op : with_handles) {
    op.remote_context.clear();
    op.remote_handle = handle->handle;
  }
  auto prepared = agent.PrepareTransfer(with_contexts);
  if (!prepared.ok()) return prepared.status();
  auto run_prepared = [&]() -> absl::Status {
    auto result = agent.SubmitPrepared(*prepared);
    if (!result.ok()) return result.status();
    if (result->results.size() != with_contexts.size()) {
      return absl::InternalError("prepared: wrong number of results");
    }
    for (const client::OpResult& op : result->results) {
      if (!op.status.ok()) return op.status;
      if (op.backend != "memory") {
        return absl::InternalError("prepared: an op ran on " + op.backend);
      }
    }
    return absl::OkStatus();
  };
  const std::vector<std::pair<std::string, std::function<absl::Status()>>>
      ways = {
          {"contexts",
           [&] { return RunBatch(agent, with_contexts, "memory"); }},
          {"handles", [&] { return RunBatch(agent, with_handles, "memory"); }},
          {"prepared", run_prepared},
      };
  std::vector<Timed> timed(ways.size());
  for (const auto& way : ways) {
    for (int i = 0; i < 20; ++i) {
      if (absl::Status s = way.second(); !s.ok()) return s;
    }
  }
  const absl::Duration slice = absl::Milliseconds(100);
  for (absl::Duration spent; spent < Seconds();
       spent += slice * static_cast<int64_t>(ways.size())) {
    for (size_t i = 0; i < ways.size(); ++i) {
      auto run = RunFor(slice, 1, ways[i].second);
      if (!run.ok()) return run.status();
      timed[i].steps += run->steps;
      timed[i].elapsed += run->elapsed;
    }
  }
  std::vector<double> rates;
  for (size_t i = 0; i < ways.size(); ++i) {
    rates.push_back(static_cast<double>(timed[i].steps * count) /
                    absl::ToDoubleSeconds(timed[i].elapsed));
    Print(Report(absl::StrCat("prepared_", ways[i].first))
              .Add("ops_per_s", rates.back(), 0)
              .Add("submits_per_s", rates.back() / count, 0)
              .Add("op_bytes", static_cast<double>(op_bytes), 0)
              .Add("batch", static_cast<double>(count), 0)
              .Add("backend", "memory"));
  }
  Print(Report("prepared_ratio")
            .Add("prepared_vs_contexts", rates[2] / rates[0], 2)
            .Add("handles_vs_contexts", rates[1] / rates[0], 2));
  (void)agent.ReleasePrepared(*prepared);
  (void)agent.ReleaseRemote(handle->handle);
  return absl::OkStatus();
}

// ---- the shared-memory ring, memory backend ---------------------------------

// Waits (spinning up to `spin`) until at least `count` completions of `ring`
// have been read; each must be OK and run by `backend`. Returns how many
// were read.
absl::StatusOr<size_t> ReapRing(client::Ring& ring, size_t count,
                                absl::Duration spin, const std::string& backend,
                                std::vector<client::RingCompletion>& ends) {
  size_t got = 0;
  while (got < count) {
    ends.clear();
    auto reaped = ring.Wait(&ends, absl::Seconds(120), spin);
    if (!reaped.ok()) return reaped.status();
    for (const client::RingCompletion& end : ends) {
      if (!end.status.ok()) return end.status;
      if (end.backend != backend) {
        return absl::InternalError("ring: an op ran on " + end.backend);
      }
    }
    got += *reaped;
  }
  return got;
}

// One slice of a ring's op rate: keeps `in_flight` batches of `ops` posted
// (whenever a batch's worth of room is free another is posted) for
// `length`, then waits for what is in flight. Counts ops (Timed::steps).
absl::StatusOr<Timed> RingSlice(client::Ring& ring,
                                const std::vector<client::RingOp>& ops,
                                int in_flight, absl::Duration length,
                                absl::Duration spin,
                                const std::string& backend) {
  Timed timed;
  std::vector<client::RingCompletion> ends;
  const uint32_t batch = static_cast<uint32_t>(ops.size());
  const absl::Time start = absl::Now();
  auto fill = [&]() -> absl::Status {
    while (ring.in_flight() + batch <= batch * in_flight) {
      if (absl::Status s = ring.Submit(ops); !s.ok()) return s;
    }
    return absl::OkStatus();
  };
  if (absl::Status s = fill(); !s.ok()) return s;
  while (absl::Now() - start < length) {
    auto got = ReapRing(ring, batch, spin, backend, ends);
    if (!got.ok()) return got.status();
    timed.steps += static_cast<int64_t>(*got);
    if (absl::Status s = fill(); !s.ok()) return s;
  }
  auto rest = ReapRing(ring, ring.in_flight(), spin, backend, ends);
  if (!rest.ok()) return rest.status();
  timed.steps += static_cast<int64_t>(*rest);
  timed.elapsed = absl::Now() - start;
  return timed;
}

// `first` and `second` in alternating 100 ms slices for --seconds, so that
// both see the same noise; each called once untimed first.
template <typename First, typename Second>
absl::Status Alternate(First first, Second second, Timed& by_first,
                       Timed& by_second) {
  if (auto warm = first(absl::ZeroDuration()); !warm.ok()) {
    return warm.status();
  }
  if (auto warm = second(absl::ZeroDuration()); !warm.ok()) {
    return warm.status();
  }
  const absl::Duration slice = absl::Milliseconds(100);
  for (absl::Duration spent; spent < Seconds(); spent += 2 * slice) {
    auto a = first(slice);
    if (!a.ok()) return a.status();
    auto b = second(slice);
    if (!b.ok()) return b.status();
    by_first.steps += a->steps;
    by_first.elapsed += a->elapsed;
    by_second.steps += b->steps;
    by_second.elapsed += b->elapsed;
  }
  return absl::OkStatus();
}

double Rate(const Timed& timed) {
  return static_cast<double>(timed.steps) /
         absl::ToDoubleSeconds(timed.elapsed);
}

// Ring batches kept in flight by the op-rate tests (a ring of 4 batches).
constexpr int kRingBatchesInFlight = 4;

// A ring's op rate beside the same run's Submits: `ring_ops` as one ring
// batch, kRingBatchesInFlight of them kept posted, against Submits of
// `submit_ops` (the same ops), in alternating 100 ms slices; prints the
// `prefix`_submit_write, `prefix`_write and `prefix`_ratio lines.
absl::Status CompareOpRates(AgentClient& agent, client::Ring& ring,
                            const std::vector<client::RingOp>& ring_ops,
                            const std::vector<OpSpec>& submit_ops,
                            absl::Duration spin, const std::string& backend,
                            const std::string& prefix) {
  const int batch = static_cast<int>(ring_ops.size());
  const uint64_t op_bytes = ring_ops.front().length;
  auto ring_slice = [&](absl::Duration length) {
    return RingSlice(ring, ring_ops, kRingBatchesInFlight, length, spin,
                     backend);
  };
  auto submit_slice = [&](absl::Duration length) -> absl::StatusOr<Timed> {
    auto run =
        RunFor(length, 1, [&] { return RunBatch(agent, submit_ops, backend); });
    if (run.ok()) run->steps *= batch;  // ops
    return run;
  };
  Timed by_ring, by_submit;
  if (absl::Status s = Alternate(submit_slice, ring_slice, by_submit, by_ring);
      !s.ok()) {
    return s;
  }
  for (const auto& [name, timed] :
       {std::pair<std::string, Timed>{prefix + "_submit_write", by_submit},
        std::pair<std::string, Timed>{prefix + "_write", by_ring}}) {
    Print(Report(name)
              .Add("ops_per_s", Rate(timed), 0)
              .Add("MiB_per_s",
                   Rate(timed) * static_cast<double>(op_bytes) / (1 << 20))
              .Add("op_bytes", static_cast<double>(op_bytes), 0)
              .Add("batch", batch, 0)
              .Add("backend", backend));
  }
  Print(Report(prefix + "_ratio")
            .Add("ring_vs_submit", Rate(by_ring) / Rate(by_submit), 2));
  return absl::OkStatus();
}

// --small_op_bytes WRITEs between two buffers of agent A, --ring_batch per
// ring batch with 4 batches in flight, next to Submits of the same ops
// (contexts), in alternating 100 ms slices.
absl::Status TestRingMemoryOps(Setup& setup) {
  AgentClient& agent = *setup.local_agent;
  const uint64_t op_bytes = absl::GetFlag(FLAGS_small_op_bytes);
  const int batch = std::max(1, absl::GetFlag(FLAGS_ring_batch));
  const uint64_t window = op_bytes * batch;
  auto other = AttachPrefaulted(agent, window, 3);
  if (!other.ok()) return other.status();
  auto handle = agent.ImportRemote(other->remote_context());
  if (!handle.ok()) return handle.status();
  uint32_t entries = 1;
  while (entries < static_cast<uint32_t>(batch * kRingBatchesInFlight)) {
    entries *= 2;
  }
  auto ring = agent.OpenRing(entries);
  if (!ring.ok()) return ring.status();
  const auto submit_ops = MakeOps(
      v1::OP_TYPE_WRITE_FROM_LOCAL, setup.local->id(), other->remote_context(),
      op_bytes, batch, window, std::min(setup.local->size(), other->size()));
  std::vector<client::RingOp> ring_ops(batch);
  for (int i = 0; i < batch; ++i) {
    ring_ops[i].type = v1::OP_TYPE_WRITE_FROM_LOCAL;
    ring_ops[i].local_buffer_id = setup.local->id();
    ring_ops[i].local_offset = submit_ops[i].local_offset;
    ring_ops[i].length = op_bytes;
    ring_ops[i].remote_handle = handle->handle;
    ring_ops[i].remote_offset = submit_ops[i].remote_offset;
    ring_ops[i].user_tag = static_cast<uint64_t>(i);
  }
  if (absl::Status s =
          CompareOpRates(agent, **ring, ring_ops, submit_ops,
                         absl::Milliseconds(1), "memory", "ring_mem_ops");
      !s.ok()) {
    return s;
  }
  (void)agent.ReleaseRemote(handle->handle);
  return absl::OkStatus();
}

// A prepared transfer of --prepared_batch WRITEs of --prepared_op_bytes
// between two buffers of agent A, run by one RUN_PREPARED ring entry (post,
// spin for its completion) next to Submits of the same ops with their
// contexts, in alternating 100 ms slices (as `prepared`'s ratio).
absl::Status TestRingPrepared(Setup& setup) {
  AgentClient& agent = *setup.local_agent;
  const uint64_t op_bytes = absl::GetFlag(FLAGS_prepared_op_bytes);
  const int count = absl::GetFlag(FLAGS_prepared_batch);
  auto made = MakePreparedOps(setup);
  if (!made.ok()) return made.status();
  const std::vector<OpSpec>& with_contexts = made->with_contexts;
  auto prepared = agent.PrepareTransfer(with_contexts);
  if (!prepared.ok()) return prepared.status();
  auto ring = agent.OpenRing(8);
  if (!ring.ok()) return ring.status();
  std::vector<client::RingCompletion> ends;
  auto ring_slice = [&](absl::Duration length) {
    return RunFor(length, 1, [&]() -> absl::Status {
      if (absl::Status s = (*ring)->RunPrepared(*prepared, 1); !s.ok()) {
        return s;
      }
      return ReapRing(**ring, 1, absl::Milliseconds(1), "memory", ends)
          .status();
    });
  };
  auto submit_slice = [&](absl::Duration length) {
    return RunFor(length, 1,
                  [&] { return RunBatch(agent, with_contexts, "memory"); });
  };
  Timed by_ring, by_submit;
  if (absl::Status s = Alternate(submit_slice, ring_slice, by_submit, by_ring);
      !s.ok()) {
    return s;
  }
  for (const auto& [name, timed] :
       {std::pair<std::string, Timed>{"ring_prepared_submit_contexts",
                                      by_submit},
        std::pair<std::string, Timed>{"ring_prepared", by_ring}}) {
    Print(Report(name)
              .Add("ops_per_s", Rate(timed) * count, 0)
              .Add("op_bytes", static_cast<double>(op_bytes), 0)
              .Add("batch", count, 0)
              .Add("backend", "memory"));
  }
  Print(Report("ring_prepared_ratio")
            .Add("ring_prepared_vs_contexts", Rate(by_ring) / Rate(by_submit),
                 2));
  (void)agent.ReleasePrepared(*prepared);
  return absl::OkStatus();
}

// One --latency_bytes WRITE between two buffers of agent A through a ring
// session (post one entry, spin for its completion), next to the same op by
// Submit and to GetInfo, interleaved in blocks as `latency` is.
absl::Status TestRing(Setup& setup) {
  AgentClient& agent = *setup.local_agent;
  const uint64_t bytes = absl::GetFlag(FLAGS_latency_bytes);
  auto other = AttachPrefaulted(agent, 4096, 3);
  if (!other.ok()) return other.status();
  auto handle = agent.ImportRemote(other->remote_context());
  if (!handle.ok()) return handle.status();
  auto ring = agent.OpenRing(64);
  if (!ring.ok()) return ring.status();
  const auto memory_write =
      MakeOps(v1::OP_TYPE_WRITE_FROM_LOCAL, setup.local->id(),
              other->remote_context(), bytes, 1, bytes, bytes);
  client::RingOp op;
  op.type = v1::OP_TYPE_WRITE_FROM_LOCAL;
  op.local_buffer_id = setup.local->id();
  op.length = bytes;
  op.remote_handle = handle->handle;
  std::vector<client::RingCompletion> ends;
  auto ring_write = [&]() -> absl::Status {
    ends.clear();
    if (absl::Status s = (*ring)->Submit({&op, 1}); !s.ok()) return s;
    auto got = (*ring)->Wait(&ends, absl::Seconds(120),
                             /*spin=*/absl::Milliseconds(1));
    if (!got.ok()) return got.status();
    if (!ends.front().status.ok()) return ends.front().status;
    if (ends.front().backend != "memory") {
      return absl::InternalError("ring: the op ran on " + ends.front().backend);
    }
    return absl::OkStatus();
  };
  const TimedKinds kinds = {
      {"ring_getinfo", [&] { return agent.GetInfo().status(); }},
      {"ring_submit_mem_write",
       [&] { return RunBatch(agent, memory_write, "memory"); }},
      {"ring_mem_write", ring_write},
  };
  absl::StatusOr<std::vector<Latency>> timings = TimeInterleaved(kinds);
  if (!timings.ok()) return timings.status();
  const std::vector<Latency>& latency = *timings;
  for (size_t k = 0; k < kinds.size(); ++k) {
    Report report(kinds[k].first);
    if (k > 0) report.Add("bytes", static_cast<double>(bytes), 0);
    Print(report.AddLatency("", latency[k]));
  }
  Print(Report("ring_ratio")
            .Add("submit_vs_ring", latency[1].p50_us / latency[2].p50_us, 2)
            .Add("getinfo_vs_ring", latency[0].p50_us / latency[2].p50_us, 2));
  (void)agent.ReleaseRemote(handle->handle);
  if (absl::Status s = TestRingMemoryOps(setup); !s.ok()) return s;
  return TestRingPrepared(setup);
}

// ---- the shared-memory ring, tcp backend across the two agents --------------

// Ring ops of agent A's client against agent B's buffer (an imported handle,
// which the caller releases), each checked: OK and run by tcp.
class TcpRing {
 public:
  static absl::StatusOr<TcpRing> Open(Setup& setup, uint32_t entries) {
    auto handle =
        setup.local_agent->ImportRemote(setup.remote->remote_context());
    if (!handle.ok()) return handle.status();
    auto ring = setup.local_agent->OpenRing(entries);
    if (!ring.ok()) return ring.status();
    return TcpRing(handle->handle, std::move(*ring));
  }

  uint64_t handle() const { return handle_; }

  // `count` ops of `op_bytes`, cycling through the first `window` bytes.
  std::vector<client::RingOp> Ops(v1::OpType type, uint64_t local_id,
                                  uint64_t op_bytes, int count,
                                  uint64_t window) const {
    std::vector<client::RingOp> ops(count);
    for (int i = 0; i < count; ++i) {
      const uint64_t offset = (uint64_t{static_cast<uint64_t>(i)} * op_bytes) %
                              std::max(window, op_bytes);
      ops[i].type = type;
      ops[i].local_buffer_id = local_id;
      ops[i].local_offset = offset;
      ops[i].length = op_bytes;
      ops[i].remote_handle = handle_;
      ops[i].remote_offset = offset;
      ops[i].user_tag = static_cast<uint64_t>(i);
    }
    return ops;
  }

  client::Ring& ring() { return *ring_; }

  // Waits (spinning up to `spin`) until at least `count` completions have
  // been read; each must be OK on tcp. Returns how many were read.
  absl::StatusOr<size_t> Reap(size_t count, absl::Duration spin) {
    return ReapRing(*ring_, count, spin, "tcp", ends_);
  }

 private:
  TcpRing(uint64_t handle, std::unique_ptr<client::Ring> ring)
      : handle_(handle), ring_(std::move(ring)) {}

  uint64_t handle_ = 0;
  std::unique_ptr<client::Ring> ring_;
  std::vector<client::RingCompletion> ends_;
};

// Two figures of the ring over tcp, each beside the same run's Submit:
// - one --latency_bytes READ and WRITE to agent B through the ring (post one
//   entry, spin --ring_spin_us for its completion, then block), next to the
//   TCP round trip and the same WRITE by Submit (interleaved in blocks, as
//   `latency` is);
// - --small_op_bytes WRITEs, --ring_batch per batch with 4 batches in
//   flight, next to Submits of the same --ring_batch ops (contexts), in
//   alternating 100 ms slices so that both see the same noise.
absl::Status TestRingTcp(Setup& setup) {
  AgentClient& agent = *setup.local_agent;
  const uint64_t bytes = absl::GetFlag(FLAGS_latency_bytes);
  const uint64_t op_bytes = absl::GetFlag(FLAGS_small_op_bytes);
  const int batch = std::max(1, absl::GetFlag(FLAGS_ring_batch));
  uint32_t entries = 1;
  while (entries < static_cast<uint32_t>(batch * kRingBatchesInFlight)) {
    entries *= 2;
  }
  auto opened = TcpRing::Open(setup, entries);
  if (!opened.ok()) return opened.status();
  TcpRing& ring = *opened;
  const absl::Duration spin =
      absl::Microseconds(absl::GetFlag(FLAGS_ring_spin_us));
  auto ping = PingPong::Connect(setup.socket_peer);
  if (!ping.ok()) return ping.status();

  // Latency.
  const auto submit_write =
      MakeOps(v1::OP_TYPE_WRITE_FROM_LOCAL, setup.local->id(),
              setup.remote->remote_context(), bytes, 1, bytes, bytes);
  const auto ring_read =
      ring.Ops(v1::OP_TYPE_READ_INTO_LOCAL, setup.local->id(), bytes, 1, bytes);
  const auto ring_write = ring.Ops(v1::OP_TYPE_WRITE_FROM_LOCAL,
                                   setup.local->id(), bytes, 1, bytes);
  auto one = [&](const std::vector<client::RingOp>& op) -> absl::Status {
    if (absl::Status s = ring.ring().Submit(op); !s.ok()) return s;
    return ring.Reap(1, spin).status();
  };
  const TimedKinds kinds = {
      {"ring_tcp_rtt", [&] { return (*ping)->RoundTrip().status(); }},
      {"ring_submit_tcp_write",
       [&] { return RunBatch(agent, submit_write, "tcp"); }},
      {"ring_tcp_write", [&] { return one(ring_write); }},
      {"ring_tcp_read", [&] { return one(ring_read); }},
  };
  absl::StatusOr<std::vector<Latency>> timings = TimeInterleaved(kinds);
  if (!timings.ok()) return timings.status();
  const std::vector<Latency>& latency = *timings;
  for (size_t k = 0; k < kinds.size(); ++k) {
    Report report(kinds[k].first);
    if (k > 0) report.Add("bytes", static_cast<double>(bytes), 0);
    Print(report.AddLatency("", latency[k]));
  }
  Print(
      Report("ring_tcp_ratio")
          .Add("submit_vs_ring_write", latency[1].p50_us / latency[2].p50_us, 2)
          .Add("ring_read_minus_rtt_us",
               latency[3].p50_us - latency[0].p50_us));

  // Op rate.
  const uint64_t window = op_bytes * batch;
  const auto submit_ops =
      MakeOps(v1::OP_TYPE_WRITE_FROM_LOCAL, setup.local->id(),
              setup.remote->remote_context(), op_bytes, batch, window,
              setup.local->size());
  const auto ring_ops = ring.Ops(v1::OP_TYPE_WRITE_FROM_LOCAL,
                                 setup.local->id(), op_bytes, batch, window);
  if (absl::Status s = CompareOpRates(agent, ring.ring(), ring_ops, submit_ops,
                                      spin, "tcp", "ring_tcp_ops");
      !s.ok()) {
    return s;
  }
  (void)agent.ReleaseRemote(ring.handle());
  return absl::OkStatus();
}

// Eight ring sessions of agent A left idle for --seconds after one op each,
// so that the agent's CPU time while they idle can be read from outside
// (/proc/PID/stat): compare.sh prints it.
absl::Status TestRingIdle(Setup& setup) {
  AgentClient& agent = *setup.local_agent;
  auto other = AttachPrefaulted(agent, 4096, 3);
  if (!other.ok()) return other.status();
  auto handle = agent.ImportRemote(other->remote_context());
  if (!handle.ok()) return handle.status();
  std::vector<std::unique_ptr<client::Ring>> rings;
  for (int i = 0; i < 8; ++i) {
    auto ring = agent.OpenRing(64);
    if (!ring.ok()) return ring.status();
    client::RingOp op;
    op.type = v1::OP_TYPE_WRITE_FROM_LOCAL;
    op.local_buffer_id = setup.local->id();
    op.length = 8;
    op.remote_handle = handle->handle;
    if (absl::Status s = (*ring)->Submit({&op, 1}); !s.ok()) return s;
    std::vector<client::RingCompletion> ends;
    auto got = (*ring)->Wait(&ends, absl::Seconds(10));
    if (!got.ok()) return got.status();
    rings.push_back(std::move(*ring));
  }
  Print(Report("ring_idle_start").Add("sessions", 8, 0));
  absl::SleepFor(Seconds());
  Print(Report("ring_idle_end")
            .Add("sessions", 8, 0)
            .Add("seconds", absl::ToDoubleSeconds(Seconds()), 1));
  (void)agent.ReleaseRemote(handle->handle);
  return absl::OkStatus();
}

// ---- Register + Release against two GetInfo calls ---------------------------

absl::Status TestRegister(Setup& setup) {
  AgentClient& agent = *setup.local_agent;
  const uint64_t bytes = absl::GetFlag(FLAGS_small_op_bytes);
  auto register_release = [&]() -> absl::Status {
    auto registration =
        agent.AllocateUnmapped(bytes, v1::ACCESS_READ_WRITE, "bench");
    if (!registration.ok()) return registration.status();
    return agent.Release(registration->id);
  };
  auto getinfo_twice = [&]() -> absl::Status {
    if (absl::Status s = agent.GetInfo().status(); !s.ok()) return s;
    return agent.GetInfo().status();
  };
  for (int i = 0; i < 50; ++i) {
    if (absl::Status s = register_release(); !s.ok()) return s;
    if (absl::Status s = getinfo_twice(); !s.ok()) return s;
  }
  // Alternating 100 ms slices, so both see the same noise.
  Timed registers, getinfos;
  const absl::Duration slice = absl::Milliseconds(100);
  for (absl::Duration spent; spent < Seconds(); spent += 2 * slice) {
    auto a = RunFor(slice, 1, register_release);
    if (!a.ok()) return a.status();
    auto b = RunFor(slice, 1, getinfo_twice);
    if (!b.ok()) return b.status();
    registers.steps += a->steps;
    registers.elapsed += a->elapsed;
    getinfos.steps += b->steps;
    getinfos.elapsed += b->elapsed;
  }
  const double register_rate =
      registers.steps / absl::ToDoubleSeconds(registers.elapsed);
  const double getinfo_rate =
      getinfos.steps / absl::ToDoubleSeconds(getinfos.elapsed);
  Print(Report("register_release")
            .Add("per_s", register_rate, 0)
            .Add("us", 1e6 / register_rate)
            .Add("bytes", static_cast<double>(bytes), 0));
  Print(Report("getinfo_x2")
            .Add("per_s", getinfo_rate, 0)
            .Add("us", 1e6 / getinfo_rate));
  Print(Report("register_ratio").Add("ratio", register_rate / getinfo_rate, 2));
  return absl::OkStatus();
}

// ---- several client processes -----------------------------------------------

absl::Status TestClients(Setup& /*setup*/) {
  const int count = std::max(1, absl::GetFlag(FLAGS_clients));
  const std::vector<std::string> args = {
      "--client_child",
      absl::StrCat("--local=", absl::GetFlag(FLAGS_local)),
      absl::StrCat("--remote=", absl::GetFlag(FLAGS_remote)),
      absl::StrCat("--small_op_bytes=", absl::GetFlag(FLAGS_small_op_bytes)),
      absl::StrCat("--small_batch=", absl::GetFlag(FLAGS_small_batch)),
      absl::StrCat("--seconds=", absl::GetFlag(FLAGS_seconds)),
  };
  auto rates = RunClients(count, args, absl::Seconds(60) + 4 * Seconds());
  if (!rates.ok()) return rates.status();
  const std::vector<double>& r = rates->ops_per_second;
  double sum = 0, squares = 0;
  for (double rate : r) {
    sum += rate;
    squares += rate * rate;
  }
  const auto [low, high] = std::minmax_element(r.begin(), r.end());
  Print(Report("clients_write")
            .Add("clients", static_cast<double>(r.size()), 0)
            .Add("ops_per_s", sum, 0)
            .Add("min_client_ops_per_s", *low, 0)
            .Add("max_client_ops_per_s", *high, 0)
            .Add("min_share", *low / sum, 3)
            .Add("max_share", *high / sum, 3)
            .Add("jain", sum * sum / (r.size() * squares), 3)
            .Add("op_bytes",
                 static_cast<double>(absl::GetFlag(FLAGS_small_op_bytes)), 0)
            .Add("batch", absl::GetFlag(FLAGS_small_batch), 0));
  return absl::OkStatus();
}

// ---- socket references (no agent) -------------------------------------------

absl::Status TestSocket(Setup& setup) {
  const int streams = absl::GetFlag(FLAGS_streams) > 0
                          ? absl::GetFlag(FLAGS_streams)
                          : setup.connections_per_peer;
  const uint64_t size = absl::GetFlag(FLAGS_size);
  const uint64_t per_stream =
      size / streams * std::max(1, absl::GetFlag(FLAGS_socket_passes));
  for (const auto& [name, window] :
       {std::pair<std::string, uint64_t>{"socket_cold", size / streams},
        std::pair<std::string, uint64_t>{"socket_hot", uint64_t{1} << 20}}) {
    auto elapsed = MeasureStreams(setup.socket_peer, streams, window,
                                  per_stream, uint64_t{1} << 20);
    if (!elapsed.ok()) return elapsed.status();
    const double seconds = absl::ToDoubleSeconds(*elapsed);
    Print(Report(name)
              .Add("MiB_per_s", per_stream * streams / seconds / (1 << 20))
              .Add("streams", streams, 0)
              .Add("window_bytes", static_cast<double>(window), 0)
              .Add("seconds", seconds, 3));
  }
  return absl::OkStatus();
}

// ---- main
// ----------------------------------------------------------------------

// Connects to both agents and prints agent A's info line; with
// `with_buffers`, also registers the two --size buffers and finds the socket
// peer.
absl::StatusOr<Setup> Connect(bool with_buffers) {
  Setup setup;
  client::ConnectOptions local_options;
  local_options.target = absl::GetFlag(FLAGS_local);
  client::ConnectOptions remote_options;
  remote_options.target = absl::GetFlag(FLAGS_remote);
  auto local_agent = AgentClient::Connect(local_options);
  if (!local_agent.ok()) return local_agent.status();
  auto remote_agent = AgentClient::Connect(remote_options);
  if (!remote_agent.ok()) return remote_agent.status();
  setup.local_agent = std::move(*local_agent);
  setup.remote_agent = std::move(*remote_agent);
  auto connections = ReportInfo(*setup.local_agent);
  if (!connections.ok()) return connections.status();
  setup.connections_per_peer = *connections;
  if (!with_buffers) return setup;
  const uint64_t size = absl::GetFlag(FLAGS_size);
  auto local = AttachPrefaulted(*setup.local_agent, size, 1);
  if (!local.ok()) return local.status();
  auto remote = AttachPrefaulted(*setup.remote_agent, size, 2);
  if (!remote.ok()) return remote.status();
  setup.local = std::make_unique<Buffer>(std::move(*local));
  setup.remote = std::make_unique<Buffer>(std::move(*remote));
  setup.socket_peer = absl::GetFlag(FLAGS_socket_peer);
  if (setup.socket_peer.empty()) {
    auto peer = StartLoopbackSocketPeer();
    if (!peer.ok()) return peer.status();
    setup.socket_peer = *peer;
  }
  return setup;
}

int RunTests() {
  const std::vector<std::pair<std::string, absl::Status (*)(Setup&)>> all = {
      {"latency", TestLatency},   {"ops", TestOps},
      {"async", TestAsync},       {"kv", TestKv},
      {"bulk", TestBulk},         {"memory", TestMemory},
      {"prepared", TestPrepared}, {"ring", TestRing},
      {"ring_tcp", TestRingTcp},  {"ring_idle", TestRingIdle},
      {"register", TestRegister}, {"clients", TestClients},
      {"socket", TestSocket},
  };
  const std::vector<std::string> wanted =
      absl::StrSplit(absl::GetFlag(FLAGS_tests), ',', absl::SkipEmpty());
  for (const std::string& name : wanted) {
    if (name == "info") continue;  // printed by every run
    if (std::none_of(all.begin(), all.end(),
                     [&](const auto& test) { return test.first == name; })) {
      std::fprintf(stderr, "unknown test %s\n", name.c_str());
      return 2;
    }
  }
  const bool only_info =
      std::all_of(wanted.begin(), wanted.end(),
                  [](const std::string& name) { return name == "info"; });
  auto setup = Connect(/*with_buffers=*/!only_info);
  if (!setup.ok()) {
    std::fprintf(stderr, "setup: %s\n", setup.status().ToString().c_str());
    return 1;
  }
  int failed = 0;
  for (const auto& [name, test] : all) {
    if (std::find(wanted.begin(), wanted.end(), name) == wanted.end()) continue;
    if (absl::Status status = test(*setup); !status.ok()) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(), status.ToString().c_str());
      Print(Report(name).Add("failed", status.ToString()));
      ++failed;
    }
  }
  return failed == 0 ? 0 : 1;
}

int ServeSocketPeerForever() {
  absl::Status status = ServeSocketPeer(
      absl::GetFlag(FLAGS_serve_socket_peer), [](const std::string& bound) {
        std::printf("serving %s\n", bound.c_str());
        std::fflush(stdout);
      });
  std::fprintf(stderr, "%s\n", status.ToString().c_str());
  return 1;
}

}  // namespace
}  // namespace rdma_agent::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  namespace bench = rdma_agent::bench;
  if (!absl::GetFlag(FLAGS_serve_socket_peer).empty()) {
    return bench::ServeSocketPeerForever();
  }
  if (absl::GetFlag(FLAGS_client_child)) {
    bench::ClientChildOptions options;
    options.local = absl::GetFlag(FLAGS_local);
    options.remote = absl::GetFlag(FLAGS_remote);
    options.op_bytes = absl::GetFlag(FLAGS_small_op_bytes);
    options.batch = absl::GetFlag(FLAGS_small_batch);
    options.duration = absl::Seconds(absl::GetFlag(FLAGS_seconds));
    return bench::RunClientChild(options);
  }
  return bench::RunTests();
}
