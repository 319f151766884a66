// Fuzz target: Peer requests from another host (or anyone who can reach the
// Peer port), parsed as gRPC would and handed to the ibverbs backend's
// responder on the software NIC: ConnectQueuePair (IbverbsBackend::
// AcceptQueuePair: proof of a registration, epoch and device checks, endpoint
// validation, PD/QP creation, the move to RTR/RTS, the first grant) and then
// GrantBuffer on the session it opened.
//
// Input: byte 0 = flags; bit 0 puts the responder's real epoch, bit 1 its
// real device name and bit 2 a real proof (buffer id and token) into the
// request, so that mutations reach past those checks; bit 3 also asks
// GrantBuffer for the request's buffer on the last session opened. The rest =
// the serialized ConnectQueuePairRequest.
//
// Oracle: no crash or undefined behaviour; every refusal is one of the codes
// the Peer service documents; only a request with a valid proof, epoch and
// device gets a session, and it answers with a usable responder side and a
// grant of exactly the proven buffer; the number of sessions stays within
// the configured bound; GrantBuffer grants only what was proven.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/soft/soft_verbs.h"
#include "backends/testing/harness.h"
#include "backends/testing/ibverbs_agent.h"
#include "google/protobuf/stubs/logging.h"
#include "rdma/agent/v1/peer.pb.h"
#include "spdlog/spdlog.h"
#include "tests/fuzz/fuzz_check.h"

namespace rdma_agent {
namespace {

constexpr char kDevice[] = "nic_fuzz";  // as in make_seed_corpus.py
constexpr size_t kMaxResponders = 4;
constexpr uint64_t kBufferSize = 4096;

struct Fixture {
  verbs::SoftFabric fabric;
  std::unique_ptr<testing::TestAgent> node;
  testing::TestBuffer buffer;
  // The session handle of the last accepted handshake.
  std::string session;
};

Fixture& TheFixture() {
  static Fixture* fixture = [] {
    auto* f = new Fixture;
    verbs::SoftDeviceConfig config;
    config.name = kDevice;
    FUZZ_CHECK(f->fabric.AddDevice(config).ok());
    ibverbs::IbverbsOptions options;
    // Few sessions: every accepted request beyond them must be refused or
    // replace one, never pile up.
    options.max_responders = kMaxResponders;
    options.max_grants_per_peer = 8;
    options.drain_timeout = absl::Milliseconds(100);
    f->node =
        testing::SoftIbverbsAgent(f->fabric, "agent-fuzz", kDevice, options);
    FUZZ_CHECK(f->node != nullptr);
    FUZZ_CHECK(f->node->backend<ibverbs::IbverbsBackend>().available());
    f->buffer = f->node->Register(kBufferSize, v1::ACCESS_READ_WRITE, 7);
    return f;
  }();
  return *fixture;
}

bool IsDocumentedCode(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kPermissionDenied:
      return true;
    default:
      return false;
  }
}

bool ProvesTheBuffer(const Fixture& fixture, uint64_t buffer_id,
                     const std::string& token) {
  return buffer_id == fixture.buffer.registration->id() &&
         token == fixture.buffer.registration->token();
}

void CheckGrant(const Fixture& fixture, const v1::BufferGrant& grant) {
  FUZZ_CHECK(grant.buffer_id() == fixture.buffer.registration->id());
  FUZZ_CHECK(grant.size_bytes() == kBufferSize);
  FUZZ_CHECK(grant.address() ==
             reinterpret_cast<uint64_t>(fixture.buffer.registration->data()));
}

void FuzzOne(const uint8_t* data, size_t size) {
  if (size < 1) return;
  Fixture& fixture = TheFixture();
  v1::ConnectQueuePairRequest request;
  if (!request.ParseFromArray(data + 1, static_cast<int>(size - 1))) return;
  const uint64_t epoch = fixture.node->identity().epoch;
  if (data[0] & 1) request.set_expected_epoch(epoch);
  if (data[0] & 2) request.set_remote_device(kDevice);
  if (data[0] & 4) {
    request.set_buffer_id(fixture.buffer.registration->id());
    request.set_token(fixture.buffer.registration->token());
  }

  ibverbs::IbverbsBackend& backend =
      fixture.node->backend<ibverbs::IbverbsBackend>();
  auto answer = backend.AcceptQueuePair(request);
  FUZZ_CHECK(backend.responder_count() <= kMaxResponders);
  if (!answer.ok()) {
    FUZZ_CHECK(IsDocumentedCode(answer.status().code()));
    FUZZ_CHECK(!answer.status().message().empty());
  } else {
    // Only a request that passed every check gets a session.
    FUZZ_CHECK(ProvesTheBuffer(fixture, request.buffer_id(), request.token()));
    FUZZ_CHECK(request.expected_epoch() == epoch);
    FUZZ_CHECK(request.remote_device() == kDevice);
    const v1::QueuePairEndpoint& responder = answer->responder();
    FUZZ_CHECK(responder.device() == kDevice);
    FUZZ_CHECK(responder.qp_num() != 0);
    FUZZ_CHECK(responder.gid().size() == 16);
    FUZZ_CHECK(responder.mtu_bytes() >= 256 && responder.mtu_bytes() <= 4096);
    FUZZ_CHECK(answer->session().size() == 16);
    CheckGrant(fixture, answer->grant());
    fixture.session = answer->session();
  }

  if ((data[0] & 8) && !fixture.session.empty()) {
    v1::GrantBufferRequest grant;
    grant.set_agent_id(request.agent_id());
    grant.set_expected_epoch(request.expected_epoch());
    grant.set_session(fixture.session);
    grant.set_buffer_id(request.buffer_id());
    grant.set_token(request.token());
    auto granted = backend.GrantBuffer(grant);
    if (!granted.ok()) {
      FUZZ_CHECK(IsDocumentedCode(granted.status().code()));
    } else {
      FUZZ_CHECK(ProvesTheBuffer(fixture, grant.buffer_id(), grant.token()));
      FUZZ_CHECK(grant.expected_epoch() == epoch);
      CheckGrant(fixture, granted->grant());
    }
  }
}

}  // namespace
}  // namespace rdma_agent

// Invalid UTF-8 in a string field makes libprotobuf log an error line per
// parse, and each accepted handshake logs an info line; millions of them
// would only slow fuzzing down.
extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  google::protobuf::SetLogHandler(nullptr);
  spdlog::set_level(spdlog::level::warn);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  rdma_agent::FuzzOne(data, size);
  return 0;
}
