#include "tests/integration/tcp_checks.h"

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/tcp_netns.h"

namespace rdma_agent::testing {

client::OpSpec MakeOp(v1::OpType type, const client::Buffer& local,
                      uint64_t local_offset, uint64_t length,
                      const client::Buffer& remote, uint64_t remote_offset) {
  client::OpSpec op;
  op.type = type;
  op.local_buffer_id = local.id();
  op.local_offset = local_offset;
  op.length = length;
  op.remote_context = remote.remote_context();
  op.remote_offset = remote_offset;
  return op;
}

void ExpectLayout(const client::Buffer& buffer, uint8_t seed, uint64_t offset,
                  uint64_t length, uint8_t inner_seed, uint64_t inner_start,
                  absl::string_view what) {
  const std::byte* data = buffer.data();
  const int64_t before = FindPatternMismatch(data, offset, 0, seed);
  EXPECT_EQ(before, -1) << what << ": byte " << before
                        << " before the op's range changed";
  const int64_t inside =
      FindPatternMismatch(data + offset, length, inner_start, inner_seed);
  EXPECT_EQ(inside, -1) << what << ": byte " << offset + inside
                        << " inside the op's range is wrong";
  const uint64_t end = offset + length;
  const int64_t after =
      FindPatternMismatch(data + end, buffer.size() - end, end, seed);
  EXPECT_EQ(after, -1) << what << ": byte " << end + after
                       << " after the op's range changed";
}

void SweepSizes(client::AgentClient& local_agent, client::Buffer& local,
                client::Buffer& remote, const std::vector<uint64_t>& sizes) {
  FillPattern(local.data(), local.size(), 0, 1);
  FillPattern(remote.data(), remote.size(), 0, 2);
  for (uint64_t size : sizes) {
    SCOPED_TRACE(absl::StrCat("size ", size));
    const uint64_t local_offset = 1 + size % 7;
    const uint64_t remote_offset = 3 + size % 11;

    auto results = local_agent.Submit(
        {MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local, local_offset, size,
                remote, remote_offset)},
        absl::Seconds(120));
    ASSERT_TRUE(results.ok()) << results.status();
    ASSERT_EQ(results->size(), 1u);
    ASSERT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
    EXPECT_EQ((*results)[0].backend, "tcp");
    ExpectLayout(remote, 2, remote_offset, size, 1, local_offset,
                 "remote after write");
    ExpectLayout(local, 1, 0, 0, 1, 0, "local after write");
    FillPattern(remote.data() + remote_offset, size, remote_offset, 2);

    // Read a different remote range into a different local one.
    const uint64_t read_local = 5 + size % 13;
    const uint64_t read_remote = 2 + size % 17;
    results = local_agent.Submit(
        {MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, local, read_local, size, remote,
                read_remote)},
        absl::Seconds(120));
    ASSERT_TRUE(results.ok()) << results.status();
    ASSERT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
    EXPECT_EQ((*results)[0].backend, "tcp");
    ExpectLayout(local, 1, read_local, size, 2, read_remote,
                 "local after read");
    ExpectLayout(remote, 2, 0, 0, 2, 0, "remote after read");
    FillPattern(local.data() + read_local, size, read_local, 1);
  }
}

}  // namespace rdma_agent::testing
