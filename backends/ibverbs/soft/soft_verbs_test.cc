// The software RC NIC on its own: keys, access flags, the QP state machine,
// completion codes, the send-queue depth limit, fault injection, and what
// makes a multi-rail host: throttled links, unplugged and replugged ports,
// link speeds and NUMA nodes.
#include "backends/ibverbs/soft/soft_verbs.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include "gtest/gtest.h"

namespace rdma_agent {
namespace verbs {
namespace {

constexpr int kAllAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;

// One side: device, PD, CQ, QP and a 64 KiB buffer.
struct Side {
  std::unique_ptr<Device> device;
  std::unique_ptr<ProtectionDomain> pd;
  std::unique_ptr<CompletionQueue> cq;
  std::unique_ptr<QueuePair> qp;
  std::vector<uint8_t> buffer = std::vector<uint8_t>(64 << 10);
  std::unique_ptr<MemoryRegion> mr;
};

class SoftVerbsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SoftDeviceConfig a;
    a.name = "soft_a";
    a.max_msg_sz = 32 << 10;
    ASSERT_TRUE(fabric_.AddDevice(a).ok());
    SoftDeviceConfig b;
    b.name = "soft_b";
    ASSERT_TRUE(fabric_.AddDevice(b).ok());
    verbs_ = fabric_.MakeVerbs();
    MakeSide("soft_a", a_);
    MakeSide("soft_b", b_);
  }

  void MakeSide(const std::string& name, Side& side, int depth = 16,
                int access = kAllAccess) {
    auto device = verbs_->OpenDevice(name);
    ASSERT_TRUE(device.ok()) << device.status();
    side.device = std::move(*device);
    side.pd = *side.device->AllocateProtectionDomain();
    side.cq = *side.device->CreateCompletionQueue(depth);
    QueuePairInit init;
    init.send_cq = side.cq.get();
    init.recv_cq = side.cq.get();
    init.cap.max_send_wr = depth;
    init.cap.max_send_sge = 2;
    auto qp = side.pd->CreateQueuePair(init);
    ASSERT_TRUE(qp.ok()) << qp.status();
    side.qp = std::move(*qp);
    for (size_t i = 0; i < side.buffer.size(); ++i) {
      side.buffer[i] = static_cast<uint8_t>(i * 7 + name.size());
    }
    auto mr =
        side.pd->RegisterMemory(side.buffer.data(), side.buffer.size(), access);
    ASSERT_TRUE(mr.ok()) << mr.status();
    side.mr = std::move(*mr);
  }

  static absl::Status ToInit(QueuePair& qp, int qp_access = kAllAccess) {
    ibv_qp_attr attr = {};
    attr.qp_state = IBV_QPS_INIT;
    attr.port_num = 1;
    attr.qp_access_flags = qp_access;
    return qp.Modify(attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                               IBV_QP_ACCESS_FLAGS);
  }

  static absl::Status ToRtr(Side& self, Side& peer) {
    ibv_qp_attr attr = {};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = IBV_MTU_1024;
    attr.dest_qp_num = peer.qp->qp_num();
    attr.max_dest_rd_atomic = 4;
    attr.min_rnr_timer = 12;
    attr.ah_attr.is_global = 1;
    attr.ah_attr.port_num = 1;
    attr.ah_attr.grh.dgid = *peer.device->QueryGid(1, 0);
    return self.qp->Modify(attr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                                     IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                     IBV_QP_MAX_DEST_RD_ATOMIC |
                                     IBV_QP_MIN_RNR_TIMER);
  }

  static absl::Status ToRts(QueuePair& qp, uint8_t timeout = 8) {
    ibv_qp_attr attr = {};
    attr.qp_state = IBV_QPS_RTS;
    attr.timeout = timeout;  // 4.096 us * 2^8 ~ 1 ms per try
    attr.retry_cnt = 1;
    attr.rnr_retry = 1;
    attr.max_rd_atomic = 4;
    return qp.Modify(attr, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                               IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                               IBV_QP_MAX_QP_RD_ATOMIC);
  }

  // `b_access`: b_'s qp_access_flags (what a_ may do through b_'s QP).
  void Connect(uint8_t timeout = 8, int b_access = kAllAccess) {
    ASSERT_TRUE(ToInit(*a_.qp).ok());
    ASSERT_TRUE(ToInit(*b_.qp, b_access).ok());
    ASSERT_TRUE(ToRtr(a_, b_).ok());
    ASSERT_TRUE(ToRtr(b_, a_).ok());
    ASSERT_TRUE(ToRts(*a_.qp, timeout).ok());
    ASSERT_TRUE(ToRts(*b_.qp, timeout).ok());
  }

  // Posts one WR from a_ to b_; returns the post's errno.
  int Post(ibv_wr_opcode opcode, uint64_t local_offset, uint32_t length,
           uint64_t remote_offset, uint64_t wr_id = 1, uint32_t lkey = 0,
           uint32_t rkey = 0) {
    ibv_sge sge = {};
    sge.addr = reinterpret_cast<uint64_t>(a_.buffer.data() + local_offset);
    sge.length = length;
    sge.lkey = lkey != 0 ? lkey : a_.mr->lkey();
    ibv_send_wr wr = {};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = opcode;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr =
        reinterpret_cast<uint64_t>(b_.buffer.data()) + remote_offset;
    wr.wr.rdma.rkey = rkey != 0 ? rkey : b_.mr->rkey();
    ibv_send_wr* bad = nullptr;
    return a_.qp->PostSend(&wr, &bad);
  }

