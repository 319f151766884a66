// Queue-pair connections sharing a device's completion pollers: one CQ and
// thread for as many QPs as it has entries for, another once it is full;
// each completion reaches its own connection, also while others come and
// go.
#include "backends/ibverbs/connection.h"

#include <cstring>
#include <memory>
#include <vector>

#include "backends/ibverbs/soft/soft_verbs.h"
#include "gtest/gtest.h"

namespace rdma_agent::ibverbs {
namespace {

constexpr size_t kBytes = 64 << 10;

struct Side {
  std::unique_ptr<verbs::Device> device;
  std::unique_ptr<verbs::ProtectionDomain> pd;
  std::vector<uint8_t> memory = std::vector<uint8_t>(kBytes);
  std::unique_ptr<verbs::MemoryRegion> mr;
  std::unique_ptr<CompletionPollers> pollers;
  LocalPort local;
};

class ConnectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : {"dev_a", "dev_b"}) {
      verbs::SoftDeviceConfig config;
      config.name = name;
      ASSERT_TRUE(fabric_.AddDevice(config).ok());
    }
    verbs_ = fabric_.MakeVerbs();
    Open("dev_a", a_);
    Open("dev_b", b_);
  }

  void Open(const std::string& name, Side& side) {
    side.device = *verbs_->OpenDevice(name);
    side.pd = *side.device->AllocateProtectionDomain();
    for (size_t i = 0; i < side.memory.size(); ++i) {
      side.memory[i] = static_cast<uint8_t>(i * 31 + name.back());
    }
    side.mr = *side.pd->RegisterMemory(side.memory.data(), side.memory.size(),
                                       IBV_ACCESS_LOCAL_WRITE |
                                           IBV_ACCESS_REMOTE_READ |
                                           IBV_ACCESS_REMOTE_WRITE);
    // Room for two send queues of 8 per CQ.
    side.pollers = std::make_unique<CompletionPollers>(side.device.get(), 16,
                                                       absl::Microseconds(50));
    side.local.device = side.device.get();
    side.local.pd = side.pd.get();
    side.local.lid = side.device->QueryPort(1)->lid;
    side.local.gid = *side.device->QueryGid(1, 0);
    side.local.pollers = side.pollers.get();
  }

  static QueuePairParams Params() {
    QueuePairParams params;
    params.mtu_bytes = 1024;
    params.timeout = 8;
    params.retry_cnt = 2;
    params.sq_depth = 8;
    return params;
  }

  // A requester on a_ connected to a responder on b_.
  struct Pair {
    std::unique_ptr<QueuePairConnection> requester;
    std::unique_ptr<QueuePairConnection> responder;
  };
  Pair Connect() {
    Pair pair;
    auto requester = QueuePairConnection::Create(
        a_.local, Params(), absl::Microseconds(50), absl::Seconds(5),
        QueuePairConnection::Inbound::kRefuse);
    auto responder = QueuePairConnection::Create(
        b_.local, Params(), absl::Microseconds(50), absl::Seconds(5),
        QueuePairConnection::Inbound::kAccept);
    EXPECT_TRUE(requester.ok() && responder.ok());
    if (!requester.ok() || !responder.ok()) return pair;
    EXPECT_TRUE((*requester)->ConnectTo((*responder)->local_endpoint()).ok());
    EXPECT_TRUE((*responder)->ConnectTo((*requester)->local_endpoint()).ok());
    pair.requester = std::move(*requester);
    pair.responder = std::move(*responder);
    return pair;
  }

  // Writes a_[offset, +length) to b_[offset, +length) over `connection`,
  // 8 WRs at a time; the op's status.
  absl::Status Write(QueuePairConnection& connection, uint64_t offset,
                     uint64_t length) {
    auto tracker = std::make_shared<OpTracker>(1);
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    absl::Status posted;
    for (uint64_t done = 0; done < length && posted.ok(); done += 1000) {
      ibv_sge sge = {};
      sge.addr = reinterpret_cast<uint64_t>(a_.memory.data() + offset + done);
      sge.length =
          static_cast<uint32_t>(std::min<uint64_t>(1000, length - done));
      sge.lkey = a_.mr->lkey();
      ibv_send_wr wr = {};
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.wr.rdma.remote_addr =
          reinterpret_cast<uint64_t>(b_.memory.data() + offset + done);
      wr.wr.rdma.rkey = b_.mr->rkey();
      posted = connection.Post(wr, tracker, 0, nullptr, deadline);
    }
    tracker->PostingFinished(0, posted);
    EXPECT_TRUE(tracker->WaitAllDone(deadline));
    return tracker->Results()[0];
  }

  verbs::SoftFabric fabric_;
  std::unique_ptr<verbs::Verbs> verbs_;
  Side a_;
  Side b_;
};

TEST_F(ConnectionTest, QueuePairsShareACompletionQueueUntilItIsFull) {
  std::vector<Pair> pairs;
  pairs.push_back(Connect());
  pairs.push_back(Connect());
  EXPECT_EQ(a_.pollers->size(), 1u) << "two send queues of 8 fit in 16";
  pairs.push_back(Connect());
  EXPECT_EQ(a_.pollers->size(), 2u);
  // Each connection gets its own completions, all at once.
  for (size_t i = 0; i < pairs.size(); ++i) {
    ASSERT_TRUE(Write(*pairs[i].requester, i * 20000, 20000).ok());
  }
  EXPECT_EQ(0, std::memcmp(a_.memory.data(), b_.memory.data(), 60000));
  // A connection that goes frees its entries: the next one takes them.
  pairs.erase(pairs.begin());
  pairs.push_back(Connect());
  EXPECT_EQ(a_.pollers->size(), 2u);
  for (auto& pair : pairs) {
    ASSERT_TRUE(Write(*pair.requester, 60000, 5000).ok());
  }
}

TEST_F(ConnectionTest, AFailedQueuePairBreaksOnlyItself) {
  Pair good = Connect();
  Pair bad = Connect();
  ASSERT_TRUE(Write(*good.requester, 0, 3000).ok());
  // The responder goes: the requester's next WR retries out.
  bad.responder.reset();
  const absl::Status lost = Write(*bad.requester, 100, 10);
  EXPECT_EQ(lost.code(), absl::StatusCode::kUnavailable) << lost;
  EXPECT_TRUE(bad.requester->broken());
  EXPECT_FALSE(good.requester->broken());
  EXPECT_TRUE(Write(*good.requester, 4000, 3000).ok());
  EXPECT_EQ(
      0, std::memcmp(a_.memory.data() + 4000, b_.memory.data() + 4000, 3000));
}

}  // namespace
}  // namespace rdma_agent::ibverbs
