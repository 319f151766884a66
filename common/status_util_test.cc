#include "common/status_util.h"

#include <cerrno>

#include "common/grpc_status.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

TEST(StatusUtilTest, PrefixedKeepsCodeAndOk) {
  EXPECT_TRUE(Prefixed(absl::OkStatus(), "step").ok());
  EXPECT_EQ(Prefixed(absl::NotFoundError("gone"), "Release"),
            absl::NotFoundError("Release: gone"));
  EXPECT_EQ(Prefixed(absl::StatusCode::kUnavailable,
                     absl::InternalError("reset"), "peer"),
            absl::UnavailableError("peer: reset"));
}

TEST(StatusUtilTest, ErrnoStatusNamesTheCall) {
  EXPECT_EQ(ErrnoStatus(absl::StatusCode::kInternal, "bind", ENOENT),
            absl::InternalError("bind: No such file or directory"));
}

TEST(StatusUtilTest, CodesOutsideTheSharedRangeAreUnknown) {
  EXPECT_TRUE(StatusFromInt(0, "ignored").ok());
  EXPECT_EQ(StatusFromInt(5, "x"), absl::NotFoundError("x"));
  EXPECT_EQ(StatusFromInt(16, "x"), absl::UnauthenticatedError("x"));
  EXPECT_EQ(StatusFromInt(17, "x"), absl::UnknownError("x"));
  EXPECT_EQ(StatusFromInt(-1, "x"), absl::UnknownError("x"));
}

TEST(GrpcStatusTest, RoundTrips) {
  const absl::Status status = absl::PermissionDeniedError("no");
  const grpc::Status converted = ToGrpcStatus(status);
  EXPECT_EQ(converted.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(converted.error_message(), "no");
  EXPECT_EQ(FromGrpcStatus(converted), status);
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

}  // namespace
}  // namespace rdma_agent
