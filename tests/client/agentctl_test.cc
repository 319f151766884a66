// rdma-agentctl end to end, as a user runs it: the real binary against a
// real rdma-agentd. register -> write from a file and from stdin -> read back
// -> decode -> submit both ways -> list -> release; asynchronous transfers
// (submit --async, wait, cancel, watch); then the failure paths and their
// exit codes (1 the agent refused, 2 usage, 3 local files).

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "client/rdma_agent_client.h"
#include "client/ring.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "rdma/agent/v1/remote_buffer.pb.h"
#include "tests/testing/agent_process.h"
#include "tests/testing/eventually.h"
#include "tests/testing/pattern.h"
#include "tests/testing/process.h"
#include "tests/testing/temp_dir.h"

namespace rdma_agent::testing {
namespace {

namespace v1 = ::rdma::agent::v1;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using ::testing::Not;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream data;
  data << in.rdbuf();
  return data.str();
}

void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << data;
}

// The value of "key: value" in rdma-agentctl register output.
std::string Field(const std::string& output, absl::string_view key) {
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    if (absl::ConsumePrefix(&line, absl::StrCat(key, ": "))) {
      return std::string(line);
    }
  }
  return "";
}

class AgentctlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto agent = AgentProcess::Start();
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(*agent);
    auto dir = MakeShortTempDir();
    ASSERT_TRUE(dir.ok()) << dir.status();
    files_ = *dir;
  }
  void TearDown() override {
    if (!files_.empty()) RemoveTree(files_);
  }

  // Runs rdma-agentctl against the agent with `args` and `input` on stdin.
  RunResult Ctl(std::vector<std::string> args, absl::string_view input = "") {
    std::vector<std::string> argv = {RunfilePath("client/rdma-agentctl"),
                                     "--target=" + agent_->target(),
                                     "--timeout=30s"};
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<RunResult> result =
        RunToCompletion(argv, input, absl::Seconds(60));
    if (!result.ok()) {
      ADD_FAILURE() << result.status();
      return RunResult();
    }
    return *result;
  }

  // Registers a buffer; returns its id and base64 context.
  std::pair<std::string, std::string> Register(
      uint64_t size, std::vector<std::string> more = {}) {
    std::vector<std::string> args = {"register", absl::StrCat("--size=", size)};
    args.insert(args.end(), more.begin(), more.end());
    const RunResult r = Ctl(args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return {Field(r.out, "buffer_id"), Field(r.out, "context")};
  }

  std::string File(absl::string_view name) {
    return absl::StrCat(files_, "/", name);
  }

  std::unique_ptr<AgentProcess> agent_;
  std::string files_;
};