  // Waits (bounded) for the next completion on a_'s CQ.
  ibv_wc NextCompletion(absl::Duration limit = absl::Seconds(5)) {
    const absl::Time deadline = absl::Now() + limit;
    ibv_wc wc = {};
    while (absl::Now() < deadline) {
      auto n = a_.cq->Poll(absl::MakeSpan(&wc, 1));
      EXPECT_TRUE(n.ok());
      if (*n == 1) return wc;
      EXPECT_TRUE(a_.cq->RequestNotify().ok());
      n = a_.cq->Poll(absl::MakeSpan(&wc, 1));
      if (*n == 1) return wc;
      (void)a_.cq->WaitForEvent(deadline - absl::Now());
    }
    ADD_FAILURE() << "no completion within " << limit;
    wc.status = IBV_WC_GENERAL_ERR;
    wc.wr_id = ~0ull;
    return wc;
  }

  ibv_qp_state StateOf(QueuePair& qp) { return *qp.QueryState(); }

  SoftFabric fabric_;
  std::unique_ptr<Verbs> verbs_;
  Side a_;
  Side b_;
};

TEST_F(SoftVerbsTest, ListsAndOpensOnlyItsDevices) {
  EXPECT_EQ(*fabric_.MakeVerbs({"soft_b"})->ListDevices(),
            std::vector<std::string>({"soft_b"}));
  EXPECT_EQ(fabric_.MakeVerbs({"soft_b"})->OpenDevice("soft_a").status().code(),
            absl::StatusCode::kNotFound);
  SoftDeviceConfig again;
  again.name = "soft_a";
  EXPECT_EQ(fabric_.AddDevice(again).code(), absl::StatusCode::kAlreadyExists);
}

TEST_F(SoftVerbsTest, WriteAndReadMoveExactlyTheRange) {
  Connect();
  const std::vector<uint8_t> before = b_.buffer;
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 3, 1001, 77, 42), 0);
  ibv_wc wc = NextCompletion();
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.wr_id, 42u);
  EXPECT_EQ(wc.opcode, IBV_WC_RDMA_WRITE);
  EXPECT_EQ(wc.byte_len, 1001u);
  for (size_t i = 0; i < b_.buffer.size(); ++i) {
    const uint8_t want =
        (i >= 77 && i < 77 + 1001) ? a_.buffer[i - 77 + 3] : before[i];
    ASSERT_EQ(b_.buffer[i], want) << "byte " << i;
  }
  const std::vector<uint8_t> local_before = a_.buffer;
  ASSERT_EQ(Post(IBV_WR_RDMA_READ, 5000, 333, 9000, 43), 0);
  wc = NextCompletion();
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.opcode, IBV_WC_RDMA_READ);
  for (size_t i = 0; i < a_.buffer.size(); ++i) {
    const uint8_t want =
        (i >= 5000 && i < 5333) ? b_.buffer[i - 5000 + 9000] : local_before[i];
    ASSERT_EQ(a_.buffer[i], want) << "byte " << i;
  }
}

TEST_F(SoftVerbsTest, PostingBelowRtsFailsWithEinval) {
  EXPECT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 8, 0), EINVAL);  // RESET
  ASSERT_TRUE(ToInit(*a_.qp).ok());
  EXPECT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 8, 0), EINVAL);  // INIT
  ASSERT_TRUE(ToInit(*b_.qp).ok());
  ASSERT_TRUE(ToRtr(a_, b_).ok());
  EXPECT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 8, 0), EINVAL);  // RTR
  ASSERT_TRUE(ToRts(*a_.qp).ok());
  ASSERT_TRUE(ToRtr(b_, a_).ok());
  EXPECT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 8, 0), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_SUCCESS);
}

