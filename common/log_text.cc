#include "common/log_text.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace rdma_agent {

std::string LogSafe(absl::string_view text, size_t max_bytes) {
  const bool cut = text.size() > max_bytes;
  std::string escaped = absl::CHexEscape(text.substr(0, max_bytes));
  if (cut) absl::StrAppend(&escaped, "...");
  return escaped;
}

}  // namespace rdma_agent
