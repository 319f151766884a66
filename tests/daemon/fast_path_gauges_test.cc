// What the fast path keeps shows on a real rdma-agentd's metrics endpoint
// and is given back: imported remotes, prepared transfers and ring sessions
// count while held, and their gauges (count and bytes) return to 0 once
// released, closed, or their client killed.
#include <csignal>
#include <string>
#include <vector>

#include "client/rdma_agent_client.h"
#include "client/ring.h"
#include "gtest/gtest.h"
#include "tests/daemon/agent_gauges.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/eventually.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;

double Gauge(AgentProcess& agent, const std::string& name) {
  auto value = ScrapeSum(agent, name);
  EXPECT_TRUE(value.ok()) << value.status();
  return value.ok() ? *value : -1;
}

TEST(FastPathGaugesTest, WhatTheFastPathKeepsIsCountedAndGivenBack) {
  AgentProcess::Options options;
  options.extra_flags.push_back("--metrics_listen=127.0.0.1:0");
  auto agent = AgentProcess::Start(std::move(options));
  ASSERT_TRUE(agent.ok()) << agent.status();
  auto client = (*agent)->NewClient();
  ASSERT_TRUE(client.ok()) << client.status();
  auto buffer = (*client)->Allocate(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  auto handle = (*client)->ImportRemote(buffer->remote_context());
  ASSERT_TRUE(handle.ok()) << handle.status();
  client::OpSpec op;
  op.type = v1::OP_TYPE_READ_INTO_LOCAL;
  op.local_buffer_id = buffer->id();
  op.length = 8;
  op.remote_handle = handle->handle;
  op.remote_offset = 8;
  auto prepared = (*client)->PrepareTransfer({op});
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  auto ring = (*client)->OpenRing(8);
  ASSERT_TRUE(ring.ok()) << ring.status();

  EXPECT_EQ(Gauge(**agent, "rdma_agentd_remote_handles"), 1);
  EXPECT_GT(Gauge(**agent, "rdma_agentd_remote_handle_bytes"), 0);
  EXPECT_EQ(Gauge(**agent, "rdma_agentd_prepared_transfers"), 1);
  EXPECT_GT(Gauge(**agent, "rdma_agentd_prepared_transfer_bytes"), 0);
  EXPECT_EQ(Gauge(**agent, "rdma_agentd_ring_sessions"), 1);

  ASSERT_TRUE((*client)->ReleaseRemote(handle->handle).ok());
  ASSERT_TRUE((*client)->ReleasePrepared(*prepared).ok());
  ring->reset();
  EXPECT_EQ(Gauge(**agent, "rdma_agentd_remote_handles"), 0);
  EXPECT_EQ(Gauge(**agent, "rdma_agentd_remote_handle_bytes"), 0);
  EXPECT_EQ(Gauge(**agent, "rdma_agentd_prepared_transfers"), 0);
  EXPECT_EQ(Gauge(**agent, "rdma_agentd_prepared_transfer_bytes"), 0);
  EXPECT_TRUE(Eventually(
      [&] { return Gauge(**agent, "rdma_agentd_ring_sessions") == 0; }));
}

}  // namespace
}  // namespace rdma_agent::testing