TEST_F(SoftVerbsTest, IllegalTransitionsAndMissingAttributesFail) {
  ibv_qp_attr attr = {};
  attr.qp_state = IBV_QPS_RTS;
  EXPECT_EQ(a_.qp->Modify(attr, IBV_QP_STATE).code(),
            absl::StatusCode::kInvalidArgument);  // RESET -> RTS
  attr = {};
  attr.qp_state = IBV_QPS_INIT;
  attr.port_num = 1;
  EXPECT_EQ(a_.qp->Modify(attr, IBV_QP_STATE | IBV_QP_PORT).code(),
            absl::StatusCode::kInvalidArgument);  // no ACCESS_FLAGS
  EXPECT_EQ(StateOf(*a_.qp), IBV_QPS_RESET);
  ASSERT_TRUE(ToInit(*a_.qp).ok());
  attr = {};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = IBV_MTU_1024;
  EXPECT_EQ(a_.qp->Modify(attr, IBV_QP_STATE | IBV_QP_PATH_MTU).code(),
            absl::StatusCode::kInvalidArgument);  // no AV, DEST_QPN...
  EXPECT_EQ(StateOf(*a_.qp), IBV_QPS_INIT);
  ASSERT_TRUE(ToInit(*b_.qp).ok());
  ASSERT_TRUE(ToRtr(a_, b_).ok());
  attr = {};
  attr.qp_state = IBV_QPS_RTS;
  EXPECT_EQ(a_.qp->Modify(attr, IBV_QP_STATE).code(),
            absl::StatusCode::kInvalidArgument);  // no TIMEOUT, RETRY_CNT...
  ASSERT_TRUE(ToRts(*a_.qp).ok());
  EXPECT_EQ(StateOf(*a_.qp), IBV_QPS_RTS);
  attr = {};
  attr.qp_state = IBV_QPS_ERR;
  ASSERT_TRUE(a_.qp->Modify(attr, IBV_QP_STATE).ok());
  EXPECT_EQ(StateOf(*a_.qp), IBV_QPS_ERR);
  attr.qp_state = IBV_QPS_RTS;
  EXPECT_EQ(a_.qp->Modify(attr, IBV_QP_STATE | IBV_QP_TIMEOUT).code(),
            absl::StatusCode::kInvalidArgument);  // ERR -> RTS
  attr.qp_state = IBV_QPS_RESET;
  ASSERT_TRUE(a_.qp->Modify(attr, IBV_QP_STATE).ok());
  EXPECT_TRUE(ToInit(*a_.qp).ok());  // usable again from RESET
}

TEST_F(SoftVerbsTest, WrongRkeyIsRemoteAccessErrorAndBreaksBothQps) {
  Connect();
  const std::vector<uint8_t> before = b_.buffer;
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 1, 0, b_.mr->rkey() + 1000), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(StateOf(*a_.qp), IBV_QPS_ERR);
  EXPECT_EQ(StateOf(*b_.qp), IBV_QPS_ERR);
  EXPECT_EQ(b_.buffer, before);
  // Posting in ERR is allowed and flushes.
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 2), 0);
  ibv_wc wc = NextCompletion();
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(wc.wr_id, 2u);
  EXPECT_EQ(b_.buffer, before);
}

TEST_F(SoftVerbsTest, RemoteBoundsAndAccessFlagsAreChecked) {
  Connect();
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, b_.buffer.size() - 63), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_REM_ACCESS_ERR);
}

TEST_F(SoftVerbsTest, ReadOnlyRemoteMrRefusesWritesButServesReads) {
  b_.mr = *b_.pd->RegisterMemory(b_.buffer.data(), b_.buffer.size(),
                                 IBV_ACCESS_REMOTE_READ);
  Connect();
  ASSERT_EQ(Post(IBV_WR_RDMA_READ, 0, 64, 0, 1), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_SUCCESS);
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 2), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_REM_ACCESS_ERR);
}

// A real NIC refuses an inbound READ/WRITE the target QP's qp_access_flags
// do not enable, whatever the MR allows: the agent's requester QPs rely on
// it to refuse RDMA from whoever answered their handshake.
TEST_F(SoftVerbsTest, TargetQpAccessFlagsAreEnforced) {
  Connect(8, IBV_ACCESS_LOCAL_WRITE);  // b_ refuses all inbound RDMA
  const std::vector<uint8_t> before = b_.buffer;
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 1), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(b_.buffer, before);
  EXPECT_EQ(StateOf(*b_.qp), IBV_QPS_ERR);
}

TEST_F(SoftVerbsTest, TargetQpWithRemoteReadOnlyRefusesWrites) {
  Connect(8, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
  const std::vector<uint8_t> before = b_.buffer;
  ASSERT_EQ(Post(IBV_WR_RDMA_READ, 0, 64, 0, 1), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_SUCCESS);
  EXPECT_EQ(0, std::memcmp(a_.buffer.data(), b_.buffer.data(), 64));
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 100, 64, 0, 2), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(b_.buffer, before);
}

TEST_F(SoftVerbsTest, TargetQpWithoutRemoteReadRefusesReads) {
  Connect(8, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  const std::vector<uint8_t> before = a_.buffer;
  ASSERT_EQ(Post(IBV_WR_RDMA_READ, 0, 64, 0, 1), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(a_.buffer, before);
}

// An rkey of an MR in another PD of the same device does not work on a QP
// of this PD, even with remote access: per-peer PDs rely on it.
TEST_F(SoftVerbsTest, MrOfAnotherProtectionDomainIsRemoteAccessError) {
  auto other_pd = b_.device->AllocateProtectionDomain();
  ASSERT_TRUE(other_pd.ok());
  auto other_mr = (*other_pd)->RegisterMemory(b_.buffer.data(),
                                              b_.buffer.size(), kAllAccess);
  ASSERT_TRUE(other_mr.ok());
  Connect();
  const std::vector<uint8_t> before = b_.buffer;
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 1, 0, (*other_mr)->rkey()), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(b_.buffer, before);
}

TEST_F(SoftVerbsTest, CountsLiveQueuePairs) {
  EXPECT_EQ(fabric_.live_queue_pairs(), 2u);  // a_ and b_
  b_.qp.reset();
  EXPECT_EQ(fabric_.live_queue_pairs(), 1u);
}

TEST_F(SoftVerbsTest, LocalKeyAndLocalWriteAreChecked) {
  Connect();
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 1, a_.mr->lkey() + 1000), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_LOC_PROT_ERR);
}