TEST_F(AgentctlTest, RegisterWriteReadDecodeSubmitRelease) {
  // register: id, size, backends and the context, also written raw to a file.
  const std::string context_file = File("src.ctx");
  RunResult r = Ctl({"register", "--size=4099", "--access=read_write",
                     "--label=source", "--context_out=" + context_file});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string src = Field(r.out, "buffer_id");
  const std::string context = Field(r.out, "context");
  ASSERT_FALSE(src.empty()) << r.out;
  EXPECT_EQ(Field(r.out, "size_bytes"), "4099");
  EXPECT_EQ(Field(r.out, "backends"), "memory");
  std::string raw_context;
  ASSERT_TRUE(absl::Base64Unescape(context, &raw_context)) << context;
  EXPECT_EQ(ReadFile(context_file), raw_context);

  // write from a file at an odd offset, then from stdin.
  const std::string payload = PatternString(7, 0, 1000);
  WriteFile(File("payload"), payload);
  r = Ctl({"write", src, "--offset=3", "--in=" + File("payload")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = Ctl({"write", src, "--offset=4096", "--in=-"}, "xyz");
  ASSERT_EQ(r.exit_code, 0) << r.err;

  // read it all back, to a file and to stdout: every byte, zeros around.
  std::string expected(4099, '\0');
  expected.replace(3, payload.size(), payload);
  expected.replace(4096, 3, "xyz");
  r = Ctl({"read", src, "--length=4099", "--out=" + File("back")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(ReadFile(File("back")) == expected);
  r = Ctl({"read", src, "--offset=2", "--length=1002"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.out == expected.substr(2, 1002));

  // decode, from base64 and from the raw file: the same text.
  r = Ctl({"decode", context});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr(absl::StrCat("buffer_id: ", src, "\n")));
  EXPECT_THAT(r.out, HasSubstr("size_bytes: 4099\n"));
  EXPECT_THAT(r.out, HasSubstr("access: ACCESS_READ_WRITE\n"));
  EXPECT_THAT(r.out, HasSubstr("backend: \"memory\""));
  EXPECT_THAT(r.out, MatchesRegex("(.|\n)*token: \"[0-9a-f]{32,}\"\n(.|\n)*"));
  const RunResult from_file = Ctl({"decode", "--context_file=" + context_file});
  ASSERT_EQ(from_file.exit_code, 0) << from_file.err;
  EXPECT_EQ(from_file.out, r.out);

  // submit read: a second buffer pulls bytes of the first through its
  // context (base64).
  auto [dst, dst_context] = Register(2048);
  ASSERT_FALSE(dst.empty());
  r = Ctl({"submit", "--op=read", "--local=" + dst, "--local_offset=1",
           "--length=1000", "--remote_offset=3", "--context=" + context});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "op 0: OK backend=memory\n");
  r = Ctl({"read", dst, "--length=2048"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::string dst_expected(2048, '\0');
  dst_expected.replace(1, payload.size(), payload);
  EXPECT_TRUE(r.out == dst_expected);

  // submit write through the context file: one byte too far fails with
  // OUT_OF_RANGE and exit 1, and writes nothing; in range it lands.
  r = Ctl({"submit", "--op=write", "--local=" + dst, "--local_offset=1",
           "--length=11", "--remote_offset=4089",
           "--context_file=" + context_file});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("op 0: OUT_OF_RANGE backend="));
  EXPECT_THAT(r.err, HasSubstr("an op failed"));
  r = Ctl({"read", src, "--length=4099"});
  EXPECT_TRUE(r.out == expected);
  r = Ctl({"submit", "--op=write", "--local=" + dst, "--local_offset=1",
           "--length=10", "--remote_offset=4089",
           "--context_file=" + context_file});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  expected.replace(4089, 10, payload.substr(0, 10));
  r = Ctl({"read", src, "--length=4099"});
  EXPECT_TRUE(r.out == expected);

  // list shows both, with owner, lifetime, times and the label. Agent
  // lifetime: register's process exited long ago.
  r = Ctl({"list"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("UID        PID LIFETIME   CREATED"));
  EXPECT_THAT(r.out, HasSubstr("ALLOCATED MEMORY    BACKENDS"));
  const std::string time =
      "[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z";
  EXPECT_THAT(
      r.out, MatchesRegex(absl::StrCat("(.|\n)*\n", src,
                                       " +4099 +ACCESS_READ_WRITE +agent "
                                       "+host +memory +[0-9]+ +[0-9]+ +",
                                       ::geteuid(), " +[1-9][0-9]* +agent +",
                                       time, " +", time, " +source\n(.|\n)*")));
  EXPECT_THAT(r.out,
              MatchesRegex(absl::StrCat("(.|\n)*\n", dst, " +2048 (.|\n)*")));

  // release; a second release and a read of the released id are NOT_FOUND.
  r = Ctl({"release", src});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  r = Ctl({"release", src});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("release ", src, ": NOT_FOUND")));
  r = Ctl({"read", src, "--length=1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("NOT_FOUND"));
  r = Ctl({"list"});
  EXPECT_THAT(
      r.out,
      ::testing::Not(MatchesRegex(absl::StrCat("(.|\n)*\n", src, " (.|\n)*"))));
}

// The id in "transfer_id: ID" (submit --async).
std::string TransferId(const RunResult& r) {
  return Field(r.out, "transfer_id");
}

TEST_F(AgentctlTest, SubmitAsyncThenWaitPrintsTheEnd) {
  auto [src, src_context] = Register(4096);
  auto [dst, dst_context] = Register(4096);
  const std::string payload = PatternString(9, 0, 1000);
  RunResult r = Ctl({"write", src, "--in=-"}, payload);
  ASSERT_EQ(r.exit_code, 0) << r.err;

  r = Ctl({"submit", "--async", "--op=read", "--local=" + dst,
           "--local_offset=7", "--length=1000", "--context=" + src_context});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string id = TransferId(r);
  ASSERT_THAT(id, MatchesRegex("[1-9][0-9]*")) << r.out;
  r = Ctl({"wait", id});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out,
            absl::StrCat("transfer ", id, ": DONE\nop 0: OK backend=memory\n"));
  r = Ctl({"read", dst, "--offset=7", "--length=1000"});
  EXPECT_TRUE(r.out == payload);
  // Reported: the agent has forgotten it.
  r = Ctl({"wait", id});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("wait ", id, ": NOT_FOUND")));

  // A failing op: accepted, then FAILED, exit 1.
  r = Ctl({"submit", "--async", "--op=read", "--local=" + dst, "--length=10",
           "--remote_offset=4090", "--context=" + src_context});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string failing = TransferId(r);
  r = Ctl({"wait", failing});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr(absl::StrCat("transfer ", failing,
                                            ": FAILED\nop 0: OUT_OF_RANGE")));
  EXPECT_THAT(r.err,
              HasSubstr(absl::StrCat("transfer ", failing, " is FAILED")));

  // JSON: SubmitAsyncResponse, then the Transfer.
  r = Ctl({"-o", "json", "submit", "--async", "--op=read", "--local=" + dst,
           "--length=8", "--context=" + src_context});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  v1::SubmitAsyncResponse submitted;
  ASSERT_TRUE(
      google::protobuf::util::JsonStringToMessage(r.out, &submitted).ok())
      << r.out;
  EXPECT_GT(submitted.transfer_id(), 0u);
  r = Ctl({"wait", absl::StrCat(submitted.transfer_id()), "--output=json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  v1::Transfer transfer;
  ASSERT_TRUE(
      google::protobuf::util::JsonStringToMessage(r.out, &transfer).ok())
      << r.out;
  EXPECT_EQ(transfer.transfer_id(), submitted.transfer_id());
  EXPECT_EQ(transfer.state(), v1::TRANSFER_STATE_DONE);
  ASSERT_EQ(transfer.results_size(), 1);
  EXPECT_EQ(transfer.results(0).backend(), "memory");
  EXPECT_GT(transfer.create_time().seconds(), 0);
  EXPECT_GE(transfer.end_time().seconds(), transfer.start_time().seconds());
  EXPECT_THAT(r.out, HasSubstr("\"state\": \"TRANSFER_STATE_DONE\""));
}

TEST_F(AgentctlTest, WaitGivesUpOnAPendingTransferAndCancelStopsIt) {
  // 64 GiB of copying on the agent's memory backend (many seconds; cancel
  // stops it at once), through the library.
  constexpr uint64_t kSize = 64 << 20;
  auto from = agent_->client().Allocate(kSize, v1::ACCESS_READ_WRITE);
  auto to = agent_->client().Allocate(kSize, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(from.ok() && to.ok());
  client::OpSpec op;
  op.type = v1::OP_TYPE_READ_INTO_LOCAL;
  op.local_buffer_id = to->id();
  op.length = kSize;
  op.remote_context = from->remote_context();
  auto transfer = agent_->client().SubmitAsync(
      std::vector<client::OpSpec>(1024, op), absl::Minutes(5));
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  const std::string id = absl::StrCat(transfer->id());

  const absl::Time start = absl::Now();
  RunResult r = Ctl({"wait", id, "--timeout=300ms"});
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out, absl::StrCat("transfer ", id, ": PENDING\n"));
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("transfer ", id, " is PENDING")));

  r = Ctl({"-o", "json", "cancel", id});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  v1::Transfer cancelled;
  ASSERT_TRUE(
      google::protobuf::util::JsonStringToMessage(r.out, &cancelled).ok())
      << r.out;
  EXPECT_EQ(cancelled.state(), v1::TRANSFER_STATE_CANCELLED);
  ASSERT_EQ(cancelled.results_size(), 1024);
  EXPECT_EQ(cancelled.results(1023).code(), 1);  // CANCELLED: never started
  // Cancel does not report it: a second cancel and a wait still see it.
  r = Ctl({"cancel", id});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr(absl::StrCat("transfer ", id, ": CANCELLED\n")));
  r = Ctl({"wait", id});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr(absl::StrCat("transfer ", id, ": CANCELLED\n")));
  EXPECT_THAT(r.out, HasSubstr(" CANCELLED backend="));
  EXPECT_THAT(r.err, HasSubstr("is CANCELLED"));

  r = Ctl({"cancel", "999999"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("cancel 999999: NOT_FOUND"));
}

