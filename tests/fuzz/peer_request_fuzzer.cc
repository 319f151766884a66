// Fuzz target: a Peer ConnectQueuePair request from another host (or anyone
// who can reach the Peer port), parsed as gRPC would and handed to the
// ibverbs backend's responder (IbverbsBackend::AcceptQueuePair, what the Peer
// service calls) on the software NIC: epoch and device checks, endpoint
// validation, QP creation and the move to RTR/RTS.
//
// Input: byte 0 = flags; bit 0 puts the responder's real epoch and bit 1 its
// real device name into the request, so that mutations reach past those
// checks; the rest = the serialized ConnectQueuePairRequest.
//
// Oracle: no crash or undefined behaviour; every refusal is one of the codes
// the Peer service documents (or RESOURCE_EXHAUSTED at the responder bound);
// an accepted handshake answers with a usable responder side; the number of
// responder QPs stays within the configured bound.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "backends/ibverbs/ibverbs_backend.h"
#include "backends/ibverbs/soft_verbs.h"
#include "backends/ibverbs/test_node.h"
#include "google/protobuf/stubs/logging.h"
#include "rdma/agent/v1/peer.pb.h"
#include "tests/fuzz/fuzz_check.h"

namespace rdma_agent {
namespace {

constexpr char kDevice[] = "nic_fuzz";
constexpr size_t kMaxResponders = 4;

struct Fixture {
  verbs::SoftFabric fabric;
  std::unique_ptr<testing::TestNode> node;
};

Fixture& TheFixture() {
  static Fixture* fixture = [] {
    auto* f = new Fixture;
    verbs::SoftDeviceConfig config;
    config.name = kDevice;
    FUZZ_CHECK(f->fabric.AddDevice(config).ok());
    IbverbsOptions options;
    // Few QPs: every accepted request beyond them must be refused or
    // replace one, never pile up.
    options.max_responders = kMaxResponders;
    options.drain_timeout = absl::Milliseconds(100);
    f->node =
        testing::TestNode::Create(f->fabric, "agent-fuzz", kDevice, options);
    FUZZ_CHECK(f->node != nullptr);
    FUZZ_CHECK(f->node->backend().available());
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
      return true;
    default:
      return false;
  }
}

void FuzzOne(const uint8_t* data, size_t size) {
  if (size < 1) return;
  Fixture& fixture = TheFixture();
  v1::ConnectQueuePairRequest request;
  if (!request.ParseFromArray(data + 1, static_cast<int>(size - 1))) return;
  if (data[0] & 1) {
    request.set_expected_epoch(fixture.node->identity().epoch);
  }
  if (data[0] & 2) request.set_remote_device(kDevice);

  IbverbsBackend& backend = fixture.node->backend();
  auto answer = backend.AcceptQueuePair(request);
  FUZZ_CHECK(backend.responder_count() <= kMaxResponders);
  if (!answer.ok()) {
    FUZZ_CHECK(IsDocumentedCode(answer.status().code()));
    FUZZ_CHECK(!answer.status().message().empty());
    return;
  }
  // Only a request that passed every check gets a QP.
  FUZZ_CHECK(request.expected_epoch() == fixture.node->identity().epoch);
  FUZZ_CHECK(request.remote_device() == kDevice);
  const v1::QueuePairEndpoint& responder = answer->responder();
  FUZZ_CHECK(responder.device() == kDevice);
  FUZZ_CHECK(responder.qp_num() != 0);
  FUZZ_CHECK(responder.gid().size() == 16);
  FUZZ_CHECK(responder.mtu_bytes() >= 256 && responder.mtu_bytes() <= 4096);
}

}  // namespace
}  // namespace rdma_agent

// Invalid UTF-8 in a string field makes libprotobuf log an error line per
// parse; millions of them would only slow fuzzing down.
extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  rdma_agent::FuzzOne(data, size);
  return 0;
}
