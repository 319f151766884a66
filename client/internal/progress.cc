#include "client/internal/progress.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace rdma_agent::client::internal {

std::string HumanBytes(double bytes) {
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return absl::StrFormat("%.0f B", bytes);
  int unit = -1;
  while (bytes >= 1024 && unit < 4) {
    bytes /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.1f %s", bytes, kUnits[unit]);
}

std::string ProgressText(uint64_t done, uint64_t total,
                         absl::Duration elapsed) {
  std::string text = absl::StrCat(HumanBytes(static_cast<double>(done)), " / ",
                                  HumanBytes(static_cast<double>(total)));
  const double seconds = absl::ToDoubleSeconds(elapsed);
  if (done == 0 || seconds <= 0) return text;
  const double rate = static_cast<double>(done) / seconds;
  const double left = static_cast<double>(total - std::min(done, total)) / rate;
  absl::StrAppend(&text, "  ", HumanBytes(rate), "/s  ETA ",
                  absl::FormatDuration(absl::Seconds(std::ceil(left))));
  return text;
}

ProgressLine::ProgressLine(uint64_t total, bool enabled, bool forced, FILE* out,
                           absl::Time start)
    : total_(total),
      enabled_(enabled || forced),
      forced_(forced),
      out_(out),
      start_(start) {}

void ProgressLine::Update(uint64_t done, absl::Time now) {
  if (!enabled_) return;
  if (!forced_ && now - start_ < absl::Seconds(1)) return;
  if (now - last_draw_ < absl::Milliseconds(100)) return;
  last_draw_ = now;
  drawn_ = true;
  // Padded: a shorter line overwrites all of a longer one.
  absl::FPrintF(out_, "\r%-60s", ProgressText(done, total_, now - start_));
  std::fflush(out_);
}

void ProgressLine::Finish(uint64_t done, absl::Time now) {
  if (!drawn_ && !(enabled_ && (forced_ || now - start_ >= absl::Seconds(1)))) {
    return;
  }
  const absl::Duration took = now - start_;
  const double seconds = std::max(absl::ToDoubleSeconds(took), 1e-9);
  absl::FPrintF(out_, "\r%-60s\n",
                absl::StrCat(HumanBytes(static_cast<double>(done)), " in ",
                             absl::FormatDuration(
                                 absl::Trunc(took, absl::Milliseconds(1))),
                             " (", HumanBytes(done / seconds), "/s)"));
  std::fflush(out_);
}

}  // namespace rdma_agent::client::internal
