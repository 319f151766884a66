#include "backends/ibverbs/profiles.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace rdma_agent::ibverbs {
namespace {

constexpr uint32_t kMellanoxVendorId = 0x02c9;
constexpr uint32_t kAmazonVendorId = 0x1d0f;

DeviceProfile Generic() {
  DeviceProfile profile;
  profile.name = "generic";
  // Conservative: works on soft-RoCE (rxe) and iWARP-less RoCE NICs alike.
  profile.defaults.mtu_bytes = 1024;
  profile.defaults.timeout = 14;  // ~67 ms per try
  profile.defaults.retry_cnt = 7;
  profile.defaults.rnr_retry = 7;
  profile.defaults.max_rd_atomic = 16;
  profile.defaults.sq_depth = 256;
  profile.defaults.max_message_bytes = 1ull << 30;
  return profile;
}

DeviceProfile Mlx5() {
  DeviceProfile profile;
  profile.name = "mlx5";
  profile.defaults.mtu_bytes = 4096;
  profile.defaults.timeout = 14;
  profile.defaults.retry_cnt = 7;
  profile.defaults.rnr_retry = 7;
  profile.defaults.max_rd_atomic = 16;
  // ConnectX queues are deep and cheap; more WRs in flight per QP keep a
  // 100-400 Gb/s link busy.
  profile.defaults.sq_depth = 1024;
  // Smaller WRs interleave better across QPs and bound a single WR's
  // retransmission cost.
  profile.defaults.max_message_bytes = 8ull << 20;
  profile.defaults.gid_index = 3;  // RoCEv2 IPv4-mapped GID on most setups
  return profile;
}

DeviceProfile Efa() {
  DeviceProfile profile;
  profile.name = "efa";
  profile.defaults = Generic().defaults;
  profile.defaults.mtu_bytes = 4096;
  profile.defaults.max_message_bytes = 1ull << 30;
  profile.unsupported_reason =
      "EFA devices have no RC queue pairs (they use SRD through efadv), which "
      "this backend does not implement";
  return profile;
}

}  // namespace

absl::StatusOr<DeviceProfile> ProfileByName(absl::string_view name) {
  if (name == "generic") return Generic();
  if (name == "mlx5") return Mlx5();
  if (name == "efa") return Efa();
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown device profile \"", name, "\" (generic, mlx5, efa)"));
}

DeviceProfile DetectProfile(const std::string& device_name,
                            const ibv_device_attr& attr) {
  if (absl::StartsWith(device_name, "efa") ||
      attr.vendor_id == kAmazonVendorId) {
    return Efa();
  }
  if (absl::StartsWith(device_name, "mlx5") ||
      attr.vendor_id == kMellanoxVendorId) {
    return Mlx5();
  }
  return Generic();
}

QueuePairParams ResolveParams(const QueuePairParams& defaults,
                              const QueuePairOverrides& o,
                              const ibv_device_attr& device,
                              const ibv_port_attr& port) {
  QueuePairParams p = defaults;
  if (o.mtu_bytes) p.mtu_bytes = *o.mtu_bytes;
  if (o.timeout) p.timeout = *o.timeout;
  if (o.retry_cnt) p.retry_cnt = *o.retry_cnt;
  if (o.rnr_retry) p.rnr_retry = *o.rnr_retry;
  if (o.max_rd_atomic) p.max_rd_atomic = *o.max_rd_atomic;
  if (o.sq_depth) p.sq_depth = *o.sq_depth;
  if (o.max_message_bytes) p.max_message_bytes = *o.max_message_bytes;
  if (o.gid_index) p.gid_index = *o.gid_index;
  if (o.service_level) p.service_level = *o.service_level;
  if (o.traffic_class) p.traffic_class = *o.traffic_class;

  // InfiniBand routes by LID; GID 0 always exists there.
  if (!o.gid_index && port.link_layer == IBV_LINK_LAYER_INFINIBAND) {
    p.gid_index = 0;
  }
  const uint32_t active = verbs::MtuBytes(port.active_mtu);
  if (active != 0) p.mtu_bytes = std::min(p.mtu_bytes, active);
  p.retry_cnt = std::min<uint8_t>(p.retry_cnt, 7);
  p.rnr_retry = std::min<uint8_t>(p.rnr_retry, 7);
  p.timeout = std::min<uint8_t>(p.timeout, 31);
  // The same value is our initiator depth and, through the handshake, the
  // peer's responder depth: both device limits apply.
  if (device.max_qp_rd_atom > 0) {
    p.max_rd_atomic = std::min<int>(p.max_rd_atomic, device.max_qp_rd_atom);
  }
  if (device.max_qp_init_rd_atom > 0) {
    p.max_rd_atomic =
        std::min<int>(p.max_rd_atomic, device.max_qp_init_rd_atom);
  }
  if (device.max_qp_wr > 0) {
    p.sq_depth = std::min<uint32_t>(p.sq_depth, device.max_qp_wr);
  }
  p.sq_depth = std::max<uint32_t>(p.sq_depth, 1);
  if (port.max_msg_sz > 0) {
    p.max_message_bytes =
        std::min<uint64_t>(p.max_message_bytes, port.max_msg_sz);
  }
  // An ibv_sge length is 32 bits; real ports report at most 2 GiB anyway.
  p.max_message_bytes =
      std::clamp<uint64_t>(p.max_message_bytes, 1, uint64_t{1} << 31);
  return p;
}

}  // namespace rdma_agent::ibverbs
