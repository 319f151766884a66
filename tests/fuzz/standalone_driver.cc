// main() for fuzz targets built without libFuzzer (g++, `bazel test //...`):
// replays every file of the seed corpus directories given as arguments, then
// a bounded number of deterministic mutations of them, through
// LLVMFuzzerTestOneInput. A broken oracle aborts, so the test fails.
//
//   <target> [--mutations=N] [--seed=S] <corpus dir or file>...
//
// Under --config=fuzz the targets link libFuzzer's main instead.
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_driver.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv)
    __attribute__((weak));

namespace {

bool IsDirectory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Files of `path` (itself if a file), sorted so the replay is repeatable.
std::vector<std::string> ListInputs(const std::string& path) {
  if (!IsDirectory(path)) return {path};
  std::vector<std::string> files;
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) return files;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    const std::string child = path + "/" + entry->d_name;
    if (!IsDirectory(child)) files.push_back(child);
  }
  ::closedir(dir);
  std::sort(files.begin(), files.end());
  return files;
}

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream buffer;
  buffer << in.rdbuf();
  *out = buffer.str();
  return true;
}

void Run(const std::string& input) {
  // A copy of exactly the input's size, so that reads past its end are
  // caught by ASan builds of the driver too.
  std::vector<uint8_t> copy(input.begin(), input.end());
  LLVMFuzzerTestOneInput(copy.data(), copy.size());
}

}  // namespace

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  long mutations = 1000;
  uint32_t seed = 1;
  std::vector<std::string> paths;
  for (int i = 1; i < argc; ++i) {
    const char* arg = argv[i];
    if (std::strncmp(arg, "--mutations=", 12) == 0) {
      mutations = std::strtol(arg + 12, nullptr, 10);
    } else if (std::strncmp(arg, "--seed=", 7) == 0) {
      seed = static_cast<uint32_t>(std::strtoul(arg + 7, nullptr, 10));
    } else {
      paths.push_back(arg);
    }
  }

  std::vector<std::string> corpus;
  for (const std::string& path : paths) {
    for (const std::string& file : ListInputs(path)) {
      std::string bytes;
      if (!ReadFile(file, &bytes)) {
        std::fprintf(stderr, "cannot read %s\n", file.c_str());
        return 2;
      }
      corpus.push_back(std::move(bytes));
    }
  }
  // A seed corpus that went missing would turn the test into a no-op.
  if (corpus.empty()) {
    std::fprintf(stderr, "no seed inputs found in the given paths\n");
    return 2;
  }

  const auto start = std::chrono::steady_clock::now();
  for (const std::string& input : corpus) Run(input);
  rdma_agent::testing::Mutator mutator(seed);
  for (long i = 0; i < mutations; ++i) {
    std::string input = mutator.Mutate(corpus[mutator.Next() % corpus.size()]);
    // Sometimes two inputs back to back, as a stream would carry them.
    if (mutator.Next() % 8 == 0) {
      input += mutator.Mutate(corpus[mutator.Next() % corpus.size()]);
    }
    Run(input);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  std::printf("replayed %zu seed inputs and %ld mutations in %.2f s\n",
              corpus.size(), mutations, seconds);
  return 0;
}