TEST_F(AgentctlTest, WatchPrintsEndsUntilCountOrInterrupted) {
  auto buffer = agent_->client().Allocate(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  client::OpSpec op;
  op.type = v1::OP_TYPE_READ_INTO_LOCAL;
  op.local_buffer_id = buffer->id();
  op.length = 100;
  op.remote_context = buffer->remote_context();
  op.remote_offset = 1000;
  auto submit = [&]() -> std::string {
    auto transfer = agent_->client().SubmitAsync({op}, absl::Seconds(30));
    EXPECT_TRUE(transfer.ok()) << transfer.status();
    return transfer.ok() ? absl::StrCat(transfer->id()) : "";
  };
  // Ended, most likely, before the watch opens: --backlog starts with those.
  const std::set<std::string> ids = {submit(), submit(), submit()};
  RunResult r = Ctl({"watch", "--backlog", "--count=3"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::set<std::string> printed;
  for (absl::string_view line :
       absl::StrSplit(r.out, '\n', absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&line, "transfer ")) {
      EXPECT_TRUE(absl::ConsumeSuffix(&line, ": DONE")) << line;
      printed.insert(std::string(line));
    } else {
      EXPECT_EQ(line, "op 0: OK backend=memory");
    }
  }
  EXPECT_EQ(printed, ids) << r.out;
  // Watching read nothing: each end is still there for wait, which reads
  // it (so the next watch does not start with it).
  for (const std::string& id : ids) {
    r = Ctl({"wait", id});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat("transfer ", id, ": DONE")));
  }

  // JSON: one TransferEvent per line.
  const std::set<std::string> more = {submit(), submit()};
  r = Ctl({"-o", "json", "watch", "--backlog", "--count", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::set<std::string> seen;
  for (absl::string_view line :
       absl::StrSplit(r.out, '\n', absl::SkipEmpty())) {
    v1::TransferEvent event;
    ASSERT_TRUE(
        google::protobuf::util::JsonStringToMessage(std::string(line), &event)
            .ok())
        << line;
    EXPECT_EQ(event.transfer().state(), v1::TRANSFER_STATE_DONE);
    seen.insert(absl::StrCat(event.transfer().transfer_id()));
  }
  EXPECT_EQ(seen, more) << r.out;
  for (const std::string& id : more) EXPECT_EQ(Ctl({"wait", id}).exit_code, 0);

  // Until interrupted: an end that comes while it runs (or just before:
  // --backlog, which is empty now that wait read the others), then SIGINT.
  Subprocess::Options options;
  options.argv = {RunfilePath("client/rdma-agentctl"),
                  "--target=" + agent_->target(), "watch", "--backlog"};
  options.pipe_stdio = true;
  auto watch = Subprocess::Spawn(options);
  ASSERT_TRUE(watch.ok()) << watch.status();
  const std::string later = submit();
  auto line = watch->ReadLine(absl::Seconds(30));
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_EQ(*line, absl::StrCat("transfer ", later, ": DONE"));
  watch->Signal(SIGINT);
  auto code = watch->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

TEST_F(AgentctlTest, WatchCountShowsOnlyEndsAfterItStartsUnlessBacklog) {
  auto buffer = agent_->client().Allocate(4096, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  client::OpSpec op;
  op.type = v1::OP_TYPE_READ_INTO_LOCAL;
  op.local_buffer_id = buffer->id();
  op.length = 100;
  op.remote_context = buffer->remote_context();
  op.remote_offset = 1000;
  // An end nobody has read yet, seen through a watch of this test's own
  // (watching reads nothing).
  absl::Mutex mu;
  std::set<uint64_t> ended;
  auto seen =
      agent_->client().WatchTransfers([&](const client::TransferResult& end) {
        absl::MutexLock lock(&mu);
        ended.insert(end.id);
      });
  ASSERT_TRUE(seen.ok()) << seen.status();
  auto old = agent_->client().SubmitAsync({op}, absl::Seconds(30));
  ASSERT_TRUE(old.ok()) << old.status();
  const uint64_t old_id = old->id();
  ASSERT_TRUE(Eventually([&] {
    absl::MutexLock lock(&mu);
    return ended.count(old_id) > 0;
  }));

  // watch --count=1 waits for an end after it started: submit until it
  // prints one.
  Subprocess::Options options;
  options.argv = {RunfilePath("client/rdma-agentctl"),
                  "--target=" + agent_->target(), "watch", "--count=1"};
  options.pipe_stdio = true;
  auto watch = Subprocess::Spawn(options);
  ASSERT_TRUE(watch.ok()) << watch.status();
  std::set<std::string> later;
  absl::StatusOr<std::string> line;
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  do {
    auto transfer = agent_->client().SubmitAsync({op}, absl::Seconds(30));
    ASSERT_TRUE(transfer.ok()) << transfer.status();
    later.insert(absl::StrCat(transfer->id()));
    line = watch->ReadLine(absl::Milliseconds(200));
  } while (!line.ok() && absl::Now() < give_up);
  ASSERT_TRUE(line.ok()) << line.status();
  absl::string_view printed = *line;
  ASSERT_TRUE(absl::ConsumePrefix(&printed, "transfer ")) << *line;
  ASSERT_TRUE(absl::ConsumeSuffix(&printed, ": DONE")) << *line;
  EXPECT_NE(printed, absl::StrCat(old_id));
  EXPECT_TRUE(later.count(std::string(printed)) > 0) << *line;
  auto code = watch->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);

  // --backlog starts with the ends the agent still keeps, oldest first.
  const RunResult r = Ctl({"watch", "--backlog", "--count=1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, absl::StrCat("transfer ", old_id,
                                ": DONE\nop 0: OK backend=memory\n"));
}

TEST_F(AgentctlTest, InfoDescribesTheAgentForPeople) {
  RunResult r = Ctl({"-o", "json", "info"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  v1::AgentInfo info;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(r.out, &info).ok())
      << r.out;
  r = Ctl({"info"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // One "key: value" line each, no protobuf quoting, and a backend table.
  EXPECT_EQ(Field(r.out, "agent_id"), info.agent_id()) << r.out;
  EXPECT_EQ(Field(r.out, "hostname"), info.hostname()) << r.out;
  EXPECT_EQ(Field(r.out, "version"), info.version()) << r.out;
  EXPECT_EQ(Field(r.out, "epoch"), absl::StrCat(info.epoch())) << r.out;
  EXPECT_EQ(Field(r.out, "metrics"), "none") << r.out;
  EXPECT_THAT(r.out,
              MatchesRegex("(.|\n)*\nBACKEND +LEVEL +AVAILABLE +"
                           "DETAILS\nmemory +MEMORY +yes( [^\n]*)?\n(.|\n)*"));
  EXPECT_THAT(r.out, Not(HasSubstr("\"")));
  EXPECT_THAT(r.out, Not(HasSubstr("transport_level")));
}

TEST_F(AgentctlTest, VersionPrintsTheToolsVersionWithoutAnAgent) {
  auto info = agent_->client().GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  const absl::StatusOr<RunResult> r = RunToCompletion(
      {RunfilePath("client/rdma-agentctl"),
       "--target=unix://" + File("nobody-listens.sock"), "--version"},
      "", absl::Seconds(30));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->err;
  EXPECT_EQ(r->out, absl::StrCat("rdma-agentctl ", info->version(), "\n"));
}

TEST_F(AgentctlTest, SizesTakeSuffixesAndRefuseNegativeOrOverflowingValues) {
  RunResult r = Ctl({"register", "--size=4k"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(Field(r.out, "size_bytes"), "4096");
  const std::string id = Field(r.out, "buffer_id");
  r = Ctl({"register", "--size", "1MiB"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(Field(r.out, "size_bytes"), "1048576");
  // Offsets and lengths take them too.
  r = Ctl({"write", id, "--offset=3k", "--in=-"}, "abc");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = Ctl({"read", id, "--offset=3KiB", "--length=3"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "abc");

  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"register", "--size=-5"}, "--size: -5 is negative"},
      {{"register", "--size=18446744073709551616"},
       "--size: 18446744073709551616 is more than 2^64-1 bytes"},
      {{"register", "--size=16777216T"},
       "--size: 16777216T is more than 2^64-1 bytes"},
      {{"register", "--size=4kb"}, "--size: 4kb is not a size"},
      {{"register", "--size=1.5G"}, "--size: 1.5G is not a size"},
      {{"read", id, "--length=-1"}, "--length: -1 is negative"},
      {{"read", id, "--length=1", "--offset=-1"}, "--offset: -1 is negative"},
      {{"write", id, "--offset=-4096"}, "--offset: -4096 is negative"},
      {{"submit", "--op=read", "--local=" + id, "--length=-8", "--context=x"},
       "--length: -8 is negative"},
      {{"submit", "--op=read", "--local=" + id, "--length=8",
        "--remote_offset=-1", "--context=x"},
       "--remote_offset: -1 is negative"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrJoin(c.args, " "));
    r = Ctl(c.args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message));
  }
  // Nothing was registered by the refused commands.
  auto buffers = agent_->client().ListBuffers();
  ASSERT_TRUE(buffers.ok()) << buffers.status();
  EXPECT_EQ(buffers->size(), 2u);
}

TEST_F(AgentctlTest, DurationsTakeUnitsOrBareSeconds) {
  for (const char* timeout : {"--timeout=5", "--timeout=2.5", "--timeout=5s",
                              "--timeout=1500ms", "--timeout=1m"}) {
    const RunResult r = Ctl({timeout, "health"});
    EXPECT_EQ(r.exit_code, 0) << timeout << ": " << r.err;
  }
  for (const char* timeout :
       {"--timeout=0", "--timeout=-1", "--timeout=soon", "--timeout=inf"}) {
    const RunResult r = Ctl({timeout, "health"});
    EXPECT_EQ(r.exit_code, 2) << timeout;
    EXPECT_THAT(r.err, HasSubstr("--timeout")) << timeout;
  }
  const absl::Time start = absl::Now();
  RunResult r = Ctl({"notifications", "--wait=1"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_GE(absl::Now() - start, absl::Seconds(1));
  r = Ctl({"notifications", "--wait=-1"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--wait"));
}

TEST_F(AgentctlTest, ReleaseTakesSeveralIds) {
  auto [a, a_context] = Register(64);
  auto [b, b_context] = Register(64);
  auto [c, c_context] = Register(64);
  auto [d, d_context] = Register(64);
  RunResult r = Ctl({"release", a, b, c});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  auto buffers = agent_->client().ListBuffers();
  ASSERT_TRUE(buffers.ok()) << buffers.status();
  ASSERT_EQ(buffers->size(), 1u);
  EXPECT_EQ(absl::StrCat((*buffers)[0].buffer_id()), d);
  // One unknown id: the others are still released, the unknown one named,
  // exit 1.
  r = Ctl({"release", a, d});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("release ", a, ": NOT_FOUND")));
  buffers = agent_->client().ListBuffers();
  ASSERT_TRUE(buffers.ok()) << buffers.status();
  EXPECT_TRUE(buffers->empty());
  // A malformed id releases nothing.
  auto [e, e_context] = Register(64);
  r = Ctl({"release", e, "twelve"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("release: 'twelve' is not a buffer ID"));
  buffers = agent_->client().ListBuffers();
  ASSERT_TRUE(buffers.ok()) << buffers.status();
  EXPECT_EQ(buffers->size(), 1u);
}

TEST_F(AgentctlTest, SubmitTakesSeveralOpsFromFlagsOrAFile) {
  auto [src, src_context] = Register(4096);
  auto [dst, dst_context] = Register(4096);
  const std::string payload = PatternString(5, 0, 4096);
  RunResult r = Ctl({"write", src, "--in=-"}, payload);
  ASSERT_EQ(r.exit_code, 0) << r.err;

  // Flags give what every op shares; each --op says its own.
  r = Ctl({"submit", "--local=" + dst, "--context=" + src_context,
           "--op=read,length=100", "--op",
           "read,local_offset=1k,remote_offset=2k,length=50"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "op 0: OK backend=memory\nop 1: OK backend=memory\n");
  r = Ctl({"read", dst, "--length=4096"});
  std::string expected(4096, '\0');
  expected.replace(0, 100, payload.substr(0, 100));
  expected.replace(1024, 50, payload.substr(2048, 50));
  EXPECT_TRUE(r.out == expected);

  // A file of ops, one a line, with its own contexts; one op fails.
  const std::string src_file = File("src.ctx");
  std::string raw;
  ASSERT_TRUE(absl::Base64Unescape(src_context, &raw));
  WriteFile(src_file, raw);
  WriteFile(File("ops"),
            absl::StrCat("# from the source\n", "read,local=", dst,
                         ",local_offset=3000,length=10,",
                         "remote_offset=10,context_file=", src_file, "\n\n",
                         "write,local=", src, ",length=4,remote_offset=4093,",
                         "context=", dst_context, "\n"));
  r = Ctl({"submit", "--ops_file=" + File("ops")});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("op 0: OK backend=memory\n"));
  EXPECT_THAT(r.out, HasSubstr("op 1: OUT_OF_RANGE"));
  r = Ctl({"read", dst, "--offset=3000", "--length=10"});
  EXPECT_TRUE(r.out == payload.substr(10, 10));

  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"submit", "--context=" + src_context, "--local=" + dst,
        "--op=read,lenght=5"},
       "--op read,lenght=5: unknown key 'lenght'"},
      {{"submit", "--context=" + src_context, "--local=" + dst,
        "--op=copy,length=5"},
       "--op copy,length=5: the op is read or write"},
      {{"submit", "--context=" + src_context, "--local=" + dst,
        "--op=read,length=-5"},
       "--op read,length=-5: length: -5 is negative"},
      {{"submit", "--context=" + src_context, "--op=read,length=5"},
       "--op read,length=5: no local buffer"},
      {{"submit", "--context=" + src_context, "--local=" + dst, "--op=read"},
       "--op read: no length"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrJoin(c.args, " "));
    r = Ctl(c.args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message));
  }
  WriteFile(File("bad-ops"),
            absl::StrCat("read,local=", dst, ",length=1,context=", src_context,
                         "\nread,local=1,length\n"));
  r = Ctl({"submit", "--ops_file=" + File("bad-ops")});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat(File("bad-ops"),
                                            ":2: read,local=1,length: "
                                            "'length' has no value")));
}

TEST_F(AgentctlTest, UnreadableLocalFilesExitThreeInEveryCommand) {
  auto [id, context] = Register(64);
  const std::string missing = File("no-such-file");
  const std::vector<std::vector<std::string>> commands = {
      {"write", id, "--in=" + missing},
      {"submit", "--op=read", "--local=" + id, "--length=1",
       "--context_file=" + missing},
      {"submit", "--ops_file=" + missing},
      {"decode", "--context_file=" + missing},
  };
  for (const std::vector<std::string>& args : commands) {
    SCOPED_TRACE(absl::StrJoin(args, " "));
    const RunResult r = Ctl(args);
    EXPECT_EQ(r.exit_code, 3) << r.err;
    EXPECT_THAT(r.err, HasSubstr("cannot open " + missing));
  }
  // The help says so.
  EXPECT_THAT(Ctl({"--help"}).out,
              HasSubstr("3 a local file could not be read or written"));
}

TEST_F(AgentctlTest, BadUsageExitsTwoWithAMessage) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  auto [id, context] = Register(64);
  std::string raw;
  ASSERT_TRUE(absl::Base64Unescape(context, &raw));
  // Cut inside the last (length-delimited) field: no longer a RemoteBuffer.
  const std::string truncated =
      absl::Base64Escape(raw.substr(0, raw.size() - 3));
  const std::vector<Case> cases = {
      {{}, "no command given"},
      {{"frobnicate"}, "unknown command 'frobnicate'"},
      {{"register"}, "register needs --size N"},
      {{"register", "--size=8", "--access=everything"},
       "--access must be read, write or read_write"},
      {{"release"}, "release: expected one or more buffer IDs"},
      {{"release", "twelve"}, "release: 'twelve' is not a buffer ID"},
      {{"read", id}, "read needs --length L"},
      {{"submit", "--local=" + id, "--length=1", "--context=" + context},
       "submit: needs --op read or --op write"},
      {{"submit", "--op=read", "--length=1", "--context=" + context},
       "submit: --op read: no local buffer"},
      {{"submit", "--op=read", "--local=" + id, "--context=" + context},
       "submit: --op read: no length"},
      {{"submit", "--op=read", "--local=" + id, "--length=1"},
       "give the remote context exactly once"},
      {{"decode"}, "give the remote context exactly once"},
      {{"decode", "not base64 at all!"}, "not base64"},
      {{"decode", truncated}, "not a serialized RemoteBuffer"},
      {{"submit", "--async", "--op=read", "--length=1", "--context=" + context},
       "submit: --op read: no local buffer"},
      {{"wait"}, "wait: expected exactly one transfer ID"},
      {{"wait", "soon"}, "wait: expected exactly one transfer ID"},
      {{"cancel"}, "cancel: expected exactly one transfer ID"},
      {{"cancel", "1", "2"}, "cancel: expected exactly one transfer ID"},
      {{"watch", "--count=0"}, "--count must be at least 1"},
      {{"watch", "--count=lots"}, "--count"},
      {{"watch", "extra"}, "extra"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrJoin(c.args, " "));
    const RunResult r = Ctl(c.args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message));
  }
}

TEST_F(AgentctlTest, AgentRefusalsExitOneWithTheStatusCode) {
  auto [id, context] = Register(64, {"--access=read"});
  // Offset past the end: OUT_OF_RANGE from the agent.
  RunResult r = Ctl({"write", id, "--offset=64", "--in=-"}, "x");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("write ", id, ": OUT_OF_RANGE")));
  // offset + length overflows uint64.
  r = Ctl({"read", id, "--offset=18446744073709551615", "--length=2"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("OUT_OF_RANGE"));
  // A READ-only remote buffer refuses a write into it.
  auto [dst, dst_context] = Register(64);
  r = Ctl({"submit", "--op=write", "--local=" + dst, "--length=8",
           "--context=" + context});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("op 0: PERMISSION_DENIED"));
  // Unknown local buffer.
  r = Ctl({"submit", "--op=read", "--local=999999", "--length=8",
           "--context=" + context});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("op 0: NOT_FOUND"));
}