TEST_F(SoftVerbsTest, ReadIntoMrWithoutLocalWriteIsLocalProtectionError) {
  a_.mr = *a_.pd->RegisterMemory(a_.buffer.data(), a_.buffer.size(),
                                 IBV_ACCESS_REMOTE_READ);
  Connect();
  ASSERT_EQ(Post(IBV_WR_RDMA_READ, 0, 64, 0), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_LOC_PROT_ERR);
}

TEST_F(SoftVerbsTest, RemoteWriteWithoutLocalWriteCannotBeRegistered) {
  EXPECT_EQ(a_.pd->RegisterMemory(a_.buffer.data(), 64, IBV_ACCESS_REMOTE_WRITE)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(SoftVerbsTest, MessageAboveMaxMsgSizeIsLocalLengthError) {
  Connect();
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, (32 << 10) + 1, 0), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_LOC_LEN_ERR);
}

TEST_F(SoftVerbsTest, DeregisteredMrIsNoLongerReachable) {
  Connect();
  const uint32_t rkey = b_.mr->rkey();
  b_.mr.reset();
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 1, 0, rkey), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_REM_ACCESS_ERR);
}

TEST_F(SoftVerbsTest, SendQueueDepthLimitsPostingUntilCompletionsArePolled) {
  MakeSide("soft_a", a_, /*depth=*/4);
  Connect();
  SoftFault delay;
  delay.action = SoftFault::Action::kDelay;
  delay.delay = absl::Milliseconds(20);
  delay.count = 4;
  fabric_.InjectFault(delay);
  for (int i = 0; i < 4; ++i) {
    ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 8, 0, i), 0);
  }
  EXPECT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 8, 0, 4), ENOMEM);
  EXPECT_EQ(fabric_.max_outstanding_seen(), 4);
  for (uint64_t i = 0; i < 4; ++i) {
    ibv_wc wc = NextCompletion();
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
    EXPECT_EQ(wc.wr_id, i);  // RC completes in order
  }
  EXPECT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 8, 0, 5), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_SUCCESS);
}

TEST_F(SoftVerbsTest, CompletionsAreAsynchronousAndDelayed) {
  Connect();
  SoftFault delay;
  delay.action = SoftFault::Action::kDelay;
  delay.delay = absl::Milliseconds(100);
  fabric_.InjectFault(delay);
  const absl::Time start = absl::Now();
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 8, 0), 0);
  ibv_wc wc;
  EXPECT_EQ(*a_.cq->Poll(absl::MakeSpan(&wc, 1)), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_SUCCESS);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
}

TEST_F(SoftVerbsTest, DroppedWrRetryExceedsAfterTheTransportTimeout) {
  Connect(/*timeout=*/8);  // ~1 ms per try, 2 tries
  SoftFault drop;
  drop.action = SoftFault::Action::kDrop;
  fabric_.InjectFault(drop);
  const std::vector<uint8_t> before = b_.buffer;
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 1), 0);
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 2), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_RETRY_EXC_ERR);
  ibv_wc wc = NextCompletion();
  EXPECT_EQ(wc.wr_id, 2u);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);  // behind the failed one
  EXPECT_EQ(b_.buffer, before);
}

TEST_F(SoftVerbsTest, DroppedWrWithInfiniteTimeoutWaitsUntilErrorThenFlushes) {
  Connect(/*timeout=*/0);
  SoftFault drop;
  drop.action = SoftFault::Action::kDrop;
  fabric_.InjectFault(drop);
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 1), 0);
  ibv_wc wc;
  EXPECT_EQ(*a_.cq->Poll(absl::MakeSpan(&wc, 1)), 0);
  EXPECT_FALSE(*a_.cq->WaitForEvent(absl::Milliseconds(50)));
  ibv_qp_attr attr = {};
  attr.qp_state = IBV_QPS_ERR;
  ASSERT_TRUE(a_.qp->Modify(attr, IBV_QP_STATE).ok());
  EXPECT_EQ(NextCompletion().status, IBV_WC_WR_FLUSH_ERR);
}

TEST_F(SoftVerbsTest, FailFaultCompletesWithTheGivenStatus) {
  Connect();
  SoftFault fail;
  fail.action = SoftFault::Action::kFail;
  fail.status = IBV_WC_REM_OP_ERR;
  fail.device = "soft_a";
  fabric_.InjectFault(fail);
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 1), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_REM_OP_ERR);
  EXPECT_EQ(StateOf(*a_.qp), IBV_QPS_ERR);
}

TEST_F(SoftVerbsTest, FaultsForAnotherDeviceDoNotApply) {
  Connect();
  SoftFault fail;
  fail.action = SoftFault::Action::kFail;
  fail.device = "soft_b";
  fabric_.InjectFault(fail);
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 1), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_SUCCESS);
}

