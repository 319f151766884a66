#include "tests/fuzz/fuzz_driver.h"

namespace rdma_agent::testing {

std::string Mutator::Mutate(const std::string& input) {
  std::string out = input;
  const int rounds = 1 + static_cast<int>(Next() % 4);
  for (int r = 0; r < rounds; ++r) {
    const size_t size = out.size();
    const size_t at = size == 0 ? 0 : Next() % size;
    switch (Next() % 7) {
      case 0:
        if (size > 0)
          out[at] = static_cast<char>(out[at] ^ (1 << (Next() % 8)));
        break;
      case 1:
        if (size > 0) out[at] = static_cast<char>(Next());
        break;
      case 2:
        out.insert(at, 1, static_cast<char>(Next()));
        break;
      case 3:
        if (size > 0) out.erase(at, 1 + Next() % 8);
        break;
      case 4:
        out.resize(size == 0 ? 0 : Next() % size);
        break;
      case 5:
        if (size > 0)
          out.insert(at, out.substr(Next() % size, 1 + Next() % 16));
        break;
      default: {
        std::string fresh(Next() % 96, '\0');
        for (char& c : fresh) c = static_cast<char>(Next());
        out = fresh;
        break;
      }
    }
  }
  return out;
}

}  // namespace rdma_agent::testing
