/* A C program over librdma_agent_attach (client/c/rdma_agent_attach.h),
 * driven by python_attach_library_test.py against a real rdma-agentd:
 *
 *   attach_library_c attach AGENT_SOCKET SIZE      -> "token T size N"
 *       a sealed memfd filled with byte i = i * 7 % 251, handed over
 *   attach_library_c open AGENT_SOCKET BUFFER_ID   -> "size N head HEX"
 *       maps the registration, prints its first 8 bytes, writes 0xab at 0
 *   attach_library_c errors AGENT_SOCKET           -> "NAME CODE" lines
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "client/c/rdma_agent_attach.h"

static int fail(const char* what, const rdma_agent_attach_result* result) {
  printf("error %s %d %s\n", what, result->code, result->message);
  return 1;
}

static int attach(const char* agent_socket, unsigned long long size) {
  char path[108];
  rdma_agent_attach_result result;
  if (rdma_agent_attach_socket_path(agent_socket, path, sizeof(path), &result))
    return fail("path", &result);
  if (rdma_agent_memfd_create("c-test", size, &result))
    return fail("memfd", &result);
  int fd = result.fd;
  unsigned char* memory =
      mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (memory == MAP_FAILED) return 1;
  for (unsigned long long i = 0; i < size; ++i) memory[i] = i * 7 % 251;
  int code = rdma_agent_attach_memfd(path, fd, 5000, &result);
  close(fd); /* the agent keeps its own reference */
  if (code) return fail("attach", &result);
  printf("token %s size %llu\n", result.token,
         (unsigned long long)result.size_bytes);
  return 0;
}

static int open_buffer(const char* agent_socket, const char* id) {
  char path[108];
  rdma_agent_attach_result result;
  if (rdma_agent_attach_socket_path(agent_socket, path, sizeof(path), &result))
    return fail("path", &result);
  if (rdma_agent_open_buffer(path, strtoull(id, NULL, 10), 5000, &result))
    return fail("open", &result);
  unsigned char* memory = mmap(NULL, result.size_bytes, PROT_READ | PROT_WRITE,
                               MAP_SHARED, result.fd, 0);
  close(result.fd);
  if (memory == MAP_FAILED) return 1;
  printf("size %llu head ", (unsigned long long)result.size_bytes);
  for (int i = 0; i < 8; ++i) printf("%02x", memory[i]);
  printf("\n");
  memory[0] = 0xab; /* seen by the agent: the same pages */
  return 0;
}

static int errors(const char* agent_socket) {
  char path[108];
  char tiny[4];
  rdma_agent_attach_result result;
  printf("abi %u\n", rdma_agent_attach_abi_version());
  printf("path_too_small %d\n", rdma_agent_attach_socket_path(
                                    agent_socket, tiny, sizeof(tiny), &result));
  rdma_agent_attach_socket_path(agent_socket, path, sizeof(path), &result);
  printf("memfd_zero %d\n", rdma_agent_memfd_create("zero", 0, &result));
  printf("missing_socket %d\n",
         rdma_agent_attach_memfd("/nonexistent/attach.sock", 0, 1000, &result));
  int unsealed = memfd_create("unsealed", MFD_CLOEXEC);
  if (ftruncate(unsealed, 4096) != 0) return 1;
  printf("unsealed %d\n",
         rdma_agent_attach_memfd(path, unsealed, 5000, &result));
  printf("dmabuf_past_end %d\n",
         rdma_agent_attach_dmabuf(path, unsealed, 4096, 4096,
                                  RDMA_AGENT_MEMORY_KIND_CUDA, 0, NULL, 5000,
                                  &result));
  printf("dmabuf_host_kind %d\n",
         rdma_agent_attach_dmabuf(path, unsealed, 0, 4096, 0, 0, NULL, 5000,
                                  &result));
  close(unsealed);
  printf("open_unknown %d\n",
         rdma_agent_open_buffer(path, 999999, 5000, &result));
  printf("null_result %d\n", rdma_agent_attach_memfd(path, 0, 5000, NULL));
  return 0;
}

int main(int argc, char** argv) {
  if (argc >= 4 && strcmp(argv[1], "attach") == 0)
    return attach(argv[2], strtoull(argv[3], NULL, 10));
  if (argc >= 4 && strcmp(argv[1], "open") == 0)
    return open_buffer(argv[2], argv[3]);
  if (argc >= 3 && strcmp(argv[1], "errors") == 0) return errors(argv[2]);
  fprintf(stderr, "usage: %s attach|open|errors AGENT_SOCKET [ARG]\n", argv[0]);
  return 2;
}