TEST_F(SoftVerbsTest, GonePeerOrUnreachableDeviceRetryExceeds) {
  Connect();
  fabric_.SetReachable("soft_b", false);
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 1), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_RETRY_EXC_ERR);
  fabric_.SetReachable("soft_b", true);

  // A fresh pair, then the responder QP disappears.
  MakeSide("soft_a", a_);
  MakeSide("soft_b", b_);
  Connect();
  b_.qp.reset();
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 2), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_RETRY_EXC_ERR);
}

TEST_F(SoftVerbsTest, ErrorFlushesQueuedWorkRequests) {
  Connect();
  SoftFault delay;
  delay.action = SoftFault::Action::kDelay;
  delay.delay = absl::Seconds(30);
  fabric_.InjectFault(delay);
  const std::vector<uint8_t> before = b_.buffer;
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 1), 0);
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 2), 0);
  ibv_qp_attr attr = {};
  attr.qp_state = IBV_QPS_ERR;
  ASSERT_TRUE(a_.qp->Modify(attr, IBV_QP_STATE).ok());
  EXPECT_EQ(NextCompletion(absl::Seconds(2)).status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(NextCompletion(absl::Seconds(2)).status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(b_.buffer, before);
}

TEST_F(SoftVerbsTest, CompletionChannelFiresOnlyWhenArmed) {
  Connect();
  EXPECT_FALSE(*a_.cq->WaitForEvent(absl::Milliseconds(10)));
  ASSERT_TRUE(a_.cq->RequestNotify().ok());
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 8, 0), 0);
  EXPECT_TRUE(*a_.cq->WaitForEvent(absl::Seconds(5)));
  ibv_wc wc;
  EXPECT_EQ(*a_.cq->Poll(absl::MakeSpan(&wc, 1)), 1);
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 8, 0), 0);  // not armed
  EXPECT_FALSE(*a_.cq->WaitForEvent(absl::Milliseconds(50)));
}

TEST_F(SoftVerbsTest, DeviceReportsPortAndGid) {
  auto port = a_.device->QueryPort(1);
  ASSERT_TRUE(port.ok());
  EXPECT_EQ(port->state, IBV_PORT_ACTIVE);
  EXPECT_EQ(port->max_msg_sz, 32u << 10);
  EXPECT_EQ(a_.device->QueryPort(2).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_NE(GidToString(*a_.device->QueryGid(1, 0)),
            GidToString(*b_.device->QueryGid(1, 0)));
}

// --- Links: throttling, unplug/replug, speed, NUMA ------------------------

// A device whose link carries 1 KiB/s (burst 1 KiB): a 48 KiB WR would wait
// most of a minute for it, so anything the test sees happen to such a WR
// happened while it waited for the link.
SoftDeviceConfig SlowDevice(const std::string& name) {
  SoftDeviceConfig config;
  config.name = name;
  config.bytes_per_second = 1024;
  config.burst_bytes = 1024;
  return config;
}

class SoftLinkTest : public SoftVerbsTest {
 protected:
  // Re-creates both sides on `a` and `b`, connected.
  void UseDevices(const SoftDeviceConfig& a, const SoftDeviceConfig& b) {
    ASSERT_TRUE(fabric_.AddDevice(a).ok());
    ASSERT_TRUE(fabric_.AddDevice(b).ok());
    MakeSide(a.name, a_);
    MakeSide(b.name, b_);
    Connect();
  }
};

TEST_F(SoftLinkTest, ThrottledWrWaitsForItsLinkAndIsFlushedFromIt) {
  SoftDeviceConfig fast;
  fast.name = "fast_b";
  UseDevices(SlowDevice("slow_a"), fast);
  const std::vector<uint8_t> before = b_.buffer;
  // Within the burst: goes at once.
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 1000, 0, 1), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_SUCCESS);
  EXPECT_EQ(0, std::memcmp(b_.buffer.data(), a_.buffer.data(), 1000));
  EXPECT_EQ(fabric_.bytes_moved("slow_a"), 1000u);
  // Far beyond it: held by the link until the QP is moved to ERR.
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 48 << 10, 4096, 2), 0);
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 60000, 3), 0);
  ibv_wc wc;
  EXPECT_EQ(*a_.cq->Poll(absl::MakeSpan(&wc, 1)), 0);
  ibv_qp_attr attr = {};
  attr.qp_state = IBV_QPS_ERR;
  ASSERT_TRUE(a_.qp->Modify(attr, IBV_QP_STATE).ok());
  wc = NextCompletion();
  EXPECT_EQ(wc.wr_id, 2u);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
  wc = NextCompletion();
  EXPECT_EQ(wc.wr_id, 3u);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
  for (size_t i = 1000; i < b_.buffer.size(); ++i) {
    ASSERT_EQ(b_.buffer[i], before[i]) << "byte " << i;
  }
  EXPECT_EQ(fabric_.bytes_moved("slow_a"), 1000u);
}

