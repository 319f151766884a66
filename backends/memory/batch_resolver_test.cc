// BatchResolver looks each distinct context up once per batch; these tests
// check that every op is still judged on its own token, direction and range,
// and that contexts sharing a buffer id but not a token never share a
// lookup.
#include "backends/memory/batch_resolver.h"

#include <memory>
#include <string>
#include <vector>

#include "backends/buffer_table.h"
#include "common/shared_memory.h"
#include "gtest/gtest.h"

namespace rdma_agent::memory {
namespace {

using ::absl::StatusCode;

constexpr uint64_t kEpoch = 9;
constexpr uint64_t kSize = 4096;
constexpr v1::OpType kRead = v1::OP_TYPE_READ_INTO_LOCAL;
constexpr v1::OpType kWrite = v1::OP_TYPE_WRITE_FROM_LOCAL;

// A BufferTable that counts the lookups it answers.
class CountingDirectory : public BufferDirectory {
 public:
  absl::StatusOr<std::shared_ptr<Registration>> ResolveForPeer(
      const ServeRequest& request) const override {
    ++lookups;
    return table.ResolveForPeer(request);
  }
  BufferTable table{kEpoch};
  mutable int lookups = 0;
};

class BatchResolverTest : public ::testing::Test {
 protected:
  // A registration of kSize bytes with `access`, and the context naming it.
  std::shared_ptr<const v1::RemoteBuffer> Add(v1::Access access) {
    const uint64_t id = directory_.table.NextId();
    auto memory = SharedMemory::Allocate(kSize, "batch_resolver_test");
    EXPECT_TRUE(memory.ok()) << memory.status();
    auto registration = std::make_shared<Registration>(
        id, /*owner=*/1000, access, "label", "token-" + std::to_string(id),
        std::move(*memory), /*agent_allocated=*/true);
    directory_.table.Add(registration);
    auto remote = std::make_shared<v1::RemoteBuffer>();
    remote->set_agent_id("agent-a");
    remote->set_agent_epoch(kEpoch);
    remote->set_buffer_id(id);
    remote->set_size_bytes(kSize);
    // Contexts may claim more than the registration allows: the serving
    // checks go by the registration.
    remote->set_access(v1::ACCESS_READ_WRITE);
    remote->set_token(registration->token());
    return remote;
  }

  static std::shared_ptr<const v1::RemoteBuffer> Mutated(
      const std::shared_ptr<const v1::RemoteBuffer>& context,
      void (*mutate)(v1::RemoteBuffer&)) {
    auto copy = std::make_shared<v1::RemoteBuffer>(*context);
    mutate(*copy);
    return copy;
  }

  static Op MakeOp(v1::OpType type,
                   std::shared_ptr<const v1::RemoteBuffer> remote,
                   uint64_t remote_offset, uint64_t length) {
    Op op;
    op.type = type;
    op.remote = std::move(remote);
    op.remote_offset = remote_offset;
    op.length = length;
    return op;
  }

  // Resolves `ops` as one batch; the status of each.
  std::vector<absl::Status> ResolveAll(const std::vector<Op>& ops) {
    BatchResolver resolver(&directory_);
    std::vector<absl::Status> statuses;
    for (const Op& op : ops) statuses.push_back(resolver.Resolve(op).status());
    return statuses;
  }

