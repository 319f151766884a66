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

constexpr uint64_t kMaxNote = 64;  // --max_notification_bytes here

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
  EXPECT_EQ(one->total_bytes, kHeaderBytes + kSubmissionBytes +
                                  kCompletionBytes + kMessageBytes +
                                  kPayloadBytes);
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
  // Version 2's layout: the payload area follows the message slots.
  EXPECT_EQ(read->payloads_offset, 512u + 352u * 8);
  EXPECT_EQ(read->total_bytes, 512u + 608u * 8);
  uint64_t payloads = 0;
  std::memcpy(&payloads, base() + kPayloadsOffsetOffset, sizeof(payloads));
  EXPECT_EQ(payloads, read->payloads_offset);
  uint32_t version = 1;
  std::memcpy(base() + kVersionOffset, &version, sizeof(version));
  EXPECT_EQ(ReadHeader(base(), memory_.size()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(RingProtocolTest, EveryBadFieldIsNamed) {
  auto check = [&](const Submission& entry) {
    return CheckSubmission(entry, geometry_, kMaxNote);
  };
  EXPECT_TRUE(check(Op(1)).ok());
  Submission bad = Op(1);
  bad.opcode = 5;
  EXPECT_THAT(check(bad).message(), HasSubstr("opcode 5"));
  bad = Op(1);
  bad.flags = 0x80;
  EXPECT_THAT(check(bad).message(), HasSubstr("flags"));
  bad = Op(1);
  bad.reserved0 = 1;
  EXPECT_THAT(check(bad).message(), HasSubstr("reserved"));
  bad = Op(1);
  bad.notification = 1;  // without NOTIFY
  EXPECT_THAT(check(bad).message(), HasSubstr("notification (offset 56)"));
  bad = Op(1);
  bad.length = 0;
  EXPECT_THAT(check(bad).message(), HasSubstr("length"));
  bad = Op(1);
  bad.remote_handle = 0;
  EXPECT_THAT(check(bad).message(), HasSubstr("remote_handle"));
}

TEST_F(RingProtocolTest, RunPreparedAndCancelUseOnlyTheirFields) {
  auto check = [&](const Submission& entry) {
    return CheckSubmission(entry, geometry_, kMaxNote);
  };
  Submission run;
  run.opcode = kOpRunPrepared;
  run.flags = kEndOfBatch;
  run.remote_handle = 7;  // the prepared transfer's id
  EXPECT_TRUE(check(run).ok());
  Submission bad = run;
  bad.remote_handle = 0;
  EXPECT_THAT(check(bad).message(), HasSubstr("prepared transfer"));
  bad = run;
  bad.length = 8;
  EXPECT_THAT(check(bad).message(), HasSubstr("RUN_PREPARED: local_buffer_id"));
  Submission cancel;
  cancel.opcode = kOpCancel;
  cancel.flags = kEndOfBatch;
  cancel.remote_handle = 0;  // tag 0 may be cancelled too
  EXPECT_TRUE(check(cancel).ok());
  bad = cancel;
  bad.local_offset = 1;
  EXPECT_THAT(check(bad).message(), HasSubstr("CANCEL: local_buffer_id"));
  bad = cancel;
  bad.flags |= kNotify;
  bad.notification = uint64_t{4} << 32;
  EXPECT_THAT(check(bad).message(), HasSubstr("not allowed on CANCEL"));
}

TEST_F(RingProtocolTest, RunPreparedAndCancelAreBatchesOfTheirOwn) {
  Batch batch;
  Submission run;
  run.opcode = kOpRunPrepared;
  run.remote_handle = 7;
  Put(0, Op(1));
  run.flags = kEndOfBatch;
  Put(1, run);
  ASSERT_EQ(*TakeBatch(base(), geometry_, 0, 2, 8, kMaxNote, &batch), 2u);
  EXPECT_TRUE(batch.checks[0].ok());
  EXPECT_THAT(batch.checks[1].message(),
              HasSubstr("RUN_PREPARED must be a batch of its own"));
  Submission cancel;
  cancel.opcode = kOpCancel;
  cancel.flags = kEndOfBatch;
  Put(2, cancel);
  ASSERT_EQ(*TakeBatch(base(), geometry_, 2, 3, 8, kMaxNote, &batch), 1u);
  EXPECT_TRUE(batch.checks[0].ok());
  // A one-entry ring takes an entry without END_OF_BATCH as its batch.
  auto one = GeometryFor(1);
  ASSERT_TRUE(one.ok());
  std::vector<std::byte> small(one->total_bytes);
  WriteHeader(small.data(), *one);
  cancel.flags = 0;
  std::memcpy(small.data() + one->submissions_offset, &cancel, sizeof(cancel));
  ASSERT_EQ(*TakeBatch(small.data(), *one, 0, 1, 1, kMaxNote, &batch), 1u);
  EXPECT_THAT(batch.checks[0].message(),
              HasSubstr("CANCEL must carry END_OF_BATCH"));
}

TEST_F(RingProtocolTest, ANotificationIsCopiedOnceAndBounded) {
  const std::string note = "layer 3 is in";
  const uint32_t offset = 100;
  std::memcpy(base() + geometry_.payloads_offset + offset, note.data(),
              note.size());
  Submission entry = Op(1, /*end=*/true);
  entry.flags |= kNotify;
  entry.notification = offset | (uint64_t{note.size()} << 32);
  Put(0, entry);
  Batch batch;
  ASSERT_EQ(*TakeBatch(base(), geometry_, 0, 1, 8, kMaxNote, &batch), 1u);
  ASSERT_TRUE(batch.checks[0].ok()) << batch.checks[0];
  EXPECT_EQ(batch.notification, note);
  // The client reuses the payload space: the copy stands.
  std::memset(base() + geometry_.payloads_offset, 0, 256 * 8);
  EXPECT_EQ(batch.notification, note);

  auto check = [&](const Submission& e) {
    return CheckSubmission(e, geometry_, kMaxNote);
  };
  Submission bad = entry;
  bad.notification = (geometry_.payload_area_bytes() - 4) | (uint64_t{8} << 32);
  EXPECT_THAT(check(bad).message(), HasSubstr("beyond the payload area"));
  bad.notification = 0xffffffffu | (uint64_t{8} << 32);  // no wrap to 0
  EXPECT_THAT(check(bad).message(), HasSubstr("payload_offset"));
  bad.notification = uint64_t{kMaxNote + 1} << 32;
  EXPECT_THAT(check(bad).message(), HasSubstr("--max_notification_bytes"));
  bad.notification = 5;  // length 0
  EXPECT_THAT(check(bad).message(), HasSubstr("payload_length must be"));
  bad = entry;
  bad.flags = kNotify;  // not the end of its batch
  EXPECT_THAT(check(bad).message(), HasSubstr("END_OF_BATCH"));
  // A bad NOTIFY fails its entry; nothing is copied.
  bad = entry;
  bad.notification = uint64_t{kMaxNote + 1} << 32;
  Put(1, bad);
  ASSERT_EQ(*TakeBatch(base(), geometry_, 1, 2, 8, kMaxNote, &batch), 1u);
  EXPECT_EQ(batch.checks[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(batch.notification.empty());
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
  EXPECT_EQ(*TakeBatch(base(), geometry_, 6, 8, 8, kMaxNote, &batch), 0u);
  EXPECT_TRUE(batch.entries.empty());
  Put(8, Op(80, /*end=*/true));  // wraps to slot 0
  Put(9, Op(90, /*end=*/true));
  // Ended, but only two completion slots are free.
  EXPECT_EQ(*TakeBatch(base(), geometry_, 6, 10, 2, kMaxNote, &batch), 0u);
  ASSERT_EQ(*TakeBatch(base(), geometry_, 6, 10, 3, kMaxNote, &batch), 3u);
  ASSERT_EQ(batch.entries.size(), 3u);
  EXPECT_EQ(batch.entries[0].user_tag, 60u);
  EXPECT_EQ(batch.entries[2].user_tag, 80u);
  EXPECT_TRUE(batch.checks[2].ok());
  ASSERT_EQ(*TakeBatch(base(), geometry_, 9, 10, 8, kMaxNote, &batch), 1u);
  EXPECT_EQ(batch.entries[0].user_tag, 90u);
}

TEST_F(RingProtocolTest, AFullRingWithoutEndIsOneBatch) {
  Batch batch;
  for (uint32_t i = 0; i < 8; ++i) Put(i, Op(i));
  EXPECT_EQ(*TakeBatch(base(), geometry_, 0, 7, 8, kMaxNote, &batch), 0u);
  EXPECT_EQ(*TakeBatch(base(), geometry_, 0, 8, 8, kMaxNote, &batch), 8u);
}

TEST_F(RingProtocolTest, TheCopyIsWhatIsJudged) {
  Batch batch;
  Put(0, Op(1, /*end=*/true));
  ASSERT_EQ(*TakeBatch(base(), geometry_, 0, 1, 8, kMaxNote, &batch), 1u);
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
