#ifndef RDMA_AGENTD_COMMON_THREAD_NAME_H_
#define RDMA_AGENTD_COMMON_THREAD_NAME_H_

#include <string>
#include <thread>

#include "absl/strings/string_view.h"

namespace rdma_agent {

// Names `thread` (what top, /proc/PID/task/*/comm and the tests see) from
// the thread that started it, so that the name is there before anyone
// counts threads by name. Cut to the 15 bytes the kernel keeps.
void NameThread(std::thread& thread, absl::string_view name);

// The calling thread's name.
std::string CurrentThreadName();

}  // namespace rdma_agent

#endif  // RDMA_AGENTD_COMMON_THREAD_NAME_H_
