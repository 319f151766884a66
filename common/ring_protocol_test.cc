// The ring's layout and the agent's reading of what a client wrote: every
// field a client controls is judged on a copy, impossible indices are
// refused, and a batch is taken whole or not at all.
#include "common/ring_protocol.h"

#include <cstring>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rdma_agent::ring {
namespace {

using ::testing::HasSubstr;

class RingProtocolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto geometry = GeometryFor(8);
    ASSERT_TRUE(geometry.ok()) << geometry.status();
    geometry_ = *geometry;
    memory_.assign(geometry_.total_bytes, std::byte{0});
    WriteHeader(base(), geometry_);
  }

  std::byte* base() { return memory_.data(); }

  void Put(uint32_t index, const Submission& entry) {
    std::memcpy(base() + geometry_.submissions_offset +
                    (index & geometry_.mask()) * kSubmissionBytes,
                &entry, sizeof(entry));
  }

  static Submission Op(uint64_t tag, bool end = false) {
    Submission entry;
    entry.opcode = kOpReadIntoLocal;
    entry.flags = end ? kEndOfBatch : 0;
    entry.user_tag = tag;
    entry.local_buffer_id = 1;
    entry.length = 8;
    entry.remote_handle = 2;
    return entry;
  }

  Geometry geometry_;
  std::vector<std::byte> memory_;
};

TEST_F(RingProtocolTest, GeometryIsAPowerOfTwoWithinBounds) {
  EXPECT_FALSE(GeometryFor(0).ok());
  EXPECT_FALSE(GeometryFor(3).ok());
  EXPECT_FALSE(GeometryFor(kMaxEntries * 2).ok());
  auto one = GeometryFor(1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->total_bytes,
            kHeaderBytes + kSubmissionBytes + kCompletionBytes + kMessageBytes);
  EXPECT_EQ(geometry_.submissions_offset, kHeaderBytes);
  EXPECT_EQ(geometry_.completions_offset, kHeaderBytes + 8 * kSubmissionBytes);
}

TEST_F(RingProtocolTest, HeaderReadsBackAndIsChecked) {
  auto read = ReadHeader(base(), memory_.size());
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->entries, 8u);
  EXPECT_EQ(read->total_bytes, geometry_.total_bytes);
  // A mapping shorter than the header claims.
  EXPECT_FALSE(ReadHeader(base(), memory_.size() - 1).ok());
  uint32_t version = 2;
  std::memcpy(base() + kVersionOffset, &version, sizeof(version));
  EXPECT_EQ(ReadHeader(base(), memory_.size()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(RingProtocolTest, EveryBadFieldIsNamed) {
  EXPECT_TRUE(CheckSubmission(Op(1)).ok());
  Submission bad = Op(1);
  bad.opcode = 3;
  EXPECT_THAT(CheckSubmission(bad).message(), HasSubstr("opcode 3"));
  bad = Op(1);
  bad.flags = 0x80;
  EXPECT_THAT(CheckSubmission(bad).message(), HasSubstr("flags"));
  bad = Op(1);
  bad.reserved1 = 1;
  EXPECT_THAT(CheckSubmission(bad).message(), HasSubstr("reserved"));
  bad = Op(1);
  bad.length = 0;
  EXPECT_THAT(CheckSubmission(bad).message(), HasSubstr("length"));
  bad = Op(1);
  bad.remote_handle = 0;
  EXPECT_THAT(CheckSubmission(bad).message(), HasSubstr("remote_handle"));
}

TEST_F(RingProtocolTest, ImpossibleIndicesAreRefused) {
  EXPECT_EQ(*PendingSubmissions(5, 5, 8), 0u);
  EXPECT_EQ(*PendingSubmissions(5, 13, 8), 8u);
  // Across the 32-bit wrap.
  EXPECT_EQ(*PendingSubmissions(0xfffffffe, 2, 8), 4u);
  EXPECT_EQ(PendingSubmissions(5, 14, 8).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(PendingSubmissions(5, 4, 8).status().code(),
            absl::StatusCode::kFailedPrecondition);  // a tail behind the head
  EXPECT_EQ(*FreeCompletions(10, 10, 8), 8u);
  EXPECT_EQ(*FreeCompletions(2, 10, 8), 0u);
  EXPECT_FALSE(FreeCompletions(11, 10, 8).ok());  // head ahead of the tail
  EXPECT_FALSE(FreeCompletions(1, 10, 8).ok());
}

TEST_F(RingProtocolTest, ABatchIsTakenWholeOrNotAtAll) {
  Batch batch;
  Put(6, Op(60));
  Put(7, Op(70));
  // Not ended yet: nothing is taken.
  EXPECT_EQ(*TakeBatch(base(), geometry_, 6, 8, 8, &batch), 0u);
  EXPECT_TRUE(batch.entries.empty());
  Put(8, Op(80, /*end=*/true));  // wraps to slot 0
  Put(9, Op(90, /*end=*/true));
  // Ended, but only two completion slots are free.
  EXPECT_EQ(*TakeBatch(base(), geometry_, 6, 10, 2, &batch), 0u);
  ASSERT_EQ(*TakeBatch(base(), geometry_, 6, 10, 3, &batch), 3u);
  ASSERT_EQ(batch.entries.size(), 3u);
  EXPECT_EQ(batch.entries[0].user_tag, 60u);
  EXPECT_EQ(batch.entries[2].user_tag, 80u);
  EXPECT_TRUE(batch.checks[2].ok());
  ASSERT_EQ(*TakeBatch(base(), geometry_, 9, 10, 8, &batch), 1u);
  EXPECT_EQ(batch.entries[0].user_tag, 90u);
}

TEST_F(RingProtocolTest, AFullRingWithoutEndIsOneBatch) {
  Batch batch;
  for (uint32_t i = 0; i < 8; ++i) Put(i, Op(i));
  EXPECT_EQ(*TakeBatch(base(), geometry_, 0, 7, 8, &batch), 0u);
  EXPECT_EQ(*TakeBatch(base(), geometry_, 0, 8, 8, &batch), 8u);
}

TEST_F(RingProtocolTest, TheCopyIsWhatIsJudged) {
  Batch batch;
  Put(0, Op(1, /*end=*/true));
  ASSERT_EQ(*TakeBatch(base(), geometry_, 0, 1, 8, &batch), 1u);
  // The client scribbles after the agent copied: the copy stands.
  Submission scribbled = Op(1, true);
  scribbled.opcode = 9;
  Put(0, scribbled);
  EXPECT_EQ(batch.entries[0].opcode, kOpReadIntoLocal);
  EXPECT_TRUE(batch.checks[0].ok());
}

TEST_F(RingProtocolTest, CompletionsRoundTripWithTheirMessages) {
  Completion completion;
  completion.user_tag = 42;
  completion.code = 5;
  completion.backend = kBackendMemory;
  WriteCompletion(base(), geometry_, 11, completion,
                  "op 0: " + std::string(400, 'x'));
  std::string message;
  Completion read = ReadCompletion(base(), geometry_, 3, &message);
  EXPECT_EQ(read.user_tag, 42u);
  EXPECT_EQ(read.code, 5);
  EXPECT_STREQ(BackendName(read.backend), "memory");
  EXPECT_EQ(message.size(), kMessageBytes - 1);
  EXPECT_EQ(message.substr(0, 6), "op 0: ");
}

}  // namespace
}  // namespace rdma_agent::ring
