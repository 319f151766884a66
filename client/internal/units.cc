#include "client/internal/units.h"

#include <cmath>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace rdma_agent::client::internal {
namespace {

// log2 of the multiplier `suffix` names; -1 when it names none.
int SuffixShift(absl::string_view suffix) {
  if (suffix.empty() || suffix == "B") return 0;
  const char letters[] = "KMGTP";
  for (int i = 0; letters[i] != '\0'; ++i) {
    const char upper = letters[i];
    const char lower = absl::ascii_tolower(upper);
    if (suffix[0] != upper && suffix[0] != lower) continue;
    absl::string_view rest = suffix.substr(1);
    if (rest.empty() || absl::EqualsIgnoreCase(rest, "i") ||
        absl::EqualsIgnoreCase(rest, "ib")) {
      return 10 * (i + 1);
    }
    return -1;
  }
  return -1;
}

}  // namespace

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  absl::string_view digits = absl::StripAsciiWhitespace(text);
  if (absl::StartsWith(digits, "-")) {
    return absl::InvalidArgumentError(absl::StrCat(text, " is negative"));
  }
  size_t end = 0;
  while (end < digits.size() && absl::ascii_isdigit(digits[end])) ++end;
  const int shift = SuffixShift(digits.substr(end));
  digits = digits.substr(0, end);
  if (digits.empty() || shift < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(text,
                     " is not a size (bytes, or with a binary suffix: 4k, "
                     "64KiB, 1M, 2GiB)"));
  }
  uint64_t value;
  if (!absl::SimpleAtoi(digits, &value) ||
      value > (std::numeric_limits<uint64_t>::max() >> shift)) {
    return absl::InvalidArgumentError(
        absl::StrCat(text, " is more than 2^64-1 bytes"));
  }
  return value << shift;
}

absl::StatusOr<absl::Duration> ParseDuration(absl::string_view text) {
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  absl::Duration value;
  double seconds;
  if (absl::SimpleAtod(trimmed, &seconds) && std::isfinite(seconds)) {
    value = absl::Seconds(seconds);
  } else if (!absl::ParseDuration(trimmed, &value) ||
             value == absl::InfiniteDuration() ||
             value == -absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        text, " is not a duration (seconds, or with a unit: 500ms, 30s, 5m)"));
  }
  if (value < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(text, " is negative"));
  }
  return value;
}

}  // namespace rdma_agent::client::internal
