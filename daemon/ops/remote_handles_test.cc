// RemoteHandleTable on its own: a context is parsed and routed once, its
// handle names it to its owner only, and the table's slots and bytes are
// admitted before anything is kept and given back with the last reference.
#include "daemon/ops/remote_handles.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/memory/memory_backend.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

using ::testing::HasSubstr;

constexpr uid_t kOwner = 1000;
constexpr uid_t kOther = 1001;

class RemoteHandleTableTest : public ::testing::Test {
 protected:
  RemoteHandleTableTest() {
    BackendEnvironment env;
    env.identity = {"agent-a", 7};
    std::vector<std::unique_ptr<Backend>> backends;
    backends.push_back(std::make_unique<memory::MemoryBackend>(env));
    registry_ = std::make_unique<BackendRegistry>(std::move(backends));
  }

  static std::string Context(const std::string& agent_id = "agent-a") {
    v1::RemoteBuffer remote;
    remote.set_agent_id(agent_id);
    remote.set_agent_epoch(7);
    remote.set_buffer_id(3);
    remote.set_size_bytes(4096);
    remote.set_access(v1::ACCESS_READ_WRITE);
    remote.set_token("0123456789abcdef");
    remote.add_endpoints()->set_backend("memory");
    remote.mutable_endpoints(0)->mutable_memory();
    return remote.SerializeAsString();
  }

  std::unique_ptr<BackendRegistry> registry_;
};

TEST_F(RemoteHandleTableTest, AHandleNamesItsContextToItsOwnerOnly) {
  RemoteHandleTable table({});
  auto imported = table.Import(kOwner, Context(), 1 << 14, *registry_);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_NE(imported->handle, 0u);
  EXPECT_THAT(imported->remote->backends, ::testing::ElementsAre("memory"));
  auto found = table.Find(kOwner, imported->handle);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->get(), imported->remote->remote.get());  // parsed once
  // Another user's answer is an unknown handle's, word for word.
  auto theirs = table.Find(kOther, imported->handle);
  auto unknown = table.Find(kOwner, imported->handle + 1);
  EXPECT_EQ(theirs.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(
      theirs.status().message(),
      absl::StrCat("remote handle ", imported->handle, " is not imported"));
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table.Release(kOther, imported->handle).code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(table.ListOwnedBy(kOther).empty());
  EXPECT_EQ(table.ListOwnedBy(kOwner).size(), 1u);
  EXPECT_TRUE(table.Release(kOwner, imported->handle).ok());
  EXPECT_EQ(table.Find(kOwner, imported->handle).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(RemoteHandleTableTest, ChargesGoWithTheLastReference) {
  RemoteHandleTable table({});
  auto imported = table.Import(kOwner, Context(), 1 << 14, *registry_);
  ASSERT_TRUE(imported.ok()) << imported.status();
  const uint64_t charged = table.bytes();
  EXPECT_GE(charged, RemoteHandleLimits::kOverheadBytes);
  auto in_use = table.Find(kOwner, imported->handle);  // a batch holds it
  ASSERT_TRUE(in_use.ok());
  std::shared_ptr<const ImportedRemote> held = std::move(imported->remote);
  ASSERT_TRUE(table.Release(kOwner, imported->handle).ok());
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(table.bytes(), charged);  // still held
  held.reset();
  EXPECT_EQ(table.bytes(), 0u);
  EXPECT_EQ((*in_use)->buffer_id(), 3u);  // the parsed context lives on
}

TEST_F(RemoteHandleTableTest, BadContextsAndLimitsAreRefusedKeepingNothing) {
  RemoteHandleLimits limits;
  limits.max_per_user = 1;
  RemoteHandleTable table(limits);
  EXPECT_EQ(table.Import(kOwner, "junk", 1 << 14, *registry_).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto too_long = table.Import(kOwner, Context(), 10, *registry_);
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_long.status().message(),
              HasSubstr("--max_remote_context_bytes"));
  auto unroutable =
      table.Import(kOwner, Context("agent-b"), 1 << 14, *registry_);
  EXPECT_EQ(unroutable.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(table.bytes(), 0u);
  ASSERT_TRUE(table.Import(kOwner, Context(), 1 << 14, *registry_).ok());
  auto second = table.Import(kOwner, Context(), 1 << 14, *registry_);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(second.status().message(),
              HasSubstr("--max_remote_handles_per_user"));
  // Another user has a bound of its own.
  EXPECT_TRUE(table.Import(kOther, Context(), 1 << 14, *registry_).ok());
}

}  // namespace
}  // namespace rdma_agent
