#include "common/thread_name.h"

#include <pthread.h>

namespace rdma_agent {

void NameThread(std::thread& thread, absl::string_view name) {
  const std::string kept(name.substr(0, 15));
  pthread_setname_np(thread.native_handle(), kept.c_str());
}

std::string CurrentThreadName() {
  char name[16] = {};
  pthread_getname_np(pthread_self(), name, sizeof(name));
  return name;
}

}  // namespace rdma_agent
