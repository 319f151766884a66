// The requesting side of the tcp data plane under the limits a host puts on
// the agent (cgroup v1 memory and pids controllers): a Submit that names
// huge ops or hundreds of peers gets per-op results, and the agent lives on.
// Root only: the test creates cgroups under /sys/fs/cgroup/{memory,pids}.

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "backends/tcp/client_test_peer.h"
#include "gtest/gtest.h"
#include "tests/testing/agent_process.h"

namespace rdma_agent::testing {
namespace {

using ::rdma_agent::tcp::testing::ClosedPort;
using ::rdma_agent::tcp::testing::ContextFor;
using ::rdma_agent::tcp::testing::ScriptedPeer;
using Behavior = ScriptedPeer::Behavior;
namespace v1 = ::rdma::agent::v1;

absl::Status WriteFile(const std::string& path, const std::string& value) {
  std::ofstream out(path);
  out << value;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in),
                     std::istreambuf_iterator<char>());
}

// A cgroup v1 directory of one controller, removed when destroyed (its
// processes must be gone by then).
class Cgroup {
 public:
  static absl::StatusOr<std::unique_ptr<Cgroup>> Create(
      const std::string& controller) {
    const std::string path =
        absl::StrCat("/sys/fs/cgroup/", controller, "/rat-tcp-client-",
                     getpid(), "-", counter_++);
    if (mkdir(path.c_str(), 0755) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create ", path,
                       " (cgroup v1 and root needed): ", std::strerror(errno)));
    }
    return std::unique_ptr<Cgroup>(new Cgroup(path));
  }
  ~Cgroup() {
    // The agent was killed and reaped just before: give the kernel a moment.
    for (int i = 0; i < 200 && rmdir(path_.c_str()) != 0; ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  absl::Status Set(const std::string& file, const std::string& value) {
    return WriteFile(absl::StrCat(path_, "/", file), value);
  }
  std::string Get(const std::string& file) const {
    return ReadFile(absl::StrCat(path_, "/", file));
  }
  absl::Status Add(pid_t pid) { return Set("cgroup.procs", absl::StrCat(pid)); }

 private:
  explicit Cgroup(std::string path) : path_(std::move(path)) {}
  static inline int counter_ = 0;
  const std::string path_;
};

AgentProcess::Options AgentOptions(std::vector<std::string> flags = {}) {
  AgentProcess::Options options;
  options.backends = "memory,tcp";
  options.log_level = "info";
  options.extra_flags = std::move(flags);
  return options;
}

client::OpSpec ForgedOp(v1::OpType type, uint64_t local_id, uint64_t length,
                        const std::string& host, uint16_t port,
                        uint64_t remote_size) {
  client::OpSpec op;
  op.type = type;
  op.local_buffer_id = local_id;
  op.length = length;
  op.remote_context = ContextFor(host, port, remote_size)->SerializeAsString();
  return op;
}

// The agent still answers and still moves bytes (a same-host op).
void ExpectAgentServes(AgentProcess& agent) {
  ASSERT_TRUE(agent.Running()) << agent.Log();
  auto client = agent.NewClient();
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->GetInfo().ok());
  auto a = (*client)->AllocateUnmapped(4096, v1::ACCESS_READ_WRITE);
  auto b = (*client)->AllocateUnmapped(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(a.ok() && b.ok());
  client::OpSpec op;
  op.type = v1::OP_TYPE_WRITE_FROM_LOCAL;
  op.local_buffer_id = a->id;
  op.length = 4096;
  op.remote_context = b->remote_context;
  auto results = (*client)->Submit({op}, absl::Seconds(10));
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
}

// Problem 2: the old client built every chunk of a Submit up front: 2048 ops
// of 64 GiB are 32 M chunks, and the agent was OOM-killed in 1.4 s.
TEST(TcpClientLimitsTest, HugeOpsInAOneGibMemoryCgroupGetResults) {
  // The registration quotas (registered and agent-allocated bytes) would
  // refuse a 64 GiB sparse buffer on a small host; what is under test is
  // the Submit.
  auto agent = AgentProcess::Start(
      AgentOptions({"--max_registered_bytes_per_user=1099511627776",
                    "--max_registered_bytes_total=1099511627776",
                    "--max_agent_allocated_bytes_per_user=1099511627776",
                    "--max_agent_allocated_bytes_total=1099511627776"}));
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto cgroup = Cgroup::Create("memory");
  ASSERT_TRUE(cgroup.ok()) << cgroup.status();
  ASSERT_TRUE((*cgroup)->Set("memory.limit_in_bytes", "1073741824").ok());
  ASSERT_TRUE((*cgroup)->Add((*agent)->pid()).ok());

  constexpr uint64_t kHuge = 64ull << 30;
  auto local =
      (*agent)->client().AllocateUnmapped(kHuge, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  // A peer that speaks the protocol and refuses every request: nothing is
  // ever written into the sparse buffer, so only the client's own
  // bookkeeping could use memory.
  ScriptedPeer peer(Behavior::kRefuseAll);
  std::vector<client::OpSpec> ops;
  for (int i = 0; i < 2048; ++i) {
    ops.push_back(ForgedOp(v1::OP_TYPE_READ_INTO_LOCAL, local->id, kHuge,
                           "127.0.0.1", peer.port(), kHuge));
  }
  auto results = (*agent)->client().Submit(ops, absl::Seconds(60));
  ASSERT_TRUE(results.ok()) << results.status() << "\n"
                            << (*agent)->Log().substr(0, 4000);
  ASSERT_EQ(results->size(), ops.size());
  for (const auto& result : *results) {
    EXPECT_EQ(result.status.code(), absl::StatusCode::kNotFound)
        << result.status;
  }
  EXPECT_NE((*cgroup)->Get("memory.oom_control").find("oom_kill 0"),
            std::string::npos)
      << (*cgroup)->Get("memory.oom_control");
  ExpectAgentServes(**agent);
  agent->reset();  // before the cgroup goes
}

// Problem 3: the old backend started a thread per peer (and per lane) that
// lived as long as its peer kept it waiting; under a pids limit thread
// creation failed and the agent aborted.
TEST(TcpClientLimitsTest, SixHundredPeersUnderAPidsLimitGetPerOpErrors) {
  // Silent peers hold a dial for its whole connect timeout: keep it short so
  // the bounded workers get through many of them within the Submit.
  auto agent =
      AgentProcess::Start(AgentOptions({"--tcp_client_connect_timeout=200ms"}));
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto cgroup = Cgroup::Create("pids");
  ASSERT_TRUE(cgroup.ok()) << cgroup.status();
  ASSERT_TRUE((*cgroup)->Set("pids.max", "300").ok());
  ASSERT_TRUE((*cgroup)->Add((*agent)->pid()).ok());
  const int tasks = std::stoi((*cgroup)->Get("pids.current"));
  ASSERT_LT(tasks, 150) << "the agent alone already has " << tasks << " tasks";

  auto local =
      (*agent)->client().AllocateUnmapped(1 << 20, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  // 600 distinct peers (127.0.x.y): every third a closed port, the others a
  // listener that accepts and never answers, so nothing ends on its own.
  ScriptedPeer silent(Behavior::kSilent, "0.0.0.0");
  const uint16_t closed = ClosedPort();
  std::vector<client::OpSpec> ops;
  for (int i = 0; i < 600; ++i) {
    const std::string host =
        absl::StrCat("127.0.", 10 + i / 250, ".", 1 + i % 250);
    ops.push_back(ForgedOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local->id, 4096, host,
                           i % 3 == 0 ? closed : silent.port(), 1 << 20));
  }
  const absl::Time start = absl::Now();
  auto results = (*agent)->client().Submit(ops, absl::Seconds(4));
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(results.ok()) << results.status() << "\n"
                            << (*agent)->Log().substr(0, 4000);
  ASSERT_EQ(results->size(), ops.size());
  int unavailable = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    const absl::Status& status = (*results)[i].status;
    // Unreachable when its turn came, or still queued at the deadline.
    EXPECT_TRUE(absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status))
        << i << ": " << status;
    if (absl::IsUnavailable(status)) ++unavailable;
  }
  EXPECT_GT(unavailable, 50);
  EXPECT_LT(took, absl::Seconds(6));
  EXPECT_LE(std::stoi((*cgroup)->Get("pids.current")), tasks + 10)
      << "the Submit left threads behind";
  ExpectAgentServes(**agent);
  agent->reset();
}

}  // namespace
}  // namespace rdma_agent::testing