  CountingDirectory directory_;
};

TEST_F(BatchResolverTest, LooksUpEachDistinctContextOncePerBatch) {
  auto a = Add(v1::ACCESS_READ_WRITE);
  auto b = Add(v1::ACCESS_READ_WRITE);
  std::vector<Op> ops;
  for (int i = 0; i < 1000; ++i) {
    ops.push_back(MakeOp(kWrite, i % 3 == 0 ? b : a, (i % 512) * 8, 8));
  }
  for (const absl::Status& status : ResolveAll(ops)) {
    EXPECT_TRUE(status.ok()) << status;
  }
  EXPECT_EQ(directory_.lookups, 2);
  // A new batch looks them up again (a Release between batches is seen).
  ResolveAll(ops);
  EXPECT_EQ(directory_.lookups, 4);
}

TEST_F(BatchResolverTest, AForgedTokenSharingABufferIdIsRefusedInEveryOp) {
  auto good = Add(v1::ACCESS_READ_WRITE);
  auto forged = Mutated(good, [](v1::RemoteBuffer& r) {
    r.set_token(std::string(r.token().size(), 'x'));
  });
  // Forged first and after the good one was resolved, and interleaved.
  const auto statuses = ResolveAll({
      MakeOp(kWrite, forged, 0, 8),
      MakeOp(kWrite, good, 0, 8),
      MakeOp(kWrite, forged, 0, 8),
      MakeOp(kRead, good, 8, 8),
      MakeOp(kRead, forged, 8, 8),
  });
  EXPECT_EQ(statuses[0], NotRegisteredError());
  EXPECT_TRUE(statuses[1].ok()) << statuses[1];
  EXPECT_EQ(statuses[2], NotRegisteredError());
  EXPECT_TRUE(statuses[3].ok()) << statuses[3];
  EXPECT_EQ(statuses[4], NotRegisteredError());
}

TEST_F(BatchResolverTest, EveryOpIsCheckedForItsOwnRange) {
  auto context = Add(v1::ACCESS_READ_WRITE);
  // The context claims twice the size: only the registration's counts.
  auto lying = Mutated(context, [](v1::RemoteBuffer& r) {
    r.set_size_bytes(2 * r.size_bytes());
  });
  const auto statuses = ResolveAll({
      MakeOp(kWrite, context, 0, kSize),
      MakeOp(kWrite, context, kSize, 1),
      MakeOp(kRead, context, kSize - 8, 8),
      MakeOp(kRead, context, kSize - 7, 8),
      MakeOp(kRead, context, 8, ~uint64_t{0}),
      MakeOp(kRead, context, 0, 0),
      MakeOp(kRead, lying, kSize, 8),
      MakeOp(kRead, lying, 0, 8),
  });
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_EQ(statuses[1].code(), StatusCode::kOutOfRange);
  EXPECT_TRUE(statuses[2].ok()) << statuses[2];
  EXPECT_EQ(statuses[3].code(), StatusCode::kOutOfRange);
  EXPECT_EQ(statuses[4].code(), StatusCode::kOutOfRange);
  EXPECT_EQ(statuses[5].code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(statuses[6].code(), StatusCode::kOutOfRange);
  EXPECT_TRUE(statuses[7].ok()) << statuses[7];
}

TEST_F(BatchResolverTest, EveryOpIsCheckedForItsOwnDirection) {
  auto read_only = Add(v1::ACCESS_READ);
  auto write_only = Add(v1::ACCESS_WRITE);
  const auto statuses = ResolveAll({
      MakeOp(kRead, read_only, 0, 8),   // reads it: allowed
      MakeOp(kWrite, read_only, 0, 8),  // writes into it: refused
      MakeOp(kRead, read_only, 8, 8),
      MakeOp(kWrite, write_only, 0, 8),  // writes into it: allowed
      MakeOp(kRead, write_only, 0, 8),   // reads it: refused
  });
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_EQ(statuses[1].code(), StatusCode::kPermissionDenied);
  EXPECT_TRUE(statuses[2].ok()) << statuses[2];
  EXPECT_TRUE(statuses[3].ok()) << statuses[3];
  EXPECT_EQ(statuses[4].code(), StatusCode::kPermissionDenied);
}

TEST_F(BatchResolverTest, StaleAndUnknownContextsFailEveryOpThatCarriesThem) {
  auto good = Add(v1::ACCESS_READ_WRITE);
  auto stale = Mutated(good, [](v1::RemoteBuffer& r) {
    r.set_agent_epoch(r.agent_epoch() + 1);
  });
  auto unknown = Mutated(
      good, [](v1::RemoteBuffer& r) { r.set_buffer_id(r.buffer_id() + 100); });
  const auto statuses = ResolveAll({
      MakeOp(kRead, stale, 0, 8),
      MakeOp(kRead, good, 0, 8),
      MakeOp(kRead, stale, 0, 8),
      MakeOp(kRead, unknown, 0, 8),
      MakeOp(kRead, unknown, 0, 8),
  });
  EXPECT_EQ(statuses[0], StaleContextError());
  EXPECT_TRUE(statuses[1].ok()) << statuses[1];
  EXPECT_EQ(statuses[2], StaleContextError());
  EXPECT_EQ(statuses[3], NotRegisteredError());
  EXPECT_EQ(statuses[4], NotRegisteredError());
}

// The one lookup per context must not outlive a Release: an op that begins
// after it fails NOT_FOUND as its own lookup would have, while the ops
// before it ran.
TEST_F(BatchResolverTest, OpsBeginningAfterAReleaseFailAsALookupWould) {
  auto released = Add(v1::ACCESS_READ_WRITE);
  auto kept = Add(v1::ACCESS_READ_WRITE);
  BatchResolver resolver(&directory_);
  EXPECT_TRUE(resolver.Resolve(MakeOp(kRead, released, 0, 8)).ok());
  EXPECT_TRUE(resolver.Resolve(MakeOp(kRead, kept, 0, 8)).ok());
  ASSERT_TRUE(directory_.table.Remove(released->buffer_id(), 1000).ok());
  EXPECT_EQ(resolver.Resolve(MakeOp(kRead, released, 8, 8)).status(),
            NotRegisteredError());
  EXPECT_TRUE(resolver.Resolve(MakeOp(kRead, kept, 8, 8)).ok());
  // Dropping every registration (shutdown) counts as a release too.
  directory_.table.Clear();
  EXPECT_EQ(resolver.Resolve(MakeOp(kRead, kept, 16, 8)).status(),
            NotRegisteredError());
  EXPECT_EQ(directory_.lookups, 2);
}

TEST_F(BatchResolverTest, PinsWhatItResolvedUntilDestroyed) {
  auto context = Add(v1::ACCESS_READ_WRITE);
  std::weak_ptr<Registration> watched;
  {
    BatchResolver resolver(&directory_);
    auto registration = resolver.Resolve(MakeOp(kRead, context, 0, 8));
    ASSERT_TRUE(registration.ok()) << registration.status();
    watched = directory_.table.Find(context->buffer_id(), 1000).value();
    directory_.table.Clear();
    // Released, but the batch still holds it.
    EXPECT_FALSE(watched.expired());
    EXPECT_EQ((*registration)->id(), context->buffer_id());
  }
  EXPECT_TRUE(watched.expired());
}

}  // namespace
}  // namespace rdma_agent::memory
