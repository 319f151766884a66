#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/).

Seeds are well-formed inputs of each kind, so that mutations start from deep
paths instead of rediscovering the framing. Run from the repository root
after changing a format; inputs that found bugs are added by hand as
crash-<what>.
Protos are encoded with `protoc --encode`, frames with struct.
"""
import os
import struct
import subprocess

ROOT = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.join(ROOT, "..", "..", "proto")


def encode(message, proto, text):
    return subprocess.run(
        ["protoc", "-I", PROTO_ROOT, "--encode=rdma.agent.v1." + message,
         os.path.join(PROTO_ROOT, "rdma/agent/v1", proto)],
        input=text.encode(), stdout=subprocess.PIPE, check=True).stdout


def write(target, name, data):
    directory = os.path.join(ROOT, "corpus", target)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)


# --- remote_context_fuzzer --------------------------------------------------
CONTEXT = '''agent_id: "agent-a" agent_epoch: 12345 buffer_id: 7 size_bytes: 4096
access: ACCESS_READ_WRITE token: "0123456789abcdef" '''
write("remote_context_fuzzer", "memory",
      encode("RemoteBuffer", "remote_buffer.proto",
             CONTEXT + 'endpoints { backend: "memory" memory {} }'))
write("remote_context_fuzzer", "tcp_ipv4",
      encode("RemoteBuffer", "remote_buffer.proto",
             CONTEXT + 'endpoints { backend: "tcp" tcp { host: "10.0.0.2" port: 7000 } }'))
write("remote_context_fuzzer", "tcp_ipv6",
      encode("RemoteBuffer", "remote_buffer.proto",
             CONTEXT + 'endpoints { backend: "tcp" tcp { host: "fe80::1" port: 65535 } }'))
write("remote_context_fuzzer", "all_backends",
      encode("RemoteBuffer", "remote_buffer.proto",
             CONTEXT + '''endpoints { backend: "memory" memory {} }
endpoints { backend: "ibverbs" ibverbs { device: "mlx5_0" port: 1 lid: 0
  gid: "\\000\\000\\000\\000\\000\\000\\000\\000\\000\\000\\377\\377\\n\\000\\000\\002"
  rkey: 4660 address: 140737488355328 peer_address: "10.0.0.2:7001"
  max_message_bytes: 1073741824 } }
endpoints { backend: "tcp" tcp { host: "host-b.example" port: 7000 } }'''))
write("remote_context_fuzzer", "incomplete",
      encode("RemoteBuffer", "remote_buffer.proto",
             'agent_id: "agent-a" buffer_id: 7 size_bytes: 4096'))

# --- tcp wire ----------------------------------------------------------------
REQUEST_MAGIC, RESPONSE_MAGIC, HELLO_MAGIC = 0x52415443, 0x52415452, 0x52415448
READ, WRITE, NOTIFY = 1, 2, 3


def request(kind, request_id, epoch, buffer_id, offset, length, token,
            payload=b""):
    return struct.pack("<IHHQQQQQII", REQUEST_MAGIC, 1, kind, request_id,
                       epoch, buffer_id, offset, length, len(token),
                       0) + token + payload


def response(request_id, code, message, payload=b""):
    return struct.pack("<IHHQIIQ", RESPONSE_MAGIC, 1, 0, request_id, code,
                       len(message), len(payload)) + message + payload


HELLO = struct.pack("<IHHQ", HELLO_MAGIC, 1, 0, 0)
write("tcp_wire_fuzzer", "request_read", request(READ, 1, 77, 5, 0, 4096, b""))
write("tcp_wire_fuzzer", "request_write",
      request(WRITE, 2, 77, 6, 100, 64, b"")[:56])
write("tcp_wire_fuzzer", "response_ok", response(1, 0, b""))
write("tcp_wire_fuzzer", "response_error", response(3, 7, b"")[:32])
write("tcp_wire_fuzzer", "hello", HELLO)

# --- tcp_data_server_fuzzer (constants as in tcp_data_server_fuzzer.cc) -----
EPOCH, RO, RW = 77, 5, 6
TOKEN = b"fuzz-token-0123456789"
T = "tcp_data_server_fuzzer"
write(T, "read_ro", request(READ, 1, EPOCH, RO, 100, 200, TOKEN))
write(T, "read_rw_whole", request(READ, 1, EPOCH, RW, 0, 4096, TOKEN))
write(T, "write_rw", request(WRITE, 2, EPOCH, RW, 4000, 96, TOKEN, b"W" * 96))
write(T, "write_ro_refused",
      request(WRITE, 3, EPOCH, RO, 0, 64, TOKEN, b"X" * 64))
write(T, "pipelined",
      request(READ, 4, EPOCH, RO, 0, 16, TOKEN) +
      request(WRITE, 5, EPOCH, RW, 0, 16, TOKEN, b"P" * 16) +
      request(READ, 6, EPOCH, RW, 0, 16, TOKEN))
write(T, "stale_epoch", request(READ, 7, EPOCH + 1, RO, 0, 16, TOKEN))
write(T, "wrong_token", request(READ, 8, EPOCH, RO, 0, 16, b"guess"))
write(T, "out_of_bounds", request(WRITE, 9, EPOCH, RW, 4090, 16, TOKEN,
                                  b"O" * 16))
write(T, "unknown_buffer", request(READ, 10, EPOCH, 99, 0, 16, TOKEN))


def notification(sender, data):
    return struct.pack("<H", len(sender)) + sender + data


NOTE = notification(b"agent-a", b"ready")
write(T, "notify", request(NOTIFY, 11, EPOCH, RW, 0, len(NOTE), TOKEN, NOTE))
write(T, "notify_wrong_token",
      request(NOTIFY, 12, EPOCH, RO, 0, len(NOTE), b"guess", NOTE))
write(T, "notify_bad_sender_length",
      request(NOTIFY, 13, EPOCH, RW, 0, 4, TOKEN, b"\xff\x00ab"))
# A READ-only context's holder may not notify (PERMISSION_DENIED, payload
# dropped unread); the connection goes on.
write(T, "notify_then_read",
      request(NOTIFY, 14, EPOCH, RO, 0, len(NOTE), TOKEN, NOTE) +
      request(READ, 15, EPOCH, RO, 0, 16, TOKEN))
write(T, "notify_empty", request(NOTIFY, 16, EPOCH, RW, 0, 0, TOKEN))
write(T, "notify_pipelined",
      request(NOTIFY, 17, EPOCH, RW, 0, len(NOTE), TOKEN, NOTE) +
      request(NOTIFY, 18, EPOCH, RW, 0, len(NOTE), TOKEN, NOTE) +
      request(READ, 19, EPOCH, RW, 0, 16, TOKEN))
# Strangers: no token, announcing 1 MiB (refused on the header, the
# connection ends) or a small payload (refused, dropped unread), then a
# valid request.
write(T, "notify_tokenless_huge",
      request(NOTIFY, 20, EPOCH, RW, 0, 1 << 20, b"", b"N" * 4096))
write(T, "notify_tokenless_small_then_read",
      request(NOTIFY, 21, EPOCH, RW, 0, len(NOTE), b"", NOTE) +
      request(READ, 22, EPOCH, RW, 0, 16, TOKEN))
write(T, "notify_stale_epoch",
      request(NOTIFY, 23, EPOCH + 1, RW, 0, len(NOTE), TOKEN, NOTE))
# A token holder announcing more than the agent takes: INVALID_ARGUMENT,
# dropped unread; the connection goes on.
BIG = notification(b"agent-a", b"B" * 8192)
write(T, "notify_oversized_then_read",
      request(NOTIFY, 24, EPOCH, RW, 0, len(BIG), TOKEN, BIG) +
      request(READ, 25, EPOCH, RW, 0, 16, TOKEN))

# --- attach_frame_fuzzer -------------------------------------------------------


def frame(body):
    return struct.pack("<I", len(body)) + body


ATTACH = encode("AttachRequest", "attach.proto", "attach {}")
OPEN = encode("AttachRequest", "attach.proto", "open { buffer_id: 3 }")
DEVICE = encode("AttachRequest", "attach.proto",
                "attach_device_memory { offset: 512 length: 4096 "
                "kind: MEMORY_KIND_CUDA device_index: 1 }")
A = "attach_frame_fuzzer"
write(A, "attach_with_fd", bytes([1, 0]) + frame(ATTACH))
write(A, "attach_without_fd", bytes([0, 0]) + frame(ATTACH))
write(A, "open_buffer", bytes([0, 0]) + frame(OPEN))
write(A, "attach_device_memory_with_fd", bytes([1, 0]) + frame(DEVICE))
write(A, "two_messages_fds_split", bytes([1 | (2 << 3), 3]) +
      frame(ATTACH) + frame(OPEN))
write(A, "many_fds", bytes([7 | (7 << 3), 1]) + frame(ATTACH))
write(A, "oversized_length", bytes([1, 0]) + struct.pack("<I", 1 << 20))
write(A, "truncated_body", bytes([0, 0]) + struct.pack("<I", 50) + OPEN)

# --- peer_request_fuzzer (device as in peer_request_fuzzer.cc) --------------
PEER = '''agent_id: "agent-b" agent_epoch: 99 expected_epoch: 1
remote_device: "nic_fuzz"
requester { device: "nic_b" port: 1 lid: 0
  gid: "\\000\\000\\000\\000\\000\\000\\000\\000\\000\\000\\377\\377\\n\\000\\000\\002"
  gid_index: 0 qp_num: 17 psn: 4660 mtu_bytes: 4096 max_rd_atomic: 16 }'''
P = "peer_request_fuzzer"
# Flags: 1 real epoch, 2 real device, 4 real proof, 8 then GrantBuffer.
write(P, "valid", bytes([7]) + encode("ConnectQueuePairRequest", "peer.proto",
                                      PEER))
write(P, "valid_then_grant", bytes([15]) + encode(
    "ConnectQueuePairRequest", "peer.proto", PEER))
write(P, "small_mtu", bytes([7]) + encode(
    "ConnectQueuePairRequest", "peer.proto",
    PEER.replace("mtu_bytes: 4096", "mtu_bytes: 256")))
write(P, "stale_epoch", bytes([6]) + encode("ConnectQueuePairRequest",
                                            "peer.proto", PEER))
write(P, "no_proof", bytes([3]) + encode("ConnectQueuePairRequest",
                                         "peer.proto", PEER))
write(P, "other_agent", bytes([15]) + encode(
    "ConnectQueuePairRequest", "peer.proto",
    PEER.replace('agent_id: "agent-b"', 'agent_id: "agent-c"')))

# --- metrics_http_fuzzer: whole requests as a stranger's connection sends them
H = "metrics_http_fuzzer"
write(H, "scrape", b"GET /metrics HTTP/1.1\r\nHost: 10.0.0.5:9464\r\n"
      b"User-Agent: Prometheus/2.42.0\r\nAccept: text/plain;version=0.0.4\r\n"
      b"Accept-Encoding: gzip\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n")
write(H, "probe", b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:9464\r\n"
      b"User-Agent: kube-probe/1.27\r\nConnection: close\r\n\r\n")
write(H, "head_http10_lf", b"\r\nHEAD /healthz?x=1 HTTP/1.0\n\n")
write(H, "post_with_body", b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n"
      b"\r\nabc")
write(H, "not_found", b"GET /metrics/../etc HTTP/1.1\r\n\r\n")
write(H, "half_sent", b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-")
write(H, "tls_hello", bytes([0x16, 0x03, 0x01, 0x00, 0xa5, 0x01, 0x00]))
write(H, "too_large", b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 8300 + b"\r\n\r\n")


# --- ring_entry_fuzzer ------------------------------------------------------
# Protocol version 2: six header words (the last: the largest notification),
# the submission slots, then the payload area (256 bytes per slot).
def ring_input(exponent, head, tail, cq_head, cq_tail, slots, max_note=64,
               payloads=b""):
    entries = 1 << (exponent % 5)
    slot_bytes = b"".join(slots).ljust(64 * entries, b"\0")
    return (struct.pack("<6I", exponent, head, tail, cq_head, cq_tail,
                        max_note) + slot_bytes + payloads)


def submission(opcode, flags, tag, end=False, length=8, handle=7, local=1,
               note=0):
    return struct.pack("<BBHIQQQQQQQ", opcode, flags | (1 if end else 0), 0, 0,
                       tag, local, 0, length, handle, 0, note)


write("ring_entry_fuzzer", "one_op",
      ring_input(3, 0, 1, 0, 0, [submission(1, 0, 1, end=True)]))
write("ring_entry_fuzzer", "batch_of_three",
      ring_input(3, 6, 9, 4, 4, [submission(2, 0, 1), submission(1, 0, 2),
                                 submission(1, 0, 3, end=True)]))
write("ring_entry_fuzzer", "wrapping",
      ring_input(2, 0xfffffffe, 2, 0xfffffffc, 0xfffffffe,
                 [submission(1, 0, i, end=(i == 3)) for i in range(4)]))
write("ring_entry_fuzzer", "lying_tail",
      ring_input(2, 0, 100, 0, 0, [submission(1, 0, 1, end=True)]))
write("ring_entry_fuzzer", "bad_fields",
      ring_input(3, 0, 2, 0, 0, [submission(9, 0x80, 1),
                                 submission(1, 0, 2, end=True, length=0,
                                            handle=0)]))
write("ring_entry_fuzzer", "notify",
      ring_input(1, 0, 1, 0, 0,
                 [submission(2, 2, 1, end=True, note=(5 << 32) | 16)],
                 payloads=b"\0" * 16 + b"hello"))
write("ring_entry_fuzzer", "run_prepared",
      ring_input(1, 0, 1, 0, 0,
                 [submission(3, 0, 1, end=True, length=0, handle=9, local=0)]))
write("ring_entry_fuzzer", "cancel_in_a_batch",
      ring_input(2, 0, 2, 0, 0,
                 [submission(1, 0, 1),
                  submission(4, 0, 2, end=True, length=0, handle=1,
                             local=0)]))
