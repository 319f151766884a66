#include "tests/integration/tcp_checks.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "gtest/gtest.h"
#include "tests/testing/pattern.h"

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
  // Each region checked on its own, so that a failure says which it was.
  const absl::Span<const std::byte> bytes = buffer.bytes();
  const uint64_t end = offset + length;
  const std::optional<uint64_t> before =
      FindMismatch(bytes.subspan(0, offset), seed, 0);
  EXPECT_EQ(before, std::nullopt) << what << ": byte " << before.value_or(0)
                                  << " before the op's range changed";
  const std::optional<uint64_t> inside =
      FindMismatch(bytes.subspan(offset, length), inner_seed, inner_start);
  EXPECT_EQ(inside, std::nullopt)
      << what << ": byte " << offset + inside.value_or(0)
      << " inside the op's range is wrong";
  const std::optional<uint64_t> after =
      FindMismatch(bytes.subspan(end), seed, end);
  EXPECT_EQ(after, std::nullopt) << what << ": byte " << end + after.value_or(0)
                                 << " after the op's range changed";
}

void SweepSizes(client::AgentClient& local_agent, client::Buffer& local,
                client::Buffer& remote, const std::vector<uint64_t>& sizes) {
  FillPattern(local.bytes(), 1);
  FillPattern(remote.bytes(), 2);
  for (uint64_t size : sizes) {
    SCOPED_TRACE(absl::StrCat("size ", size));
    const uint64_t local_offset = 1 + size % 7;
    const uint64_t remote_offset = 3 + size % 11;

    auto results =
        local_agent.Submit({MakeOp(v1::OP_TYPE_WRITE_FROM_LOCAL, local,
                                   local_offset, size, remote, remote_offset)},
                           absl::Seconds(120));
    ASSERT_TRUE(results.ok()) << results.status();
    ASSERT_EQ(results->size(), 1u);
    ASSERT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
    EXPECT_EQ((*results)[0].backend, "tcp");
    ExpectLayout(remote, 2, remote_offset, size, 1, local_offset,
                 "remote after write");
    ExpectLayout(local, 1, 0, 0, 1, 0, "local after write");
    FillPattern(remote.bytes().subspan(remote_offset, size), 2, remote_offset);

    // Read a different remote range into a different local one.
    const uint64_t read_local = 5 + size % 13;
    const uint64_t read_remote = 2 + size % 17;
    results =
        local_agent.Submit({MakeOp(v1::OP_TYPE_READ_INTO_LOCAL, local,
                                   read_local, size, remote, read_remote)},
                           absl::Seconds(120));
    ASSERT_TRUE(results.ok()) << results.status();
    ASSERT_TRUE((*results)[0].status.ok()) << (*results)[0].status;
    EXPECT_EQ((*results)[0].backend, "tcp");
    ExpectLayout(local, 1, read_local, size, 2, read_remote,
                 "local after read");
    ExpectLayout(remote, 2, 0, 0, 2, 0, "remote after read");
    FillPattern(local.bytes().subspan(read_local, size), 1, read_local);
  }
}

}  // namespace rdma_agent::testing
