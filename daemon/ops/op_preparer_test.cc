// OpPreparer works out what ops share once per batch; these tests check that
// no per-op check is lost on the way: every op of a batch whose ops share a
// context or a local buffer is still judged on its own range, direction and
// access, and ops whose contexts differ only in their token never share one.
#include "daemon/ops/op_preparer.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/shared_memory.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

using ::absl::StatusCode;

constexpr uint64_t kEpoch = 7;
constexpr uid_t kOwner = 1000;
constexpr uid_t kOther = 1001;
constexpr uint64_t kSize = 4096;
constexpr v1::OpType kRead = v1::OP_TYPE_READ_INTO_LOCAL;
constexpr v1::OpType kWrite = v1::OP_TYPE_WRITE_FROM_LOCAL;

class OpPreparerTest : public ::testing::Test {
 protected:
  // Registers a buffer of kSize bytes owned by kOwner; returns its id.
  uint64_t Add(v1::Access access) {
    const uint64_t id = table_.NextId();
    auto memory = SharedMemory::Allocate(kSize, "op_preparer_test");
    EXPECT_TRUE(memory.ok()) << memory.status();
    table_.Add(std::make_shared<Registration>(
        id, kOwner, access, "label", "token-" + std::to_string(id),
        std::move(*memory), /*agent_allocated=*/true));
    return id;
  }

  // The context an agent would issue for buffer `id`.
  static v1::RemoteBuffer Context(uint64_t id, v1::Access access) {
    v1::RemoteBuffer remote;
    remote.set_agent_id("agent-a");
    remote.set_agent_epoch(kEpoch);
    remote.set_buffer_id(id);
    remote.set_size_bytes(kSize);
    remote.set_access(access);
    remote.set_token("token-" + std::to_string(id));
    remote.add_endpoints()->set_backend("memory");
    remote.mutable_endpoints(0)->mutable_memory();
    return remote;
  }

  static v1::Op Wire(v1::OpType type, uint64_t local_id, uint64_t local_offset,
                     uint64_t length, const std::string& context,
                     uint64_t remote_offset) {
    v1::Op op;
    op.set_type(type);
    op.set_local_buffer_id(local_id);
    op.set_local_offset(local_offset);
    op.set_length(length);
    op.set_remote_context(context);
    op.set_remote_offset(remote_offset);
    return op;
  }

  // Prepares `ops` as one batch of `caller`.
  std::vector<absl::StatusOr<Op>> PrepareAll(const std::vector<v1::Op>& ops,
                                             uid_t caller = kOwner) {
    OpPreparer preparer(&table_, caller);
    std::vector<absl::StatusOr<Op>> prepared;
    for (size_t i = 0; i < ops.size(); ++i) {
      prepared.push_back(preparer.Prepare(ops[i], i));
    }
    return prepared;
  }

  BufferTable table_{kEpoch};
};

