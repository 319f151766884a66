#include "daemon/state_dir.h"

#include <sys/stat.h>

#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace rdma_agent {
namespace {

using ::rdma_agent::testing::TempDir;
using ::testing::HasSubstr;
using ::testing::StartsWith;

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

std::string Read(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void Write(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

TEST(StateDirTest, IdIsCreatedOnceThenReadBack) {
  TempDir dir;
  auto created = LoadOrCreateAgentId(dir.path(), "");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_THAT(*created, StartsWith("agent-"));
  EXPECT_EQ(Read(dir.path() + "/agent-id"), *created + "\n");
  EXPECT_FALSE(Exists(dir.path() + "/agent-id.new"));
  auto again = LoadOrCreateAgentId(dir.path(), "");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *created);
}

TEST(StateDirTest, BlankIdFileIsReplaced) {
  TempDir dir;
  Write(dir.path() + "/agent-id", "  \n");
  auto id = LoadOrCreateAgentId(dir.path(), "");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_THAT(*id, StartsWith("agent-"));
}

TEST(StateDirTest, IdOfTheLegacyDirIsTakenOverOnce) {
  TempDir state, legacy;
  Write(legacy.path() + "/agent-id", " agent-legacy \n");
  auto id = LoadOrCreateAgentId(state.path(), legacy.path());
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, "agent-legacy");
  EXPECT_EQ(Read(state.path() + "/agent-id"), "agent-legacy\n");
  EXPECT_FALSE(Exists(legacy.path() + "/agent-id"));
}

TEST(StateDirTest, StateDirIdWinsOverTheLegacyOne) {
  TempDir state, legacy;
  Write(state.path() + "/agent-id", "agent-state\n");
  Write(legacy.path() + "/agent-id", "agent-legacy\n");
  auto id = LoadOrCreateAgentId(state.path(), legacy.path());
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, "agent-state");
  // Left alone: only a missing state id reads it.
  EXPECT_TRUE(Exists(legacy.path() + "/agent-id"));
}

TEST(StateDirTest, UnwritableStateDirIsAnError) {
  TempDir dir;
  Write(dir.path() + "/file", "x");
  auto id = LoadOrCreateAgentId(dir.path() + "/file", "");
  EXPECT_FALSE(id.ok());
}

TEST(StateDirTest, PrepareCreatesOneLevel) {
  TempDir dir;
  const std::string state = dir.path() + "/state";
  ASSERT_TRUE(PrepareStateDir(state).ok());
  struct stat st;
  ASSERT_EQ(::stat(state.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_TRUE(PrepareStateDir(state).ok()) << "existing is fine";
}

TEST(StateDirTest, PrepareSaysWhyADirIsUnusable) {
  TempDir dir;
  Write(dir.path() + "/file", "x");
  const absl::Status under_a_file = PrepareStateDir(dir.path() + "/file/state");
  EXPECT_EQ(under_a_file.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(under_a_file.message(), HasSubstr("cannot create"));
  EXPECT_THAT(under_a_file.message(), HasSubstr("/file/state"));
  EXPECT_THAT(under_a_file.message(), HasSubstr("Not a directory"));
}

TEST(StateDirTest, SameDirectoryComparesFilesNotSpellings) {
  TempDir dir;
  const std::string sub = dir.path() + "/sub";
  ASSERT_EQ(::mkdir(sub.c_str(), 0755), 0);
  EXPECT_TRUE(IsSameDirectory(dir.path(), dir.path() + "/"));
  EXPECT_TRUE(IsSameDirectory(dir.path(), sub + "/.."));
  EXPECT_FALSE(IsSameDirectory(dir.path(), sub));
  EXPECT_FALSE(IsSameDirectory(dir.path(), dir.path() + "/missing"));
}

}  // namespace
}  // namespace rdma_agent
