#include "common/log_text.h"

#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

TEST(LogSafeTest, EscapesLineBreaksAndControlBytes) {
  EXPECT_EQ(LogSafe("a\nb\rc\x1b[31m"), "a\\nb\\rc\\x1b[31m");
  EXPECT_EQ(LogSafe("say \"hi\"\\"), "say \\\"hi\\\"\\\\");
  EXPECT_EQ(LogSafe(std::string("nul\0x", 5)), "nul\\x00x");
}

TEST(LogSafeTest, KeepsPlainTextAndCutsLongText) {
  EXPECT_EQ(LogSafe("kv-cache layer 3"), "kv-cache layer 3");
  EXPECT_EQ(LogSafe(std::string(10, 'a'), 4), "aaaa...");
}

}  // namespace
}  // namespace rdma_agent