TEST_F(OpPreparerTest, EveryOpOfASharedContextIsCheckedForItsOwnRange) {
  const uint64_t local = Add(v1::ACCESS_READ_WRITE);
  const uint64_t remote = Add(v1::ACCESS_READ_WRITE);
  const std::string ctx =
      Context(remote, v1::ACCESS_READ_WRITE).SerializeAsString();
  // Good and bad ops of one context interleaved: the bad ones come both
  // before and after the context was first parsed successfully.
  const auto prepared = PrepareAll({
      Wire(kRead, local, 0, 8, ctx, kSize),         // remote past the end
      Wire(kRead, local, 0, 8, ctx, 0),             // good
      Wire(kWrite, local, 0, 8, ctx, kSize - 7),    // remote overlaps end
      Wire(kWrite, local, kSize - 8, 8, ctx, 100),  // good
      Wire(kRead, local, kSize - 7, 8, ctx, 0),     // local overlaps end
      Wire(kRead, local, 8, ~uint64_t{0}, ctx, 0),  // overflowing length
      Wire(kRead, local, 0, 0, ctx, 0),             // zero length
      Wire(kWrite, local, 0, kSize, ctx, 0),        // good, whole buffer
  });
  ASSERT_EQ(prepared.size(), 8u);
  EXPECT_EQ(prepared[0].status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(prepared[0].status().message().find("remote"), std::string::npos);
  ASSERT_TRUE(prepared[1].ok()) << prepared[1].status();
  EXPECT_EQ(prepared[2].status().code(), StatusCode::kOutOfRange);
  ASSERT_TRUE(prepared[3].ok()) << prepared[3].status();
  EXPECT_EQ(prepared[4].status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(prepared[4].status().message().find("local"), std::string::npos);
  EXPECT_EQ(prepared[5].status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(prepared[6].status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(prepared[7].ok()) << prepared[7].status();
  // The good ones carry their own offsets, length, direction and index.
  EXPECT_EQ(prepared[3]->index, 3u);
  EXPECT_EQ(prepared[3]->type, kWrite);
  EXPECT_EQ(prepared[3]->local_offset, kSize - 8);
  EXPECT_EQ(prepared[3]->remote_offset, 100u);
  EXPECT_EQ(prepared[3]->length, 8u);
  EXPECT_EQ(prepared[7]->length, kSize);
}

TEST_F(OpPreparerTest, EveryOpOfASharedContextIsCheckedForItsDirection) {
  const uint64_t local = Add(v1::ACCESS_READ_WRITE);
  const uint64_t read_only = Add(v1::ACCESS_READ);
  const uint64_t local_write_only = Add(v1::ACCESS_WRITE);
  const std::string ctx =
      Context(read_only, v1::ACCESS_READ).SerializeAsString();
  const auto prepared = PrepareAll({
      Wire(kRead, local, 0, 8, ctx, 0),              // good
      Wire(kWrite, local, 0, 8, ctx, 0),             // remote is READ only
      Wire(kRead, local, 0, 8, ctx, 8),              // good again
      Wire(kRead, local_write_only, 0, 8, ctx, 0),   // good: writes local
      Wire(kWrite, local_write_only, 0, 8, ctx, 0),  // local not readable
  });
  ASSERT_TRUE(prepared[0].ok()) << prepared[0].status();
  EXPECT_EQ(prepared[1].status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(prepared[1].status().message().find("remote buffer"),
            std::string::npos);
  ASSERT_TRUE(prepared[2].ok()) << prepared[2].status();
  ASSERT_TRUE(prepared[3].ok()) << prepared[3].status();
  EXPECT_EQ(prepared[4].status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(prepared[4].status().message().find("local buffer"),
            std::string::npos);
}

TEST_F(OpPreparerTest, ContextsDifferingOnlyInTokenOrSizeAreNeverShared) {
  const uint64_t local = Add(v1::ACCESS_READ_WRITE);
  const uint64_t remote = Add(v1::ACCESS_READ_WRITE);
  const v1::RemoteBuffer good = Context(remote, v1::ACCESS_READ_WRITE);
  v1::RemoteBuffer forged = good;
  forged.set_token(std::string(16, 'x'));
  v1::RemoteBuffer lying_size = good;
  lying_size.set_size_bytes(2 * kSize);
  const std::string good_bytes = good.SerializeAsString();
  const auto prepared = PrepareAll({
      Wire(kRead, local, 0, 8, good_bytes, 0),
      Wire(kRead, local, 0, 8, forged.SerializeAsString(), 0),
      Wire(kRead, local, 0, 8, good_bytes, 16),
      Wire(kRead, local, 0, 8, lying_size.SerializeAsString(), kSize),
      // After the lying context was seen, the real one still has its size.
      Wire(kRead, local, 0, 8, good_bytes, kSize),
  });
  ASSERT_TRUE(prepared[0].ok() && prepared[1].ok() && prepared[2].ok() &&
              prepared[3].ok());
  // Equal bytes share one parsed context...
  EXPECT_EQ(prepared[0]->remote.get(), prepared[2]->remote.get());
  // ...and any other bytes get their own, token and all: the serving side
  // checks each op against the token its own context carries.
  EXPECT_NE(prepared[0]->remote.get(), prepared[1]->remote.get());
  EXPECT_EQ(prepared[1]->remote->token(), std::string(16, 'x'));
  EXPECT_EQ(prepared[0]->remote->token(), good.token());
  EXPECT_EQ(prepared[3]->remote->size_bytes(), 2 * kSize);
  EXPECT_EQ(prepared[4].status().code(), StatusCode::kOutOfRange);
}

TEST_F(OpPreparerTest, AMalformedContextFailsEveryOpThatCarriesIt) {
  const uint64_t local = Add(v1::ACCESS_READ_WRITE);
  const uint64_t remote = Add(v1::ACCESS_READ_WRITE);
  const std::string ctx =
      Context(remote, v1::ACCESS_READ_WRITE).SerializeAsString();
  const std::string truncated = ctx.substr(0, ctx.size() / 2);
  const auto prepared = PrepareAll({
      Wire(kRead, local, 0, 8, truncated, 0),
      Wire(kRead, local, 0, 8, ctx, 0),
      Wire(kRead, local, 0, 8, truncated, 0),
      Wire(kRead, local, 0, 8, "", 0),
      Wire(kRead, local, 0, 8, "", 0),
  });
  EXPECT_EQ(prepared[0].status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(prepared[1].ok()) << prepared[1].status();
  EXPECT_EQ(prepared[2].status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(prepared[3].status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(prepared[4].status().code(), StatusCode::kInvalidArgument);
}

TEST_F(OpPreparerTest, LocalBuffersAreTheCallersOwnForEveryOp) {
  const uint64_t local = Add(v1::ACCESS_READ_WRITE);
  const uint64_t remote = Add(v1::ACCESS_READ_WRITE);
  const std::string ctx =
      Context(remote, v1::ACCESS_READ_WRITE).SerializeAsString();
  const std::vector<v1::Op> ops = {
      Wire(kRead, local, 0, 8, ctx, 0),
      Wire(kRead, local + 100, 0, 8, ctx, 0),
      Wire(kRead, local, 8, 8, ctx, 0),
      Wire(kRead, local + 100, 0, 8, ctx, 0),
  };
  const auto mine = PrepareAll(ops, kOwner);
  ASSERT_TRUE(mine[0].ok() && mine[2].ok());
  EXPECT_EQ(mine[0]->local.get(), mine[2]->local.get());
  EXPECT_EQ(mine[1].status(),
            absl::NotFoundError(absl::StrCat("local buffer ", local + 100,
                                             " is not registered")));
  EXPECT_EQ(mine[3].status(), mine[1].status());
  // Another user sees no buffer of kOwner's, in any op.
  for (const auto& op : PrepareAll(ops, kOther)) {
    EXPECT_EQ(op.status().code(), StatusCode::kNotFound);
  }
  // Root may use anyone's.
  EXPECT_TRUE(PrepareAll(ops, /*root=*/0)[0].ok());
}

TEST_F(OpPreparerTest, TypeAndLengthAreCheckedBeforeTheContext) {
  const uint64_t local = Add(v1::ACCESS_READ_WRITE);
  const auto prepared = PrepareAll({
      Wire(v1::OP_TYPE_UNSPECIFIED, local, 0, 8, "garbage", 0),
      Wire(kRead, local, 0, 0, "garbage", 0),
      Wire(kRead, local, 0, 8, "garbage", 0),
  });
  EXPECT_NE(prepared[0].status().message().find("type"), std::string::npos);
  EXPECT_NE(prepared[1].status().message().find("length"), std::string::npos);
  EXPECT_NE(prepared[2].status().message().find("remote_context"),
            std::string::npos);
}

// A plain description is judged as the same op on the wire: the same codes
// and messages, with its remote side resolved already or named by handle.
TEST_F(OpPreparerTest, APlainOpIsCheckedAsTheSameWireOp) {
  const uint64_t local = Add(v1::ACCESS_READ_WRITE);
  const uint64_t remote_id = Add(v1::ACCESS_READ);
  const std::string context =
      Context(remote_id, v1::ACCESS_READ).SerializeAsString();
  const std::vector<v1::Op> wires = {
      Wire(kRead, local, 0, 8, context, 0),
      Wire(kWrite, local, 0, 8, context, 0),  // the remote is read-only
      Wire(kRead, local, kSize - 4, 8, context, 0),
      Wire(kRead, local, 0, 8, context, kSize),
      Wire(kRead, local + 100, 0, 8, context, 0),
      Wire(v1::OP_TYPE_UNSPECIFIED, local, 0, 8, context, 0),
      Wire(kRead, local, 0, 0, context, 0),
  };
  const auto by_wire = PrepareAll(wires);
  OpPreparer preparer(&table_, kOwner);
  auto remote = preparer.Remote(wires[0]);
  ASSERT_TRUE(remote.ok()) << remote.status();
  for (size_t i = 0; i < wires.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("op ", i));
    const absl::StatusOr<Op> op =
        preparer.Prepare(OpPreparer::SpecOf(wires[i], *remote), i);
    EXPECT_EQ(op.status(), by_wire[i].status());
    if (op.ok()) {
      EXPECT_EQ(op->index, i);
      EXPECT_EQ(op->remote.get(), remote->get());
      EXPECT_EQ(op->local->id(), local);
    }
  }
  // No remote side at all, or a handle that is not imported (no table).
  OpSpec none = OpPreparer::SpecOf(wires[0], nullptr);
  EXPECT_EQ(preparer.Prepare(none, 0).status(),
            absl::InvalidArgumentError("remote_context is empty and no "
                                       "remote_handle or remote_name is set"));
  none.remote_handle = 42;
  EXPECT_EQ(preparer.Prepare(none, 0).status(),
            absl::NotFoundError("remote handle 42 is not imported"));
}

// A reused preparer forgets what it looked up: a buffer released between
// two batches is no longer found, and nothing of it stays pinned.
TEST_F(OpPreparerTest, ClearForgetsAndUnpinsWhatWasLookedUp) {
  const uint64_t local = Add(v1::ACCESS_READ_WRITE);
  const std::string context =
      Context(Add(v1::ACCESS_READ_WRITE), v1::ACCESS_READ_WRITE)
          .SerializeAsString();
  OpPreparer preparer(&table_, kOwner);
  const v1::Op wire = Wire(kRead, local, 0, 8, context, 0);
  std::weak_ptr<Registration> registration;
  {
    auto op = preparer.Prepare(wire, 0);
    ASSERT_TRUE(op.ok()) << op.status();
    registration = op->local;
  }
  ASSERT_TRUE(table_.Remove(local, kOwner).ok());
  // Still cached (and pinned) until cleared.
  EXPECT_TRUE(preparer.Prepare(wire, 0).ok());
  EXPECT_FALSE(registration.expired());
  preparer.Clear();
  EXPECT_TRUE(registration.expired());
  EXPECT_EQ(preparer.Prepare(wire, 0).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace rdma_agent
