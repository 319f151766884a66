// Soak: two real rdma-agentd processes in two network namespaces, 32
// concurrent clients running mixed READ/WRITE Submits over tcp with random
// sizes (1 B - 4 MiB) and offsets for a minute, every byte checked. Each
// agent's fd count, thread count and memory are sampled throughout and must
// stay flat once warmed up: a leak of connections, threads or heap per op
// shows up within a minute at this rate. Root only (namespaces).
//
// RDMA_AGENTD_SOAK_SECONDS shortens (or lengthens) the run for local use.

#include <dirent.h>
#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/integration/netns.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/pattern.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;

constexpr int kClients = 32;  // half on each host, each against the other
constexpr int kClientsPerHost = kClients / 2;
constexpr uint64_t kMaxOp = 4ull << 20;
// Each client owns a slice of the other host's shared buffer, a little
// larger than the largest op so that offsets vary at every size.
constexpr uint64_t kSlice = kMaxOp + (64 << 10);
constexpr uint64_t kLocal = kMaxOp + 4096;
// Bounds on what an agent may gain over its warm-up level (the highest it
// went while connection pools filled and allocator arenas grew). Under load,
// fds and threads follow the ops in flight (some threads are per call), so
// they may rise by what 32 concurrent clients can hold at once; once the
// clients are gone they must be back near the warm-up level. These catch
// leaks (one fd or thread per op would be thousands), not jitter.
constexpr int kLoadFdMargin = 2 * kClients;
constexpr int kLoadThreadMargin = 2 * kClients;
constexpr int kIdleFdMargin = 8;
constexpr int kIdleThreadMargin = 4;
constexpr int64_t kAnonGrowthBytes = 32ll << 20;

absl::Duration SoakDuration() {
  int seconds = 60;
  const char* env = std::getenv("RDMA_AGENTD_SOAK_SECONDS");
  if (env != nullptr && !absl::SimpleAtoi(env, &seconds)) seconds = 60;
  return absl::Seconds(std::max(seconds, 6));
}

// What one agent process holds at one moment.
struct Sample {
  absl::Duration at;
  int fds = 0;
  int threads = 0;
  int64_t rss_bytes = 0;   // VmRSS: includes the shared buffers it touched
  int64_t anon_bytes = 0;  // RssAnon: heap and stacks, where leaks show
};

int64_t StatusField(const std::string& status, const std::string& name) {
  const size_t at = status.find("\n" + name + ":");
  if (at == std::string::npos) return -1;
  const size_t start = status.find_first_not_of(" \t", at + name.size() + 2);
  const size_t end = status.find_first_not_of("0123456789", start);
  int64_t value = -1;
  if (!absl::SimpleAtoi(status.substr(start, end - start), &value)) return -1;
  return value;
}

Sample TakeSample(pid_t pid, absl::Duration at) {
  Sample sample;
  sample.at = at;
  const std::string proc = absl::StrCat("/proc/", pid);
  if (DIR* dir = ::opendir((proc + "/fd").c_str())) {
    while (const dirent* entry = ::readdir(dir)) {
      if (entry->d_name[0] != '.') ++sample.fds;
    }
    ::closedir(dir);
  }
  std::ifstream in(proc + "/status");
  const std::string status =
      "\n" + std::string(std::istreambuf_iterator<char>(in),
                         std::istreambuf_iterator<char>());
  sample.threads = static_cast<int>(StatusField(status, "Threads"));
  sample.rss_bytes = StatusField(status, "VmRSS") * 1024;
  sample.anon_bytes = StatusField(status, "RssAnon") * 1024;
  return sample;
}

std::string Describe(const Sample& s) {
  return absl::StrFormat("t=%.0fs fds=%d threads=%d rss=%.1fMiB anon=%.1fMiB",
                         absl::ToDoubleSeconds(s.at), s.fds, s.threads,
                         s.rss_bytes / 1048576.0, s.anon_bytes / 1048576.0);
}

// The remote slice as the client last wrote it: [start, end) holds pattern
// `seed` at slice positions (keyed by start; intervals never overlap).
class SliceModel {
 public:
  explicit SliceModel(uint64_t initial_seed) {
    segments_[0] = {kSlice, initial_seed};
  }