TEST_F(AgentctlTest, UnreachableAgentExitsOneWithUnavailable) {
  const absl::StatusOr<RunResult> r =
      RunToCompletion({RunfilePath("client/rdma-agentctl"),
                       "--target=unix://" + File("nobody-listens.sock"),
                       "--timeout=2s", "info"},
                      "", absl::Seconds(30));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 1);
  EXPECT_THAT(r->err, HasSubstr("UNAVAILABLE"));
  EXPECT_THAT(r->err, HasSubstr("cannot reach rdma-agentd"));

  // Usage is judged before connecting: exit 2 at once, agent or not.
  const absl::StatusOr<RunResult> usage = RunToCompletion(
      {RunfilePath("client/rdma-agentctl"),
       "--target=unix://" + File("nobody-listens.sock"), "register"},
      "", absl::Seconds(30));
  ASSERT_TRUE(usage.ok()) << usage.status();
  EXPECT_EQ(usage->exit_code, 2);
  EXPECT_THAT(usage->err, HasSubstr("register needs --size N"));
}

TEST_F(AgentctlTest, HelpListsCommandsAndEachCommandHasItsOwn) {
  RunResult r = Ctl({"--help"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (const char* command :
       {"info", "health", "register", "list", "sessions", "release", "write",
        "read", "submit", "wait", "cancel", "watch", "decode"}) {
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat("  ", command, " "))) << command;
  }
  EXPECT_THAT(r.out, HasSubstr("rdma-agentctl help COMMAND"));
  EXPECT_EQ(Ctl({"help"}).out, r.out);
  r = Ctl({"submit", "--help"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("--remote_offset"));
  EXPECT_THAT(r.out, Not(HasSubstr("--context_out")));  // register's
  const RunResult topic = Ctl({"help", "submit"});
  EXPECT_EQ(topic.exit_code, 0) << topic.err;
  EXPECT_EQ(topic.out, r.out);
  EXPECT_EQ(Ctl({"help", "nonsense"}).exit_code, 2);
  r = Ctl({"submit", "--help"});
  EXPECT_THAT(r.out, HasSubstr("--async"));
  for (const char* command : {"wait", "cancel", "watch"}) {
    r = Ctl({"help", command});
    EXPECT_EQ(r.exit_code, 0) << command << ": " << r.err;
    EXPECT_THAT(r.out, HasSubstr("Usage: rdma-agentctl ")) << command;
  }
  EXPECT_THAT(Ctl({"help", "wait"}).out, HasSubstr("--timeout"));
  EXPECT_THAT(Ctl({"help", "watch"}).out, HasSubstr("--count"));
  // A malformed option value is bad usage too.
  r = Ctl({"register", "--size=lots"});
  EXPECT_EQ(r.exit_code, 2);
  r = Ctl({"-o", "yaml", "info"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("yaml"));
}

TEST_F(AgentctlTest, JsonOutputIsProtobufJson) {
  RunResult r = Ctl({"-o", "json", "info"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  v1::AgentInfo info;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(r.out, &info).ok())
      << r.out;
  EXPECT_FALSE(info.agent_id().empty());
  EXPECT_NE(info.epoch(), 0u);

  r = Ctl({"register", "--size=100", "--label=json", "-o", "json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  v1::RegisterResponse registered;
  ASSERT_TRUE(
      google::protobuf::util::JsonStringToMessage(r.out, &registered).ok())
      << r.out;
  EXPECT_EQ(registered.size_bytes(), 100u);
  v1::RemoteBuffer remote;
  EXPECT_TRUE(remote.ParseFromString(registered.remote_context()));
  EXPECT_EQ(remote.buffer_id(), registered.buffer_id());

  r = Ctl({"list", "--output=json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  v1::ListBuffersResponse list;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(r.out, &list).ok())
      << r.out;
  ASSERT_EQ(list.buffers_size(), 1);
  EXPECT_EQ(list.buffers(0).label(), "json");
  EXPECT_EQ(list.buffers(0).owner_uid(), ::geteuid());
  EXPECT_GT(list.buffers(0).owner_pid(), 0u);
  EXPECT_EQ(list.buffers(0).lifetime(), v1::LIFETIME_AGENT);
  EXPECT_GT(list.buffers(0).create_time().seconds(), 0);
  EXPECT_GE(list.buffers(0).last_use_time().seconds(),
            list.buffers(0).create_time().seconds());
  EXPECT_THAT(r.out, HasSubstr("\"lifetime\": \"LIFETIME_AGENT\""));
  EXPECT_THAT(
      r.out,
      MatchesRegex("(.|\n)*\"create_time\": \"[0-9-]+T[0-9:.]+Z\"(.|\n)*"));
}

TEST_F(AgentctlTest, ListAllUsersIsForRoot) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a second user";
  // The runtime dir is 0700; the other user must reach the sockets.
  ASSERT_EQ(::chmod(agent_->runtime_dir().c_str(), 0755), 0);
  auto as_nobody = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = {"setpriv",
                                     "--reuid=65534",
                                     "--regid=65534",
                                     "--clear-groups",
                                     RunfilePath("client/rdma-agentctl"),
                                     "--target=" + agent_->target()};
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<RunResult> result =
        RunToCompletion(argv, "", absl::Seconds(60));
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : RunResult();
  };
  RunResult r = as_nobody({"register", "--size=100", "--label=theirs"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string theirs = Field(r.out, "buffer_id");
  r = Ctl({"register", "--size=100", "--label=mine"});
  ASSERT_EQ(r.exit_code, 0) << r.err;

  // Root's own list is root's; --all-users adds everyone's, with the uid.
  r = Ctl({"list"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr(" mine\n"));
  EXPECT_THAT(r.out, Not(HasSubstr(" theirs\n")));
  r = Ctl({"list", "--all-users"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr(" mine\n"));
  EXPECT_THAT(r.out, MatchesRegex(absl::StrCat(
                         "(.|\n)*\n", theirs, " .* 65534 .* theirs\n(.|\n)*")));
  r = Ctl({"-o", "json", "list", "--all-users"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  v1::ListBuffersResponse list;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(r.out, &list).ok())
      << r.out;
  ASSERT_EQ(list.buffers_size(), 2);
  EXPECT_EQ(list.buffers(0).owner_uid(), 65534u);
  EXPECT_EQ(list.buffers(0).label(), "theirs");

  // Anyone else asking for every user's buffers is refused.
  r = as_nobody({"list", "--all-users"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("PERMISSION_DENIED"));
  EXPECT_THAT(r.err, HasSubstr("ListBuffers"));
  r = as_nobody({"list"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr(" theirs\n"));
  EXPECT_THAT(r.out, Not(HasSubstr(" mine\n")));
}

TEST_F(AgentctlTest, SessionsListsRingSessionsAllUsersOnlyForRoot) {
  // No session yet: the header alone.
  RunResult r = Ctl({"sessions"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("ENTRIES"));
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;

  auto ring = client::Ring::Open(agent_->attach_socket_path(), 8);
  ASSERT_TRUE(ring.ok()) << ring.status();
  const std::string uid = absl::StrCat(::geteuid());
  const std::string pid = absl::StrCat(::getpid());
  r = Ctl({"sessions"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, MatchesRegex(absl::StrCat("(.|\n)* ", uid, " +", pid,
                                               " +8 .* 0 +0 +0 -\n")));
  r = Ctl({"-o", "json", "sessions"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  v1::ListRingSessionsResponse list;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(r.out, &list).ok())
      << r.out;
  ASSERT_EQ(list.sessions_size(), 1);
  EXPECT_EQ(list.sessions(0).owner_pid(), static_cast<uint32_t>(::getpid()));
  EXPECT_EQ(list.sessions(0).entries(), 8u);
  EXPECT_TRUE(list.sessions(0).has_open_time());

  if (::geteuid() != 0) return;  // the rest needs a second user
  ASSERT_EQ(::chmod(agent_->runtime_dir().c_str(), 0755), 0);
  auto as_nobody = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = {"setpriv",
                                     "--reuid=65534",
                                     "--regid=65534",
                                     "--clear-groups",
                                     RunfilePath("client/rdma-agentctl"),
                                     "--target=" + agent_->target()};
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<RunResult> result =
        RunToCompletion(argv, "", absl::Seconds(60));
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : RunResult();
  };
  // Root's session is not another user's to see.
  r = as_nobody({"-o", "json", "sessions"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  list.Clear();
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(r.out, &list).ok())
      << r.out;
  EXPECT_EQ(list.sessions_size(), 0);
  r = as_nobody({"sessions", "--all-users"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("PERMISSION_DENIED"));
  EXPECT_THAT(r.err, HasSubstr("ListRingSessions"));
  r = Ctl({"sessions", "--all-users"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr(absl::StrCat(" ", pid, " ")));
}

TEST_F(AgentctlTest, HealthExitsZeroWhileServing) {
  const RunResult r = Ctl({"health"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "SERVING\n");
}

TEST_F(AgentctlTest, MetricsPrintsTheAgentsEndpointOrSaysThereIsNone) {
  // The default test agent serves no metrics.
  RunResult none = Ctl({"metrics"});
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_THAT(none.err, HasSubstr("--metrics_listen"));

  AgentProcess::Options options;
  options.extra_flags = {"--metrics_listen=127.0.0.1:0"};
  auto served = AgentProcess::Start(options);
  ASSERT_TRUE(served.ok()) << served.status();
  ASSERT_TRUE((*served)->client().GetInfo().ok());
  auto result = RunToCompletion({RunfilePath("client/rdma-agentctl"),
                                 "--target=" + (*served)->target(), "metrics"},
                                "", absl::Seconds(60));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->exit_code, 0) << result->err;
  EXPECT_THAT(result->out, HasSubstr("# TYPE rdma_agentd_rpcs_total counter"));
  EXPECT_THAT(result->out,
              HasSubstr("rdma_agentd_rpcs_total{code=\"OK\",method=\"rdma."
                        "agent.v1.RdmaAgent/GetInfo\"}"));
}

TEST_F(AgentctlTest, SocketFromEnvironmentAsABarePath) {
  const absl::StatusOr<RunResult> r = RunToCompletion(
      {"env", absl::StrCat("RDMA_AGENT_SOCKET=", agent_->socket_path()),
       RunfilePath("client/rdma-agentctl"), "info"},
      "", absl::Seconds(30));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->err;
  EXPECT_THAT(r->out, HasSubstr("agent_id:"));
  // --target wins over the environment; a bare path works there too.
  const absl::StatusOr<RunResult> bare =
      RunToCompletion({"env", "RDMA_AGENT_SOCKET=/nonexistent/agent.sock",
                       RunfilePath("client/rdma-agentctl"), "--target",
                       agent_->socket_path(), "info"},
                      "", absl::Seconds(30));
  ASSERT_TRUE(bare.ok()) << bare.status();
  EXPECT_EQ(bare->exit_code, 0) << bare->err;
}

TEST_F(AgentctlTest, MissingOrForbiddenSocketFailsAtOnceNamingTheErrno) {
  const absl::Time start = absl::Now();
  absl::StatusOr<RunResult> r =
      RunToCompletion({RunfilePath("client/rdma-agentctl"),
                       "--target=" + File("nobody-listens.sock"), "info"},
                      "", absl::Seconds(30));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));  // not the 5 s wait
  EXPECT_EQ(r->exit_code, 1);
  EXPECT_THAT(r->err, HasSubstr("No such file or directory"));
  if (::geteuid() != 0) return;
  // The runtime dir is 0700: another user may not reach the socket.
  r = RunToCompletion({"setpriv", "--reuid=65534", "--regid=65534",
                       "--clear-groups", RunfilePath("client/rdma-agentctl"),
                       "--target=" + agent_->socket_path(), "info"},
                      "", absl::Seconds(30));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 1);
  EXPECT_THAT(r->err, HasSubstr("PERMISSION_DENIED"));
  EXPECT_THAT(r->err, HasSubstr("Permission denied"));
}

TEST_F(AgentctlTest, SubmitNotifiesTheOwnerAndNotificationsPrintsIt) {
  auto [src, src_context] = Register(4096);
  auto [dst, dst_context] = Register(4096);
  RunResult r = Ctl({"info", "-o", "json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  v1::AgentInfo info;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(r.out, &info).ok());
  const std::string agent = info.agent_id();

  r = Ctl({"write", src, "--in=-"}, PatternString(3, 0, 100));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = Ctl({"submit", "--op=write", "--local=" + src, "--length=100",
           "--context=" + dst_context, "--notify=block 1 ready"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out,
            absl::StrCat("op 0: OK backend=memory\n", "notification to buffer ",
                         dst, " of agent ", agent, ": OK backend=memory\n"));
  // The owner (this user) reads it once, after the bytes.
  r = Ctl({"notifications"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, absl::StrCat("notification #1 from ", agent, " to buffer ",
                                dst, ": block 1 ready\n"));
  r = Ctl({"read", dst, "--length=100"});
  EXPECT_TRUE(r.out == PatternString(3, 0, 100));
  r = Ctl({"notifications"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "");

  // Asynchronously, with bytes that need escaping; a stream starts with the
  // queued ones.
  r = Ctl({"submit", "--async", "--op=write", "--local=" + src, "--length=1",
           "--context=" + dst_context, "--notify=two\nlines"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = Ctl({"wait", TransferId(r)});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr(absl::StrCat("notification to buffer ", dst,
                                            " of agent ", agent,
                                            ": OK backend=memory")));
  r = Ctl({"notifications", "--watch", "--count=1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, absl::StrCat("notification #2 from ", agent, " to buffer ",
                                dst, ": two\\nlines\n"));

  // JSON: one NotificationEvent per line.
  r = Ctl({"submit", "--op=write", "--local=" + src, "--length=1",
           "--context=" + dst_context, "--notify=j"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = Ctl({"-o", "json", "notifications", "--wait=5s"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  v1::NotificationEvent event;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(r.out, &event).ok())
      << r.out;
  EXPECT_EQ(event.notification().data(), "j");
  EXPECT_EQ(event.notification().sequence(), 3u);
  EXPECT_EQ(absl::StrCat(event.notification().buffer_id()), dst);

  // Too long for the agent: the whole submit is refused.
  r = Ctl({"submit", "--op=write", "--local=" + src, "--length=1",
           "--context=" + dst_context, "--notify=" + std::string(5000, 'x')});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("INVALID_ARGUMENT: Submit: the notification is "
                               "5000 bytes; at most 4096"));
  // Bad usage.
  r = Ctl({"notifications", "--count=2"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--count needs --watch"));
}

// names lists what is published under a prefix now; --watch then streams
// changes until --count or SIGINT.
TEST_F(AgentctlTest, NamesListsThenWatches) {
  auto a = agent_->client().Attach(4096, v1::ACCESS_READ);
  auto b = agent_->client().Attach(4096, v1::ACCESS_READ);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(agent_->client().Publish(a->id(), "kv/a").ok());
  ASSERT_TRUE(agent_->client().Publish(b->id(), "other/b").ok());
  const std::string agent = agent_->client().GetInfo()->agent_id();
  RunResult r = Ctl({"names", "kv/"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, ::testing::StartsWith(absl::StrCat(
                         "kv/a: buffer ", a->id(), " of uid ", ::getuid(),
                         " on agent ", agent, " (epoch ")));
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  r = Ctl({"names"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("other/b: buffer"));
  r = Ctl({"-o", "json", "names", "kv/"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  v1::NameEvent event;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(
                  r.out.substr(0, r.out.find('\n')), &event)
                  .ok())
      << r.out;
  EXPECT_EQ(event.kind(), v1::NameEvent::PUBLISHED);
  EXPECT_EQ(event.record().remote_context(), a->remote_context());

  Subprocess::Options options;
  options.argv = {RunfilePath("client/rdma-agentctl"),
                  "--target=" + agent_->target(),
                  "names",
                  "kv/",
                  "--watch",
                  "--count=2"};
  options.pipe_stdio = true;
  auto watch = Subprocess::Spawn(options);
  ASSERT_TRUE(watch.ok()) << watch.status();
  for (const char* expected : {"published kv/a: buffer", "synced"}) {
    auto line = watch->ReadLine(absl::Seconds(30));
    ASSERT_TRUE(line.ok()) << line.status();
    EXPECT_THAT(*line, ::testing::StartsWith(expected));
  }
  ASSERT_TRUE(agent_->client().Publish(b->id(), "kv/b").ok());
  ASSERT_TRUE(agent_->client().Unpublish("kv/a").ok());
  for (const char* expected : {"published kv/b: buffer", "withdrawn kv/a"}) {
    auto line = watch->ReadLine(absl::Seconds(30));
    ASSERT_TRUE(line.ok()) << line.status();
    EXPECT_THAT(*line, ::testing::StartsWith(expected));
  }
  auto code = watch->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);

  r = Ctl({"names", "--count=2"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--count needs --watch"));
}

// What bash completes after `words` (the last one is the word being typed),
// with the script `rdma-agentctl completion bash` printed.
std::string Complete(const std::string& script,
                     const std::vector<std::string>& words) {
  std::string array;
  for (const std::string& word : words) {
    absl::StrAppend(&array, " '", word, "'");
  }
  const absl::StatusOr<RunResult> r = RunToCompletion(
      {"bash", "-c",
       absl::StrCat("source '", script, "'; COMP_WORDS=(", array,
                    "); COMP_CWORD=", words.size() - 1,
                    "; _rdma_agentctl; echo \"${COMPREPLY[*]}\"")},
      "", absl::Seconds(30));
  EXPECT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->err;
  return std::string(absl::StripTrailingAsciiWhitespace(r->out));
}

TEST_F(AgentctlTest, BashCompletionComesFromTheParser) {
  RunResult r = Ctl({"completion", "bash"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string script = File("completion.bash");
  WriteFile(script, r.out);
  EXPECT_EQ(Complete(script, {"rdma-agentctl", "reg"}), "register");
  EXPECT_EQ(Complete(script, {"rdma-agentctl", "-o", "json", "sub"}), "submit");
  EXPECT_EQ(Complete(script, {"rdma-agentctl", "--timeout", "5", "wa"}),
            "wait watch");
  EXPECT_EQ(Complete(script, {"rdma-agentctl", "submit", "--ops"}),
            "--ops_file");
  EXPECT_EQ(Complete(script, {"rdma-agentctl", "info", "--tim"}), "--timeout");
  EXPECT_EQ(Complete(script, {"rdma-agentctl", "-o", ""}), "text json");
  EXPECT_EQ(
      Complete(script, {"rdma-agentctl", "register", "--access", "read_"}),
      "read_write");
  // Every command of --help, and not the hidden man.
  const std::string all = Complete(script, {"rdma-agentctl", ""});
  for (const char* command :
       {"info", "health", "metrics", "register", "list", "sessions", "release",
        "write", "read", "submit", "wait", "cancel", "watch", "notifications",
        "decode", "completion"}) {
    EXPECT_THAT(absl::StrCat(" ", all, " "),
                HasSubstr(absl::StrCat(" ", command, " ")))
        << command;
  }
  EXPECT_THAT(all, Not(HasSubstr("man")));
  EXPECT_EQ(Ctl({"completion", "zsh"}).exit_code, 2);
}

TEST_F(AgentctlTest, ManPageComesFromTheParserAndRenders) {
  RunResult r = Ctl({"man"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string page = File("rdma-agentctl.1");
  WriteFile(page, r.out);
  auto info = agent_->client().GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_THAT(r.out, HasSubstr(absl::StrCat("\"rdma-agentctl ", info->version(),
                                            "\"")));
  // groff renders it without a warning.
  const absl::StatusOr<RunResult> rendered = RunToCompletion(
      {"sh", "-c", absl::StrCat("groff -ww -man -Tutf8 '", page, "' | col -b")},
      "", absl::Seconds(30));
  ASSERT_TRUE(rendered.ok()) << rendered.status();
  EXPECT_EQ(rendered->err, "");
  for (const char* text :
       {"NAME", "rdma-agentctl - talks to the host's rdma-agentd", "SYNOPSIS",
        "COMMANDS", "EXIT STATUS", "RDMA_AGENT_SOCKET", "--ops_file",
        "--backlog", "release ID", "--timeout VALUE"}) {
    EXPECT_THAT(rendered->out, HasSubstr(text)) << text;
  }
  // Hidden from --help.
  EXPECT_THAT(Ctl({"--help"}).out, Not(HasSubstr("  man ")));
}

TEST_F(AgentctlTest, ProgressLineForReadAndWriteWhenAskedAndNeverInJson) {
  constexpr uint64_t kSize = 9 << 20;  // three 4 MiB steps, the last short
  auto [id, context] = Register(kSize);
  const std::string payload = PatternString(11, 0, kSize);
  WriteFile(File("big"), payload);
  RunResult r = Ctl({"--progress", "write", id, "--in=" + File("big")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("\r4.0 MiB / 9.0 MiB"));
  EXPECT_THAT(r.err, MatchesRegex("(.|\n)*\r9.0 MiB in [0-9.]+m?s \\([0-9.]+ "
                                  "[KMG]iB/s\\) *\n(.|\n)*"));
  EXPECT_THAT(r.err, HasSubstr(absl::StrCat("wrote ", kSize, " bytes")));
  r = Ctl({"read", id, "--length=9MiB", "--out=" + File("back"), "--progress"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("9.0 MiB in "));
  EXPECT_TRUE(ReadFile(File("back")) == payload);
  // Not a terminal, not asked: nothing; -o json: never.
  r = Ctl({"read", id, "--length=9MiB", "--out=" + File("back")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  r = Ctl({"-o", "json", "--progress", "read", id, "--length=9MiB",
           "--out=" + File("back")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_TRUE(ReadFile(File("back")) == payload);
}

TEST_F(AgentctlTest, SubmitWithProgressRunsTheBatchAndPrintsItsEnd) {
  constexpr uint64_t kSize = 9 << 20;
  auto [src, src_context] = Register(kSize);
  auto [dst, dst_context] = Register(kSize);
  const std::string payload = PatternString(12, 0, kSize);
  WriteFile(File("big"), payload);
  RunResult r = Ctl({"write", src, "--in=" + File("big")});
  ASSERT_EQ(r.exit_code, 0) << r.err;

  r = Ctl({"--progress", "submit", "--op=read", "--local=" + dst,
           "--length=9MiB", "--context=" + src_context});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "op 0: OK backend=memory\n");
  EXPECT_THAT(r.err, MatchesRegex("(.|\n)*\r9.0 MiB in [0-9.]+m?s \\([0-9.]+ "
                                  "[KMG]iB/s\\) *\n"));
  r = Ctl({"read", dst, "--length=9MiB", "--out=" + File("back")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(ReadFile(File("back")) == payload);

  // A failed op: printed as submit prints it, exit 1, only what landed.
  r = Ctl(
      {"--progress", "submit", "--op=read", "--local=" + dst, "--length=4k",
       "--context=" + src_context,
       "--op=read,length=1MiB,remote_offset=" + std::to_string(kSize - 100)});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.out, HasSubstr("op 0: OK backend=memory\nop 1: OUT_OF_RANGE"));
  EXPECT_THAT(r.err, HasSubstr("\r4.0 KiB in "));
  EXPECT_THAT(r.err, HasSubstr("submit: an op failed"));

  // -o json: no line, the SubmitResponse as ever.
  r = Ctl({"-o", "json", "--progress", "submit", "--op=read", "--local=" + dst,
           "--length=4k", "--context=" + src_context});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_THAT(r.out, HasSubstr("\"results\""));
}

// Two agents over tcp: a followed submit that SIGINT interrupts cancels its
// transfer, prints the ops' ends and exits 1; nothing lands afterwards.
TEST(AgentctlTcpTest, SigintCancelsAFollowedSubmit) {
  AgentProcess::Options tcp;
  tcp.backends = "memory,tcp";
  tcp.log_level = "info";
  auto a = AgentProcess::Start(tcp);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = AgentProcess::Start(tcp);
  ASSERT_TRUE(b.ok()) << b.status();
  constexpr uint64_t kSize = 256ull << 20;
  auto local = (*a)->client().Attach(kSize, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(local.ok()) << local.status();
  auto remote = (*b)->client().Attach(kSize, v1::ACCESS_READ_WRITE);
  ASSERT_TRUE(remote.ok()) << remote.status();
  std::memset(local->data(), 0, kSize);
  std::memset(remote->data(), 0x5a, kSize);
  auto dir = MakeShortTempDir();
  ASSERT_TRUE(dir.ok()) << dir.status();
  const std::string context_file = *dir + "/remote.ctx";
  WriteFile(context_file, remote->remote_context());
  std::string ops;
  for (int i = 0; i < 64; ++i) ops += "read\n";  // 16 GiB: seconds of work
  WriteFile(*dir + "/ops", ops);
  const std::string log = *dir + "/out";
  Subprocess::Options options;
  options.argv = {RunfilePath("client/rdma-agentctl"),
                  "--target=" + (*a)->target(),
                  "--timeout=600s",
                  "--progress",
                  "submit",
                  "--ops_file=" + *dir + "/ops",
                  "--local=" + std::to_string(local->id()),
                  "--length=256MiB",
                  "--context_file=" + context_file};
  options.log_path = log;
  auto ctl = Subprocess::Spawn(std::move(options));
  ASSERT_TRUE(ctl.ok()) << ctl.status();
  const std::byte* data = local->data();
  ASSERT_TRUE(Eventually(
      [&] {
        for (uint64_t at = 0; at < kSize; at += 1 << 20) {
          if (data[at] == std::byte{0x5a}) return true;
        }
        return false;
      },
      absl::Seconds(60)))
      << "the transfer never moved a byte";
  ctl->Signal(SIGINT);
  auto exit_code = ctl->Wait(absl::Seconds(30));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  // Ended: a sentinel over the whole buffer stays.
  std::memset(local->data(), 0xc3, kSize);
  const std::string out = ReadFile(log);
  EXPECT_EQ(*exit_code, 1) << out;
  EXPECT_THAT(out, HasSubstr("CANCELLED")) << out;
  EXPECT_THAT(out, HasSubstr("op 63: ")) << out;
  absl::SleepFor(absl::Seconds(1));
  const std::byte* end = data + kSize;
  const std::byte* changed =
      std::find_if(data, end, [](std::byte b) { return b != std::byte{0xc3}; });
  EXPECT_EQ(changed, end) << "byte " << (changed - data)
                          << " was written after rdma-agentctl exited";
  RemoveTree(*dir);
}

}  // namespace
}  // namespace rdma_agent::testing
