#include "daemon/metrics/http_request.h"

#include <string>

#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

using State = HttpRequestHead::State;

HttpRequestHead Parse(const std::string& bytes, size_t max = 8192) {
  return ParseHttpRequestHead(bytes, max);
}

TEST(HttpRequestHeadTest, ReadsMethodAndPathOfAWholeHead) {
  const std::string request =
      "GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nAccept: */*\r\n\r\nrest";
  const HttpRequestHead head = Parse(request);
  ASSERT_EQ(head.state, State::kComplete);
  EXPECT_EQ(head.method, "GET");
  EXPECT_EQ(head.path, "/metrics");
  EXPECT_EQ(head.head_bytes, request.size() - 4);
  // Bare LF line endings and leading empty lines are tolerated.
  const HttpRequestHead lf = Parse("\r\n\nHEAD /healthz HTTP/1.0\n\n");
  ASSERT_EQ(lf.state, State::kComplete);
  EXPECT_EQ(lf.method, "HEAD");
  EXPECT_EQ(lf.path, "/healthz");
}

TEST(HttpRequestHeadTest, WaitsForTheRest) {
  EXPECT_EQ(Parse("").state, State::kIncomplete);
  EXPECT_EQ(Parse("GE").state, State::kIncomplete);
  EXPECT_EQ(Parse("GET /metrics HTT").state, State::kIncomplete);
  EXPECT_EQ(Parse("GET /metrics HTTP/1.1\r\nHost: a\r\n").state,
            State::kIncomplete);
}

TEST(HttpRequestHeadTest, RefusesWhatIsNoHttpRequest) {
  for (const std::string bad : {
           "get /metrics HTTP/1.1\r\n\r\n",  // method case
           "GET metrics HTTP/1.1\r\n\r\n",   // not origin form
           "GET http://a/metrics HTTP/1.1\r\n\r\n",
           "GET /metrics HTTP/2\r\n\r\n",               // version
           "GET /metrics\r\n\r\n",                      // HTTP/0.9
           "GET /me\x01trics HTTP/1.1\r\n\r\n",         // control character
           "GET /metrics HTTP/1.1\r\nX: a\rb\r\n\r\n",  // bare CR
           "GET /metrics HTTP/1.1\r\nno colon\r\n\r\n",
           "GET /metrics HTTP/1.1\r\nX: a\r\n folded\r\n\r\n",
           "\x16\x03\x01\x02",            // a TLS hello, judged early
           "ABCDEFGHIJKLMNOPQRSTUVWXYZ",  // a method too long
       }) {
    EXPECT_EQ(Parse(bad).state, State::kBad) << bad;
  }
}

TEST(HttpRequestHeadTest, RefusesHeadsPastTheBound) {
  const std::string head =
      "GET /metrics HTTP/1.1\r\nX: " + std::string(100, 'a') + "\r\n\r\n";
  EXPECT_EQ(Parse(head, head.size()).state, State::kComplete);
  EXPECT_EQ(Parse(head, head.size() - 1).state, State::kTooLarge);
  EXPECT_EQ(Parse(head.substr(0, 50), 50).state, State::kTooLarge);
}

}  // namespace
}  // namespace rdma_agent