// The responder's link limits too: a WR crosses both.
TEST_F(SoftLinkTest, ResponderLinkThrottlesAsWell) {
  SoftDeviceConfig fast;
  fast.name = "fast_a";
  UseDevices(fast, SlowDevice("slow_b"));
  const std::vector<uint8_t> local_before = a_.buffer;
  ASSERT_EQ(Post(IBV_WR_RDMA_READ, 0, 48 << 10, 0, 1), 0);
  ibv_wc wc;
  EXPECT_EQ(*a_.cq->Poll(absl::MakeSpan(&wc, 1)), 0);
  ibv_qp_attr attr = {};
  attr.qp_state = IBV_QPS_ERR;
  ASSERT_TRUE(a_.qp->Modify(attr, IBV_QP_STATE).ok());
  EXPECT_EQ(NextCompletion().status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(a_.buffer, local_before);
  EXPECT_EQ(fabric_.bytes_moved("fast_a"), 0u);
}

TEST_F(SoftLinkTest, UnpluggingFailsTheWrOnTheLinkThenFlushesTheRest) {
  SoftDeviceConfig fast;
  fast.name = "fast_b";
  UseDevices(SlowDevice("slow_a"), fast);
  const std::vector<uint8_t> before = b_.buffer;
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 48 << 10, 0, 1), 0);
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 60000, 2), 0);
  ASSERT_EQ(a_.device->QueryPort(1)->state, IBV_PORT_ACTIVE);
  ASSERT_TRUE(fabric_.Unplug("slow_a").ok());
  EXPECT_EQ(a_.device->QueryPort(1)->state, IBV_PORT_DOWN);
  // The WR on the link retries out (transport timeout ~1 ms x 2 here), the
  // one behind it is flushed: the QP is in ERR.
  ibv_wc wc = NextCompletion();
  EXPECT_EQ(wc.wr_id, 1u);
  EXPECT_EQ(wc.status, IBV_WC_RETRY_EXC_ERR);
  wc = NextCompletion();
  EXPECT_EQ(wc.wr_id, 2u);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(StateOf(*a_.qp), IBV_QPS_ERR);
  EXPECT_EQ(b_.buffer, before);
  EXPECT_EQ(fabric_.bytes_moved("slow_a"), 0u);
}

TEST(SoftAsyncEventTest, PortChangesAreToldToEveryOpenedContext) {
  SoftFabric fabric;
  SoftDeviceConfig config;
  config.name = "ev0";
  config.port_state = IBV_PORT_DOWN;
  ASSERT_TRUE(fabric.AddDevice(config).ok());
  auto verbs = fabric.MakeVerbs();
  auto first = verbs->OpenDevice("ev0");
  auto second = verbs->OpenDevice("ev0");
  ASSERT_TRUE(first.ok() && second.ok());
  const auto next = [](verbs::Device& device) {
    auto event = device.GetAsyncEvent(absl::Milliseconds(200));
    EXPECT_TRUE(event.ok()) << event.status();
    return event.ok() ? *event : std::nullopt;
  };
  // Nothing happened yet: the wait times out.
  EXPECT_EQ(next(**first), std::nullopt);
  // The port comes up (link trained), goes down (unplugged), comes back.
  ASSERT_TRUE(fabric.SetPortState("ev0", IBV_PORT_INIT).ok());  // no event
  ASSERT_TRUE(fabric.SetPortState("ev0", IBV_PORT_ACTIVE).ok());
  EXPECT_EQ((*first)->QueryPort(1)->state, IBV_PORT_ACTIVE);
  ASSERT_TRUE(fabric.Unplug("ev0").ok());
  ASSERT_TRUE(fabric.Unplug("ev0").ok());  // no change, no event
  ASSERT_TRUE(fabric.Replug("ev0").ok());
  for (auto* device : {&*first, &*second}) {
    std::vector<std::pair<ibv_event_type, int>> got;
    while (auto event = next(**device))
      got.push_back({event->type, event->port});
    EXPECT_EQ(got, (std::vector<std::pair<ibv_event_type, int>>{
                       {IBV_EVENT_PORT_ACTIVE, 1},
                       {IBV_EVENT_PORT_ERR, 1},
                       {IBV_EVENT_PORT_ACTIVE, 1}}));
  }
  // A context opened afterwards gets only what happens afterwards.
  auto third = verbs->OpenDevice("ev0");
  ASSERT_TRUE(third.ok());
  ASSERT_TRUE(fabric.SetPortState("ev0", IBV_PORT_ARMED).ok());
  auto event = next(**third);
  ASSERT_TRUE(event.has_value());
  EXPECT_EQ(event->type, IBV_EVENT_PORT_ERR);
  EXPECT_EQ(next(**third), std::nullopt);
  EXPECT_EQ(fabric.SetPortState("nope", IBV_PORT_ACTIVE).code(),
            absl::StatusCode::kNotFound);
}

TEST(SoftAsyncEventTest, ADeviceWithoutEventsOnlyShowsChangesInQueryPort) {
  SoftFabric fabric;
  SoftDeviceConfig config;
  config.name = "quiet0";
  config.async_events = false;
  ASSERT_TRUE(fabric.AddDevice(config).ok());
  auto device = fabric.MakeVerbs()->OpenDevice("quiet0");
  ASSERT_TRUE(device.ok());
  ASSERT_TRUE(fabric.Unplug("quiet0").ok());
  EXPECT_EQ((*device)->QueryPort(1)->state, IBV_PORT_DOWN);
  auto event = (*device)->GetAsyncEvent(absl::Milliseconds(50));
  ASSERT_TRUE(event.ok());
  EXPECT_EQ(*event, std::nullopt);
}

