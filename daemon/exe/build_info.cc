#include "daemon/exe/build_info.h"

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "daemon/api/version.h"
#include "daemon/exe/build_stamp.h"

// Bazel's compilation mode, from the BUILD file ($(COMPILATION_MODE)).
#ifndef RDMA_AGENTD_COMPILATION_MODE
#define RDMA_AGENTD_COMPILATION_MODE unknown
#endif
#define RDMA_AGENTD_STRINGIFY_(x) #x
#define RDMA_AGENTD_STRINGIFY(x) RDMA_AGENTD_STRINGIFY_(x)

namespace rdma_agent {
namespace {

constexpr char kCompilationMode[] =
    RDMA_AGENTD_STRINGIFY(RDMA_AGENTD_COMPILATION_MODE);

constexpr char kCompiler[] =
#if defined(__clang__)
    "clang " __clang_version__;
#elif defined(__GNUC__)
    "gcc " __VERSION__;
#else
    "an unknown compiler";
#endif

// What the mode meant for this file: copts can override it.
constexpr char kCodeGeneration[] =
#ifdef __OPTIMIZE__
    "optimized, "
#else
    "not optimized, "
#endif
#ifdef NDEBUG
    "assertions off";
#else
    "assertions on";
#endif

std::string Provenance() {
  const absl::string_view revision = build_stamp::kScmRevision;
  const absl::string_view status = build_stamp::kScmStatus;
  const bool has_revision = !revision.empty() && revision != "0";
  const bool has_time = build_stamp::kTimestamp > 0;
  if (!has_revision && !has_time) {
    return "revision unknown (unstamped build; bazel build --config=release "
           "stamps one)";
  }
  std::string text =
      has_revision ? absl::StrCat("revision ", revision) : "revision unknown";
  if (has_revision && (status == "clean" || status == "modified")) {
    absl::StrAppend(&text, " (", status, ")");
  }
  if (has_time) {
    absl::StrAppend(
        &text, ", built ",
        absl::FormatTime("%Y-%m-%d %H:%M:%S UTC",
                         absl::FromUnixSeconds(build_stamp::kTimestamp),
                         absl::UTCTimeZone()));
  }
  return text;
}

}  // namespace

std::string BuildRevision() {
  const absl::string_view revision = build_stamp::kScmRevision;
  return revision.empty() || revision == "0" ? "unknown"
                                             : std::string(revision);
}

std::string VersionText() {
  return absl::StrCat("rdma-agentd ", kAgentVersion, "\nbuilt by ", kCompiler,
                      ", -c ", kCompilationMode, " (", kCodeGeneration, ")\n",
                      Provenance(), "\n");
}

}  // namespace rdma_agent
