#include "daemon/state_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/random.h"
#include "common/status_util.h"
#include "common/unique_fd.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {
namespace {

constexpr char kAgentIdFile[] = "agent-id";
// An id is one short line; anything longer is not ours.
constexpr size_t kMaxIdFileBytes = 4096;

// The first line of `path`, trimmed; empty when the file is missing or blank.
absl::StatusOr<std::string> ReadId(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) {
    if (errno == ENOENT) return std::string();
    return ErrnoStatus(absl::StatusCode::kInternal,
                       absl::StrCat("cannot read ", path), errno);
  }
  std::string text(kMaxIdFileBytes, '\0');
  ssize_t n;
  do {
    n = ::read(fd.get(), text.data(), text.size());
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    return ErrnoStatus(absl::StatusCode::kInternal,
                       absl::StrCat("cannot read ", path), errno);
  }
  text.resize(static_cast<size_t>(n));
  return std::string(
      absl::StripAsciiWhitespace(text.substr(0, text.find('\n'))));
}

absl::Status WriteAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(absl::StatusCode::kInternal, "write", errno);
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

// Writes `id` to <dir>/agent-id through a temporary file renamed over it, so
// that a crash or a full disk never leaves a torn id behind.
absl::Status WriteId(const std::string& dir, const std::string& id) {
  const std::string path = absl::StrCat(dir, "/", kAgentIdFile);
  const std::string temporary = path + ".new";
  UniqueFd fd(::open(temporary.c_str(),
                     O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd) {
    return ErrnoStatus(absl::StatusCode::kInternal,
                       absl::StrCat("cannot write ", temporary), errno);
  }
  absl::Status written = WriteAll(fd.get(), absl::StrCat(id, "\n"));
  if (written.ok() && ::fsync(fd.get()) != 0) {
    written = ErrnoStatus(absl::StatusCode::kInternal, "fsync", errno);
  }
  fd.reset();
  if (written.ok() && ::rename(temporary.c_str(), path.c_str()) != 0) {
    written = ErrnoStatus(absl::StatusCode::kInternal, "rename", errno);
  }
  if (!written.ok()) {
    ::unlink(temporary.c_str());
    return Prefixed(written, absl::StrCat("cannot write ", path));
  }
  // The rename itself must survive a power cut too.
  UniqueFd directory(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (directory) (void)::fsync(directory.get());
  return absl::OkStatus();
}

}  // namespace

absl::Status PrepareStateDir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return ErrnoStatus(absl::StatusCode::kFailedPrecondition,
                       absl::StrCat("cannot create ", dir), errno);
  }
  // With the effective ids, and EROFS on a read-only mount (systemd's
  // ProtectSystem= leaves only StateDirectory= writable).
  if (::faccessat(AT_FDCWD, dir.c_str(), W_OK | X_OK, AT_EACCESS) != 0) {
    return ErrnoStatus(absl::StatusCode::kFailedPrecondition,
                       absl::StrCat("cannot write ", dir), errno);
  }
  return absl::OkStatus();
}

bool IsSameDirectory(const std::string& a, const std::string& b) {
  struct stat sa, sb;
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 &&
         sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

absl::StatusOr<std::string> LoadOrCreateAgentId(const std::string& state_dir,
                                                const std::string& legacy_dir) {
  absl::StatusOr<std::string> id =
      ReadId(absl::StrCat(state_dir, "/", kAgentIdFile));
  if (!id.ok() || !id->empty()) return id;
  if (!legacy_dir.empty()) {
    const std::string legacy = absl::StrCat(legacy_dir, "/", kAgentIdFile);
    absl::StatusOr<std::string> kept = ReadId(legacy);
    if (kept.ok() && !kept->empty()) {
      absl::Status written = WriteId(state_dir, *kept);
      if (!written.ok()) return written;
      // Read once: from now on the state dir is the only copy.
      ::unlink(legacy.c_str());
      spdlog::info("agent id {} moved from {} to {}", *kept, legacy_dir,
                   state_dir);
      return kept;
    }
  }
  std::string created =
      absl::StrCat("agent-", absl::BytesToHexString(RandomBytes(8)));
  absl::Status written = WriteId(state_dir, created);
  if (!written.ok()) return written;
  return created;
}

}  // namespace rdma_agent
