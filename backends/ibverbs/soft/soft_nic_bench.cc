// Throughput of the ibverbs backend's posting path (chunking, credits,
// poller, tracker) over the software NIC, next to a plain memcpy of the same
// bytes in the same run: the soft NIC copies with memmove, so the gap is the
// backend's and the emulation's overhead per WR.
//
//   bazel run -c opt //backends/ibverbs/soft:soft_nic_bench
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/time/clock.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/testing/harness.h"
#include "backends/testing/ibverbs_agent.h"

namespace rdma_agent {
namespace {

using ibverbs::IbverbsOptions;
using ::rdma_agent::testing::IbverbsAgent;
using ::rdma_agent::testing::MakeOp;
using ::rdma_agent::testing::SoftIbverbsAgent;
using ::rdma_agent::testing::TestAgent;
using ::rdma_agent::testing::TestBuffer;

int Run() {
  verbs::SoftFabric fabric;
  for (const char* name : {"nic_a", "nic_b"}) {
    verbs::SoftDeviceConfig config;
    config.name = name;
    if (!fabric.AddDevice(config).ok()) return 1;
  }
  IbverbsOptions options;
  options.qp.max_message_bytes = 1 << 20;
  auto a = SoftIbverbsAgent(fabric, "bench-a", "nic_a", options);
  auto b = SoftIbverbsAgent(fabric, "bench-b", "nic_b", options);
  const uint64_t kSize = 64 << 20;
  TestBuffer local = a->Register(kSize, v1::ACCESS_READ_WRITE, 1);
  TestBuffer remote = b->Register(kSize, v1::ACCESS_READ_WRITE, 2);

  const int kRounds = 20;
  absl::Time start = absl::Now();
  for (int r = 0; r < kRounds; ++r) {
    std::memcpy(remote.bytes(), local.bytes(), kSize);
  }
  const double memcpy_s = absl::ToDoubleSeconds(absl::Now() - start);

  start = absl::Now();
  for (int r = 0; r < kRounds; ++r) {
    auto results = a->backend<ibverbs::IbverbsBackend>().Submit(
        {MakeOp(0, v1::OP_TYPE_WRITE_FROM_LOCAL, local, 0, kSize, remote, 0)},
        absl::Now() + absl::Seconds(60));
    if (!results[0].ok()) {
      std::fprintf(stderr, "%s\n", results[0].ToString().c_str());
      return 1;
    }
  }
  const double write_s = absl::ToDoubleSeconds(absl::Now() - start);
  const double gb = static_cast<double>(kSize) * kRounds / 1e9;
  std::printf(
      "64 MiB ops in 1 MiB WRs: memcpy %.2f GB/s, soft NIC WRITE %.2f "
      "GB/s (%.0f%% of memcpy)\n",
      gb / memcpy_s, gb / write_s, 100 * memcpy_s / write_s);

  const uint64_t kOps = 20000;
  std::vector<Op> ops;
  for (uint64_t i = 0; i < kOps; ++i) {
    ops.push_back(MakeOp(i, v1::OP_TYPE_READ_INTO_LOCAL, local, i * 64, 64,
                         remote, i * 64));
  }
  start = absl::Now();
  auto results =
      a->backend<ibverbs::IbverbsBackend>().Submit(ops, absl::Now() + absl::Seconds(60));
  const double small_s = absl::ToDoubleSeconds(absl::Now() - start);
  for (const auto& status : results) {
    if (!status.ok()) return 1;
  }
  std::printf(
      "%llu x 64-byte READs in one Submit (SQ depth %u): %.0f ops/s, "
      "%.1f us/op\n",
      static_cast<unsigned long long>(kOps),
      a->backend<ibverbs::IbverbsBackend>().params().sq_depth, kOps / small_s,
      1e6 * small_s / kOps);
  return 0;
}

}  // namespace
}  // namespace rdma_agent

int main() { return rdma_agent::Run(); }
