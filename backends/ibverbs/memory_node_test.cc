// The kernel's answer to where a buffer is, on this host: placed pages
// report their node, unplaced ones their policy's node or unknown.
#include "backends/ibverbs/memory_node.h"

#include <numaif.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "backends/ibverbs/numa_topology.h"
#include "gtest/gtest.h"

namespace rdma_agent::ibverbs {
namespace {

constexpr size_t kSize = 8 << 20;

// A mapping of a memfd (as clients hand over), unmapped and closed at the
// end.
class Memfd {
 public:
  Memfd() {
    fd_ = memfd_create("memory_node_test", MFD_CLOEXEC);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(ftruncate(fd_, kSize), 0);
    void* data =
        mmap(nullptr, kSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    EXPECT_NE(data, MAP_FAILED);
    data_ = static_cast<char*>(data);
  }
  ~Memfd() {
    munmap(data_, kSize);
    close(fd_);
  }
  char* data() const { return data_; }

 private:
  int fd_ = -1;
  char* data_ = nullptr;
};

// The node this process's memory lands on: the one node of a single-node
// host (where the sysfs of this machine says so).
int OnlyNode() {
  const NumaTopology topology = NumaTopology::Load();
  return topology.nodes().size() == 1 ? topology.nodes().front() : -1;
}

TEST(MemoryNodeTest, TouchedMemfdPagesReportTheirNode) {
  const int node = OnlyNode();
  if (node < 0) GTEST_SKIP() << "not a single-node host";
  Memfd memfd;
  std::memset(memfd.data(), 0x5a, kSize);
  const auto locator = MakeKernelMemoryNodeLocator();
  EXPECT_EQ(locator->NodeOf(memfd.data(), kSize), node);
  // Any part of it, at odd offsets.
  EXPECT_EQ(locator->NodeOf(memfd.data() + 4097, 3), node);
  // Fewer samples than pages.
  EXPECT_EQ(MakeKernelMemoryNodeLocator(2)->NodeOf(memfd.data(), kSize), node);
}

TEST(MemoryNodeTest, PartlyTouchedMemfdReportsThePlacedPagesNode) {
  const int node = OnlyNode();
  if (node < 0) GTEST_SKIP() << "not a single-node host";
  Memfd memfd;
  memfd.data()[kSize - 1] = 1;  // the last page only
  EXPECT_EQ(MakeKernelMemoryNodeLocator()->NodeOf(memfd.data(), kSize), node);
}

TEST(MemoryNodeTest, UnplacedPagesWithoutAPolicyAreUnknownAndStayUnplaced) {
  Memfd memfd;
  const auto locator = MakeKernelMemoryNodeLocator();
  EXPECT_EQ(locator->NodeOf(memfd.data(), kSize), -1);
  // Asking did not fault any page in.
  void* page = memfd.data();
  int status = 0;
  ASSERT_EQ(move_pages(0, 1, &page, nullptr, &status, 0), 0);
  EXPECT_EQ(status, -ENOENT);
}

TEST(MemoryNodeTest, UnplacedPagesBoundToANodeReportThatNode) {
  const int node = OnlyNode();
  if (node < 0) GTEST_SKIP() << "not a single-node host";
  void* data = mmap(nullptr, kSize, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(data, MAP_FAILED);
  unsigned long mask = 1UL << node;
  ASSERT_EQ(mbind(data, kSize, MPOL_BIND, &mask, 8 * sizeof(mask), 0), 0)
      << std::strerror(errno);
  EXPECT_EQ(MakeKernelMemoryNodeLocator()->NodeOf(data, kSize), node);
  munmap(data, kSize);
}

TEST(MemoryNodeTest, NoMemoryIsUnknown) {
  const auto locator = MakeKernelMemoryNodeLocator();
  EXPECT_EQ(locator->NodeOf(nullptr, 4096), -1);
  int on_stack = 0;
  EXPECT_EQ(locator->NodeOf(&on_stack, 0), -1);
}

}  // namespace
}  // namespace rdma_agent::ibverbs