TEST_F(SoftLinkTest, WrsPostedWhileUnpluggedRetryOutAndReplugBringsItBack) {
  SoftDeviceConfig a;
  a.name = "plug_a";
  SoftDeviceConfig b;
  b.name = "plug_b";
  UseDevices(a, b);
  ASSERT_TRUE(fabric_.Unplug("plug_a").ok());
  const std::vector<uint8_t> before = b_.buffer;
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 1), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_RETRY_EXC_ERR);
  EXPECT_EQ(b_.buffer, before);
  ASSERT_TRUE(fabric_.Replug("plug_a").ok());
  EXPECT_EQ(a_.device->QueryPort(1)->state, IBV_PORT_ACTIVE);
  // The QP that failed stays in ERR, as on hardware: its WRs flush.
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 0, 64, 0, 2), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_WR_FLUSH_ERR);
  // New QPs work.
  MakeSide("plug_a", a_);
  MakeSide("plug_b", b_);
  Connect();
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 5, 777, 9, 3), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_SUCCESS);
  EXPECT_EQ(0, std::memcmp(b_.buffer.data() + 9, a_.buffer.data() + 5, 777));
  EXPECT_EQ(fabric_.bytes_moved("plug_a"), 777u);
  EXPECT_EQ(fabric_.bytes_served("plug_b"), 777u);
  EXPECT_EQ(fabric_.bytes_served("plug_a"), 0u);
}

TEST_F(SoftLinkTest, UnpluggedResponderRetriesOutAndIdleQpsSurviveIt) {
  SoftDeviceConfig a;
  a.name = "plug_a";
  SoftDeviceConfig b;
  b.name = "plug_b";
  UseDevices(a, b);
  ASSERT_TRUE(fabric_.Unplug("plug_b").ok());
  ASSERT_TRUE(fabric_.Replug("plug_b").ok());
  // Nothing was on the wire while it was out: the QP is still RTS.
  ASSERT_EQ(Post(IBV_WR_RDMA_READ, 0, 100, 200, 1), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_SUCCESS);
  EXPECT_EQ(0, std::memcmp(a_.buffer.data(), b_.buffer.data() + 200, 100));
  ASSERT_TRUE(fabric_.Unplug("plug_b").ok());
  const std::vector<uint8_t> before = a_.buffer;
  ASSERT_EQ(Post(IBV_WR_RDMA_READ, 0, 100, 300, 2), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_RETRY_EXC_ERR);
  EXPECT_EQ(a_.buffer, before);
  EXPECT_EQ(fabric_.Unplug("no_such").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(fabric_.Replug("no_such").code(), absl::StatusCode::kNotFound);
}

TEST_F(SoftLinkTest, ZeroLengthWriteProbesThePathWithoutAKey) {
  SoftDeviceConfig a;
  a.name = "plug_a";
  SoftDeviceConfig b;
  b.name = "plug_b";
  UseDevices(a, b);
  const std::vector<uint8_t> before = b_.buffer;
  ibv_send_wr wr = {};
  wr.wr_id = 7;
  wr.num_sge = 0;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(a_.qp->PostSend(&wr, &bad), 0);
  ibv_wc wc = NextCompletion();
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.byte_len, 0u);
  EXPECT_EQ(b_.buffer, before);
  ASSERT_TRUE(fabric_.Unplug("plug_b").ok());
  ASSERT_EQ(a_.qp->PostSend(&wr, &bad), 0);
  EXPECT_EQ(NextCompletion().status, IBV_WC_RETRY_EXC_ERR);
}

TEST_F(SoftLinkTest, DevicesReportTheirSpeedAndNumaNode) {
  SoftDeviceConfig hdr;
  hdr.name = "hdr_0";
  hdr.active_speed = 64;  // HDR lanes
  hdr.active_width = 2;   // 4x
  hdr.numa_node = 1;
  ASSERT_TRUE(fabric_.AddDevice(hdr).ok());
  auto device = verbs_->OpenDevice("hdr_0");
  ASSERT_TRUE(device.ok());
  EXPECT_EQ((*device)->NumaNode(), 1);
  EXPECT_DOUBLE_EQ(PortSpeedGbps(*(*device)->QueryPort(1)), 212.5);
  EXPECT_EQ(a_.device->NumaNode(), -1);
  EXPECT_DOUBLE_EQ(PortSpeedGbps(*a_.device->QueryPort(1)), 103.125);
}

}  // namespace
// What ibv_reg_dmabuf_mr on the soft NIC takes for a dma-buf: a memfd here.
class SoftDmaBufTest : public SoftVerbsTest {
 protected:
  static constexpr uint64_t kDmaBufBytes = 3 * 4096;
  static constexpr uint64_t kOffset = 4096 + 100;  // not page-aligned
  static constexpr size_t kLength = 4096;
  static constexpr uint64_t kIova = 0x10000;

