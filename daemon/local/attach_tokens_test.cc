// AttachTokens: single use, bound to the user that attached, and expired by
// its own timer (not by the next attach), giving back the parked memory's
// quota when it expires.

#include "daemon/local/attach_tokens.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <variant>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

constexpr uid_t kOwner = 1234;
constexpr uid_t kOther = 4321;

// Polls `condition` every millisecond until it holds or `timeout` passes.
template <typename Condition>
bool Eventually(Condition condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

class AttachTokensTest : public ::testing::Test {
 protected:
  // Memory of 4096 bytes charged to `owner` in both quotas, as the attach
  // server does it.
  std::string Park(AttachTokens& tokens, uid_t owner, int* fd = nullptr) {
    auto parked = pending_quota_->Reserve(owner, 1);
    EXPECT_TRUE(parked.ok());
    auto memory = SharedMemory::Allocate(
        4096, "parked",
        [&](uint64_t size) -> absl::StatusOr<std::unique_ptr<MappingCharge>> {
          auto charge = bytes_quota_->Reserve(owner, size);
          if (!charge.ok()) return charge.status();
          return MemoryCharge::Of(std::move(*charge));
        });
    EXPECT_TRUE(memory.ok()) << memory.status();
    if (fd != nullptr) *fd = memory->fd();
    return tokens.Park(std::move(*memory), owner, std::move(*parked));
  }

  std::shared_ptr<ResourceQuota> bytes_quota_ =
      ResourceQuota::Create("bytes", "b", "bt", {1 << 20, 1 << 20});
  std::shared_ptr<ResourceQuota> pending_quota_ =
      ResourceQuota::Create("parked", "p", "pt", {16, 16});
};

TEST_F(AttachTokensTest, TimerExpiresParkedMemoryWithoutAnotherCall) {
  AttachTokens tokens(absl::Milliseconds(100));
  int fd = -1;
  const std::string token = Park(tokens, kOwner, &fd);
  ASSERT_EQ(tokens.pending(), 1u);
  EXPECT_EQ(bytes_quota_->used(kOwner), 4096u);
  EXPECT_EQ(pending_quota_->used(kOwner), 1u);
  // Nothing but the clock: no Park, no Take.
  ASSERT_TRUE(
      Eventually([&] { return tokens.pending() == 0; }, absl::Seconds(10)));
  // Unmapped and closed, and the quota given back.
  EXPECT_TRUE(Eventually([&] { return bytes_quota_->used_total() == 0; },
                         absl::Seconds(1)));
  EXPECT_EQ(pending_quota_->used_total(), 0u);
  EXPECT_TRUE(::fcntl(fd, F_GETFD) < 0 && errno == EBADF);
  EXPECT_EQ(tokens.Take(token, kOwner).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(AttachTokensTest, TokensAreSingleUse) {
  AttachTokens tokens(absl::Seconds(60));
  const std::string token = Park(tokens, kOwner);
  auto taken = tokens.Take(token, kOwner);
  ASSERT_TRUE(taken.ok()) << taken.status();
  ASSERT_TRUE(std::holds_alternative<SharedMemory>(*taken));
  EXPECT_EQ(std::get<SharedMemory>(*taken).size(), 4096u);
  // Taken: no longer parked, but its bytes stay charged with the memory.
  EXPECT_EQ(pending_quota_->used(kOwner), 0u);
  EXPECT_EQ(bytes_quota_->used(kOwner), 4096u);
  EXPECT_EQ(tokens.Take(token, kOwner).status().code(),
            absl::StatusCode::kNotFound);
  { BufferMemory dropped = std::move(*taken); }
  EXPECT_EQ(bytes_quota_->used(kOwner), 0u);
}

TEST_F(AttachTokensTest, AnotherUsersTokenIsNotFoundAndStaysForItsOwner) {
  AttachTokens tokens(absl::Seconds(60));
  const std::string token = Park(tokens, kOwner);
  const absl::Status wrong_user = tokens.Take(token, kOther).status();
  EXPECT_EQ(wrong_user.code(), absl::StatusCode::kNotFound);
  // The same answer as for a token that never existed.
  EXPECT_EQ(wrong_user,
            tokens.Take("00000000000000000000000000000000", kOther).status());
  EXPECT_TRUE(tokens.Take(token, kOwner).ok());
}

TEST_F(AttachTokensTest, DestructionDropsEverythingParked) {
  {
    AttachTokens tokens(absl::Hours(1));
    Park(tokens, kOwner);
    Park(tokens, kOther);
    EXPECT_EQ(pending_quota_->used_total(), 2u);
  }
  EXPECT_EQ(pending_quota_->used_total(), 0u);
  EXPECT_EQ(bytes_quota_->used_total(), 0u);
}

TEST_F(AttachTokensTest, LaterParksDoNotDelayEarlierExpiry) {
  AttachTokens tokens(absl::Milliseconds(200));
  Park(tokens, kOwner);
  // Keep parking for a while: the first one must still go on time.
  const absl::Time first_expiry = absl::Now() + absl::Milliseconds(200);
  for (int i = 0; i < 5; ++i) {
    absl::SleepFor(absl::Milliseconds(30));
    Park(tokens, kOther);
  }
  ASSERT_TRUE(Eventually([&] { return pending_quota_->used(kOwner) == 0; },
                         absl::Seconds(10)));
  EXPECT_LT(absl::Now() - first_expiry, absl::Seconds(2));
}

}  // namespace
}  // namespace rdma_agent