  void Write(uint64_t start, uint64_t end, uint64_t seed) {
    Split(start);
    Split(end);
    segments_.erase(segments_.lower_bound(start), segments_.lower_bound(end));
    segments_[start] = {end, seed};
  }

  // First position in [start, end) where `bytes` (read from the slice at
  // `start`) differ from the model; -1 if none.
  int64_t Check(const std::byte* bytes, uint64_t start, uint64_t end) const {
    auto it = std::prev(segments_.upper_bound(start));
    for (; it != segments_.end() && it->first < end; ++it) {
      const uint64_t from = std::max(start, it->first);
      const uint64_t to = std::min(end, it->second.end);
      auto bad =
          FindMismatch(absl::MakeConstSpan(bytes + (from - start), to - from),
                       it->second.seed, from);
      if (bad) return static_cast<int64_t>(from + *bad);
    }
    return -1;
  }

 private:
  struct Segment {
    uint64_t end;
    uint64_t seed;
  };
  void Split(uint64_t at) {
    if (at >= kSlice) return;
    auto it = std::prev(segments_.upper_bound(at));
    if (it->first == at) return;
    const Segment tail = {it->second.end, it->second.seed};
    it->second.end = at;
    segments_[at] = tail;
  }
  std::map<uint64_t, Segment> segments_;
};

