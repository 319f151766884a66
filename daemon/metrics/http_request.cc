#include "daemon/metrics/http_request.h"

#include <algorithm>

#include "absl/strings/ascii.h"

namespace rdma_agent {
namespace {

using State = HttpRequestHead::State;

constexpr size_t kMaxMethodBytes = 16;

HttpRequestHead Ended(State state) {
  HttpRequestHead head;
  head.state = state;
  return head;
}

bool IsMethod(absl::string_view method) {
  return !method.empty() && method.size() <= kMaxMethodBytes &&
         std::all_of(method.begin(), method.end(),
                     [](char c) { return absl::ascii_isupper(c); });
}

// Origin form only ("/path?query"): the endpoint is no proxy.
bool IsTarget(absl::string_view target) {
  return !target.empty() && target[0] == '/' &&
         std::all_of(target.begin(), target.end(), [](char c) {
           return c > 0x20 && c < 0x7f;  // visible ASCII
         });
}

// "GET /metrics HTTP/1.1" into `head`; false when it is none.
bool ParseRequestLine(absl::string_view line, HttpRequestHead* head) {
  const size_t first = line.find(' ');
  if (first == absl::string_view::npos) return false;
  const size_t second = line.find(' ', first + 1);
  if (second == absl::string_view::npos) return false;
  const absl::string_view method = line.substr(0, first);
  const absl::string_view target = line.substr(first + 1, second - first - 1);
  const absl::string_view version = line.substr(second + 1);
  if (!IsMethod(method) || !IsTarget(target) ||
      (version != "HTTP/1.1" && version != "HTTP/1.0")) {
    return false;
  }
  head->method = std::string(method);
  head->path = std::string(target.substr(0, target.find_first_of("?#")));
  return true;
}

}  // namespace

HttpRequestHead ParseHttpRequestHead(absl::string_view bytes,
                                     size_t max_head_bytes) {
  // Never look past the bound, whatever was read.
  const bool truncated = bytes.size() > max_head_bytes;
  if (truncated) bytes = bytes.substr(0, max_head_bytes);
  HttpRequestHead head;
  size_t at = 0;
  bool have_request_line = false;
  while (true) {
    const size_t newline = bytes.find('\n', at);
    if (newline == absl::string_view::npos) break;
    absl::string_view line = bytes.substr(at, newline - at);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    for (char c : line) {
      // Control characters (a bare CR included) end it: no smuggling.
      if ((static_cast<unsigned char>(c) < 0x20 && c != '\t') || c == 0x7f) {
        return Ended(State::kBad);
      }
    }
    at = newline + 1;
    if (!have_request_line) {
      if (line.empty()) continue;  // leading empty lines are allowed
      if (!ParseRequestLine(line, &head)) return Ended(State::kBad);
      have_request_line = true;
      continue;
    }
    if (line.empty()) {
      head.state = State::kComplete;
      head.head_bytes = at;
      return head;
    }
    // A header field: "name: value"; an obsolete folded line is refused.
    if (line[0] == ' ' || line[0] == '\t' ||
        line.find(':') == absl::string_view::npos) {
      return Ended(State::kBad);
    }
  }
  // An unfinished request line is judged as soon as its method is.
  if (!have_request_line) {
    const absl::string_view partial = bytes.substr(at);
    const size_t space = partial.find(' ');
    const absl::string_view method = partial.substr(0, space);
    const bool cr_of_empty_line = partial == "\r";
    if (!cr_of_empty_line &&
        (method.size() > kMaxMethodBytes ||
         !std::all_of(method.begin(), method.end(),
                      [](char c) { return absl::ascii_isupper(c); }) ||
         (space != absl::string_view::npos && method.empty()))) {
      return Ended(State::kBad);
    }
  }
  if (truncated || bytes.size() >= max_head_bytes) {
    return Ended(State::kTooLarge);
  }
  return Ended(State::kIncomplete);
}

}  // namespace rdma_agent