  void SetUp() override {
    SoftVerbsTest::SetUp();
    fd_ = ::memfd_create("soft-dmabuf", MFD_CLOEXEC);
    ASSERT_GE(fd_, 0);
    ASSERT_EQ(::ftruncate(fd_, kDmaBufBytes), 0);
    void* view = ::mmap(nullptr, kDmaBufBytes, PROT_READ | PROT_WRITE,
                        MAP_SHARED, fd_, 0);
    ASSERT_NE(view, MAP_FAILED);
    view_ = static_cast<uint8_t*>(view);
  }
  void TearDown() override {
    if (view_ != nullptr) ::munmap(view_, kDmaBufBytes);
    if (fd_ >= 0) ::close(fd_);
  }

  // One RDMA op from a_'s buffer to `remote_addr` under `rkey`.
  ibv_wc_status RunOne(ibv_wr_opcode opcode, uint64_t local_offset,
                       uint32_t length, uint64_t remote_addr, uint32_t rkey) {
    ibv_sge sge = {};
    sge.addr = reinterpret_cast<uint64_t>(a_.buffer.data() + local_offset);
    sge.length = length;
    sge.lkey = a_.mr->lkey();
    ibv_send_wr wr = {};
    wr.wr_id = 7;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = opcode;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = remote_addr;
    wr.wr.rdma.rkey = rkey;
    ibv_send_wr* bad = nullptr;
    EXPECT_EQ(a_.qp->PostSend(&wr, &bad), 0);
    return NextCompletion().status;
  }

  int fd_ = -1;
  uint8_t* view_ = nullptr;
};

TEST_F(SoftDmaBufTest, IsAddressedByIovaAndLandsInTheFdsBytes) {
  auto mr = b_.pd->RegisterDmaBuf(kOffset, kLength, kIova, fd_, kAllAccess);
  ASSERT_TRUE(mr.ok()) << mr.status();
  EXPECT_EQ(reinterpret_cast<uint64_t>((*mr)->addr()), kIova);
  EXPECT_EQ((*mr)->length(), kLength);
  Connect();

  std::vector<uint8_t> expected(view_, view_ + kDmaBufBytes);
  std::memcpy(expected.data() + kOffset + 10, a_.buffer.data() + 5, 200);
  EXPECT_EQ(RunOne(IBV_WR_RDMA_WRITE, 5, 200, kIova + 10, (*mr)->rkey()),
            IBV_WC_SUCCESS);
  EXPECT_EQ(std::memcmp(view_, expected.data(), kDmaBufBytes), 0);

  view_[kOffset + kLength - 1] = 0xab;
  EXPECT_EQ(RunOne(IBV_WR_RDMA_READ, 0, 1, kIova + kLength - 1, (*mr)->rkey()),
            IBV_WC_SUCCESS);
  EXPECT_EQ(a_.buffer[0], 0xab);
}

TEST_F(SoftDmaBufTest, ChecksAccessLikeOtherMrs) {
  auto read_only =
      b_.pd->RegisterDmaBuf(kOffset, kLength, kIova, fd_,
                            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
  ASSERT_TRUE(read_only.ok()) << read_only.status();
  Connect();
  const std::vector<uint8_t> before(view_, view_ + kDmaBufBytes);
  EXPECT_EQ(RunOne(IBV_WR_RDMA_WRITE, 0, 64, kIova, (*read_only)->rkey()),
            IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(std::memcmp(view_, before.data(), kDmaBufBytes), 0);
}

TEST_F(SoftDmaBufTest, ChecksBoundsLikeOtherMrs) {
  auto mr = b_.pd->RegisterDmaBuf(kOffset, kLength, kIova, fd_, kAllAccess);
  ASSERT_TRUE(mr.ok()) << mr.status();
  Connect();
  const std::vector<uint8_t> before(view_, view_ + kDmaBufBytes);
  // The fd goes on past the MR's end; the MR does not.
  EXPECT_EQ(
      RunOne(IBV_WR_RDMA_WRITE, 0, 64, kIova + kLength - 32, (*mr)->rkey()),
      IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(std::memcmp(view_, before.data(), kDmaBufBytes), 0);
}

TEST_F(SoftDmaBufTest, RefusesWhatIsNoMappableRange) {
  const int access = kAllAccess;
  EXPECT_EQ(b_.pd->RegisterDmaBuf(0, 0, kIova, fd_, access).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_.pd->RegisterDmaBuf(kDmaBufBytes - 10, 100, kIova, fd_, access)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_.pd->RegisterDmaBuf(0, 100, kIova, -1, access).status().code(),
            absl::StatusCode::kInvalidArgument);
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  EXPECT_EQ(
      b_.pd->RegisterDmaBuf(0, 100, kIova, pair[0], access).status().code(),
      absl::StatusCode::kInvalidArgument);
  ::close(pair[0]);
  ::close(pair[1]);
  EXPECT_EQ(b_.pd->RegisterDmaBuf(0, 100, kIova, fd_, IBV_ACCESS_REMOTE_WRITE)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace verbs
}  // namespace rdma_agent