struct Totals {
  std::atomic<uint64_t> ops{0};
  std::atomic<uint64_t> reads{0};
  std::atomic<uint64_t> writes{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> errors{0};
  std::mutex mu;
  std::vector<std::string> failures;  // the first few, guarded by mu

  void Fail(const std::string& what) {
    errors.fetch_add(1);
    std::lock_guard<std::mutex> lock(mu);
    if (failures.size() < 10) failures.push_back(what);
  }
};

// A size in [1, kMaxOp], spread over every order of magnitude.
uint64_t RandomSize(std::mt19937_64& random) {
  const int bits = static_cast<int>(random() % 23);  // up to 4 MiB
  const uint64_t size = 1 + random() % (1ull << bits);
  return random() % 64 == 0 ? kMaxOp : size;
}

// One client: its own connection to its host's agent, a local buffer, and
// slice `slice_index` of `shared` on the other host, which it fills with a
// known pattern and then reads and writes at random until `stop`.
void RunClient(AgentProcess& agent, const client::Buffer& shared, int client_id,
               int slice_index, std::atomic<bool>& stop, Totals& totals) {
  const std::string who = absl::StrCat("client ", client_id, ": ");
  auto connection = agent.NewClient();
  if (!connection.ok()) {
    return totals.Fail(who + connection.status().ToString());
  }
  client::AgentClient& me = **connection;
  auto local = me.Attach(kLocal, v1::ACCESS_READ_WRITE, "soak");
  if (!local.ok()) return totals.Fail(who + local.status().ToString());

  std::mt19937_64 random(1000 + client_id);
  const uint64_t slice_base = slice_index * kSlice;
  uint64_t seed = static_cast<uint64_t>(client_id) << 32;
  // One op; false (with the failure recorded) if it did not succeed on tcp.
  auto run = [&](v1::OpType type, uint64_t local_offset, uint64_t length,
                 uint64_t remote_offset, std::string* what) {
    client::OpSpec op;
    op.type = type;
    op.local_buffer_id = local->id();
    op.local_offset = local_offset;
    op.length = length;
    op.remote_context = shared.remote_context();
    op.remote_offset = slice_base + remote_offset;
    *what = absl::StrCat(
        who, type == v1::OP_TYPE_WRITE_FROM_LOCAL ? "WRITE " : "READ ", length,
        " bytes at remote ", remote_offset, " local ", local_offset, ": ");
    auto results = me.Submit({op}, absl::Seconds(60));
    if (!results.ok()) {
      totals.Fail(*what + results.status().ToString());
      return false;
    }
    const client::OpResult& result = (*results)[0];
    if (!result.status.ok() || result.backend != "tcp") {
      totals.Fail(*what + result.status.ToString() + " on '" + result.backend +
                  "'");
      return false;
    }
    return true;
  };

  // The slice starts out unknown: write all of it with one pattern first.
  std::string what;
  for (uint64_t at = 0; at < kSlice; at += kMaxOp) {
    const uint64_t length = std::min(kMaxOp, kSlice - at);
    FillPattern(local->bytes().subspan(0, length), seed, at);
    if (!run(v1::OP_TYPE_WRITE_FROM_LOCAL, 0, length, at, &what)) return;
  }
  SliceModel model(seed);

  while (!stop.load()) {
    const bool write = random() % 2 == 0;
    const uint64_t length = RandomSize(random);
    const uint64_t remote_offset = random() % (kSlice - length + 1);
    const uint64_t local_offset = random() % (kLocal - length + 1);
    std::byte* at = local->data() + local_offset;
    if (write) {
      ++seed;
      FillPattern(absl::MakeSpan(at, length), seed, remote_offset);
    } else {
      // So that a read that moved nothing cannot pass.
      std::fill(at, at + length, std::byte{0x5a});
    }
    if (!run(write ? v1::OP_TYPE_WRITE_FROM_LOCAL : v1::OP_TYPE_READ_INTO_LOCAL,
             local_offset, length, remote_offset, &what)) {
      return;
    }
    if (write) {
      model.Write(remote_offset, remote_offset + length, seed);
      totals.writes.fetch_add(1);
    } else {
      const int64_t bad =
          model.Check(at, remote_offset, remote_offset + length);
      if (bad >= 0) {
        return totals.Fail(
            absl::StrCat(what, "wrong byte at slice position ", bad));
      }
      totals.reads.fetch_add(1);
    }
    totals.ops.fetch_add(1);
    totals.bytes.fetch_add(length);
  }
}

TEST(SoakTest, TwoHostsThirtyTwoClientsStayFlat) {
  ASSERT_TRUE(CheckNetnsPrivileges().ok()) << CheckNetnsPrivileges();
  auto pair = NetnsPair::Create();
  ASSERT_TRUE(pair.ok()) << pair.status();
  std::unique_ptr<AgentProcess> agents[2];
  for (int side = 0; side < 2; ++side) {
    AgentProcess::Options options;
    options.backends = "memory,tcp";
    options.netns = (*pair)->netns(side);
    options.listen_host = (*pair)->address(side);
    options.advertise_host = (*pair)->address(side);
    // Not debug: per-chunk lines would be most of a minute's work.
    options.log_level = "info";
    auto agent = AgentProcess::Start(options);
    ASSERT_TRUE(agent.ok()) << agent.status();
    agents[side] = std::move(*agent);
  }

  // Each host shares one buffer; clients of the other host own slices of it.
  // The buffer ends exactly at the last slice, so ops reach its last byte.
  std::vector<client::Buffer> shared;
  for (int side = 0; side < 2; ++side) {
    auto buffer = agents[side]->client().Attach(
        kClientsPerHost * kSlice, v1::ACCESS_READ_WRITE, "soak-shared");
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    shared.push_back(std::move(*buffer));
  }

  const absl::Duration duration = SoakDuration();
  const absl::Duration warm_up = duration / 6;
  const absl::Duration period = absl::Seconds(1);
  // Idle before any client: for the record (connection pools are empty).
  Sample before[2];
  for (int side = 0; side < 2; ++side) {
    before[side] = TakeSample(agents[side]->pid(), absl::ZeroDuration());
  }
  Totals totals;
  std::atomic<bool> stop{false};
  std::vector<std::thread> clients;
  const absl::Time start = absl::Now();
  for (int host = 0; host < 2; ++host) {
    for (int c = 0; c < kClientsPerHost; ++c) {
      clients.emplace_back([&, host, c] {
        RunClient(*agents[host], shared[1 - host], host * kClientsPerHost + c,
                  c, stop, totals);
      });
    }
  }

  std::vector<Sample> samples[2];
  while (absl::Now() - start < duration && totals.errors.load() == 0) {
    absl::SleepFor(period);
    for (int side = 0; side < 2; ++side) {
      samples[side].push_back(
          TakeSample(agents[side]->pid(), absl::Now() - start));
    }
  }
  stop.store(true);
  for (std::thread& t : clients) t.join();
  const absl::Duration elapsed = absl::Now() - start;
  // Idle: clients gone, their connections and ops finished.
  absl::SleepFor(absl::Seconds(2));
  Sample idle[2];
  for (int side = 0; side < 2; ++side) {
    idle[side] = TakeSample(agents[side]->pid(), absl::Now() - start);
  }

  const double seconds = absl::ToDoubleSeconds(elapsed);
  std::printf(
      "soak: %.1f s, %d clients, %llu ops (%llu reads, %llu writes), "
      "%.2f GiB, %.0f ops/s, %.1f MiB/s, %llu errors\n",
      seconds, kClients, static_cast<unsigned long long>(totals.ops.load()),
      static_cast<unsigned long long>(totals.reads.load()),
      static_cast<unsigned long long>(totals.writes.load()),
      totals.bytes.load() / 1073741824.0, totals.ops.load() / seconds,
      totals.bytes.load() / 1048576.0 / seconds,
      static_cast<unsigned long long>(totals.errors.load()));
  ::testing::Test::RecordProperty("ops", static_cast<int>(totals.ops.load()));
  ::testing::Test::RecordProperty("mib",
                                  static_cast<int>(totals.bytes.load() >> 20));

  {
    std::lock_guard<std::mutex> lock(totals.mu);
    for (const std::string& failure : totals.failures) {
      ADD_FAILURE() << failure;
    }
  }
  EXPECT_EQ(totals.errors.load(), 0u);
  EXPECT_GT(totals.reads.load(), 0u);
  EXPECT_GT(totals.writes.load(), 0u);

  for (int side = 0; side < 2; ++side) {
    SCOPED_TRACE(absl::StrCat("agent ", side));
    ASSERT_FALSE(samples[side].empty());
    // The warm-up level: the highest the agent went while warming up (load
    // makes fds and threads jitter with connections in flight).
    Sample warm = samples[side].front();
    for (const Sample& s : samples[side]) {
      std::printf("agent %d: %s\n", side, Describe(s).c_str());
      if (s.at > warm_up) continue;
      warm.fds = std::max(warm.fds, s.fds);
      warm.threads = std::max(warm.threads, s.threads);
      warm.rss_bytes = std::max(warm.rss_bytes, s.rss_bytes);
      warm.anon_bytes = std::max(warm.anon_bytes, s.anon_bytes);
    }
    std::printf("agent %d: idle before: %s\n", side,
                Describe(before[side]).c_str());
    std::printf(
        "agent %d: warm-up level fds=%d threads=%d anon=%.1fMiB; "
        "idle after: %s\n",
        side, warm.fds, warm.threads, warm.anon_bytes / 1048576.0,
        Describe(idle[side]).c_str());
    for (const Sample& s : samples[side]) {
      if (s.at <= warm_up) continue;
      EXPECT_LE(s.fds, warm.fds + kLoadFdMargin) << Describe(s);
      EXPECT_LE(s.threads, warm.threads + kLoadThreadMargin) << Describe(s);
      EXPECT_LE(s.anon_bytes, warm.anon_bytes + kAnonGrowthBytes)
          << Describe(s);
    }
    EXPECT_GT(idle[side].fds, 0) << "agent " << side << " is gone";
    EXPECT_LE(idle[side].fds, warm.fds + kIdleFdMargin) << Describe(idle[side]);
    EXPECT_LE(idle[side].threads, warm.threads + kIdleThreadMargin)
        << Describe(idle[side]);
    EXPECT_LE(idle[side].anon_bytes, warm.anon_bytes + kAnonGrowthBytes)
        << Describe(idle[side]);
  }

  if (::testing::Test::HasFailure()) {
    for (int side = 0; side < 2; ++side) {
      ADD_FAILURE() << "agent " << side << " log:\n" << agents[side]->Log();
    }
  }
  shared.clear();
  agents[0].reset();
  agents[1].reset();
}

}  // namespace
}  // namespace rdma_agent::testing
