/* librdma_agent_attach: zero-copy memory for rdma-agentd from any language.
 *
 * The agent reaches a client's memory only through an fd handed over on its
 * attach socket (SCM_RIGHTS with a length-prefixed AttachRequest; docs/API.md,
 * "Memory"). This library speaks that protocol behind a C ABI that other
 * languages bind (ctypes, cgo, JNI, Rust FFI), so that only the control path
 * (Register, Submit, Release) needs gRPC:
 *
 *   int fd;
 *   rdma_agent_memfd_create("weights", size, &fd, &result);   // sealed memfd
 *   void* p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
 *   rdma_agent_attach_memfd("/run/rdma-agentd/attach.sock", fd, 5000, &result);
 *   close(fd);   // the agent keeps its own reference; the mapping stays
 *   // Register{attach_token = result.token} over gRPC: the memory at p is
 *   // the registration's, both ways, no copy.
 *
 * Every call returns a gRPC status code (0 = OK, the codes of docs/API.md)
 * and fills `result`: the code again, a message naming what went wrong,
 * and what the call produced. Calls are thread-safe, hold no state between
 * calls and never keep an fd they were given (the agent has its own copy).
 * The ABI only grows: rdma_agent_attach_abi_version() says which it is.
 */
#ifndef RDMA_AGENTD_CLIENT_C_RDMA_AGENT_ATTACH_H_
#define RDMA_AGENTD_CLIENT_C_RDMA_AGENT_ATTACH_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RDMA_AGENT_ATTACH_ABI_VERSION 1

/* Memory kinds of rdma_agent_attach_dmabuf (types.proto MemoryKind). */
#define RDMA_AGENT_MEMORY_KIND_CUDA 1
#define RDMA_AGENT_MEMORY_KIND_ROCM 2
#define RDMA_AGENT_MEMORY_KIND_OTHER 3

typedef struct rdma_agent_attach_result {
  int code;            /* gRPC status code; 0 = OK */
  char message[256];   /* why it failed (NUL-terminated, may be cut) */
  char token[128];     /* attach calls: the token for Register */
  uint64_t size_bytes; /* the memory's size in bytes */
  int fd;              /* open / memfd_create: an fd the caller owns; else -1 */
} rdma_agent_attach_result;

/* RDMA_AGENT_ATTACH_ABI_VERSION of the library loaded. */
uint32_t rdma_agent_attach_abi_version(void);

/* Writes into `path` (of `capacity` bytes) the attach socket that sits next
 * to the agent socket `agent_target` (a path or a "unix:" target; NULL:
 * $RDMA_AGENT_SOCKET, else /run/rdma-agentd/agent.sock). */
int rdma_agent_attach_socket_path(const char* agent_target, char* path,
                                  size_t capacity,
                                  rdma_agent_attach_result* result);

/* Creates a memfd of `size_bytes` (> 0) sealed against shrinking, as the
 * agent requires; result->fd is it. */
int rdma_agent_memfd_create(const char* name, uint64_t size_bytes,
                            rdma_agent_attach_result* result);

/* Hands `memfd` (sealed against shrinking) to the agent; result->token is
 * the single-use, short-lived token to pass to Register, result->size_bytes
 * the memory's size. `timeout_ms` bounds every wait on the socket. */
int rdma_agent_attach_memfd(const char* attach_socket, int memfd,
                            int timeout_ms, rdma_agent_attach_result* result);

/* Hands device memory exported as a dma-buf to the agent: the bytes
 * [offset, offset + length) of `dmabuf_fd`, of `memory_kind` on device
 * `device_index`; `pci_bus_id` (NULL or "") optional. Only NIC backends
 * register it. result->token as for rdma_agent_attach_memfd. */
int rdma_agent_attach_dmabuf(const char* attach_socket, int dmabuf_fd,
                             uint64_t offset, uint64_t length, int memory_kind,
                             uint32_t device_index, const char* pci_bus_id,
                             int timeout_ms, rdma_agent_attach_result* result);

/* Asks for an fd of the caller's registration `buffer_id` (e.g. one the
 * agent allocated) to map it; result->fd (the caller closes it) and
 * result->size_bytes. */
int rdma_agent_open_buffer(const char* attach_socket, uint64_t buffer_id,
                           int timeout_ms, rdma_agent_attach_result* result);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RDMA_AGENTD_CLIENT_C_RDMA_AGENT_ATTACH_H_ */
