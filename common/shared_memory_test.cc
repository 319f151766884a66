#include "common/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

// A sealed memfd of `size` bytes that holds no memory (sparse).
UniqueFd SparseMemfd(uint64_t size) {
  UniqueFd fd(::memfd_create("sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd || ::ftruncate(fd.get(), static_cast<off_t>(size)) != 0 ||
      ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
    return UniqueFd();
  }
  return fd;
}

// Records, when let go, whether the fd of its memory was already closed.
class ProbeCharge : public MappingCharge {
 public:
  ProbeCharge(int fd, bool* released, bool* fd_was_closed)
      : fd_(fd), released_(released), fd_was_closed_(fd_was_closed) {}
  ~ProbeCharge() override {
    *released_ = true;
    *fd_was_closed_ = ::fcntl(fd_, F_GETFD) < 0 && errno == EBADF;
  }

 private:
  int fd_;
  bool* released_;
  bool* fd_was_closed_;
};

TEST(SharedMemoryTest, AdoptAsksAdmissionWithTheSizeBeforeMapping) {
  constexpr uint64_t kTwoTiB = uint64_t{2} << 40;
  UniqueFd fd = SparseMemfd(kTwoTiB);
  ASSERT_TRUE(fd);
  uint64_t asked = 0;
  auto memory = SharedMemory::Adopt(
      std::move(fd),
      [&](uint64_t size) -> absl::StatusOr<std::unique_ptr<MappingCharge>> {
        asked = size;
        return absl::ResourceExhaustedError("over the limit");
      });
  EXPECT_EQ(asked, kTwoTiB);
  ASSERT_FALSE(memory.ok());
  EXPECT_EQ(memory.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(memory.status().message(), "over the limit");
}

TEST(SharedMemoryTest, AllocateRefusedCreatesNothing) {
  bool asked = false;
  auto memory = SharedMemory::Allocate(
      4096, "refused",
      [&](uint64_t size) -> absl::StatusOr<std::unique_ptr<MappingCharge>> {
        asked = size == 4096;
        return absl::ResourceExhaustedError("no");
      });
  EXPECT_TRUE(asked);
  EXPECT_EQ(memory.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(SharedMemoryTest, ChargeGoesAfterUnmapAndCloseAndMovesWithTheMemory) {
  bool released = false;
  bool fd_was_closed = false;
  int fd_number = -1;
  auto memory = SharedMemory::Allocate(
      4096, "charged",
      [&](uint64_t) -> absl::StatusOr<std::unique_ptr<MappingCharge>> {
        return nullptr;  // charged below, once the fd number is known
      });
  ASSERT_TRUE(memory.ok()) << memory.status();
  fd_number = memory->fd();
  memory->HoldCharge(
      std::make_unique<ProbeCharge>(fd_number, &released, &fd_was_closed));
  {
    SharedMemory moved = std::move(*memory);
    EXPECT_FALSE(released);  // the moved-from object holds nothing
    moved.data()[0] = std::byte{1};
  }
  EXPECT_TRUE(released);
  EXPECT_TRUE(fd_was_closed);
}

TEST(SharedMemoryTest, AdoptAcceptedHoldsItsCharge) {
  UniqueFd fd = SparseMemfd(8192);
  ASSERT_TRUE(fd);
  const int fd_number = fd.get();
  bool released = false;
  bool fd_was_closed = false;
  {
    auto memory = SharedMemory::Adopt(
        std::move(fd),
        [&](uint64_t) -> absl::StatusOr<std::unique_ptr<MappingCharge>> {
          return std::make_unique<ProbeCharge>(fd_number, &released,
                                               &fd_was_closed);
        });
    ASSERT_TRUE(memory.ok()) << memory.status();
    EXPECT_EQ(memory->size(), 8192u);
    EXPECT_FALSE(released);
  }
  EXPECT_TRUE(released);
  EXPECT_TRUE(fd_was_closed);
}

}  // namespace
}  // namespace rdma_agent
