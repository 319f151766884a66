#ifndef RDMA_AGENTD_BACKENDS_IBVERBS_PROFILES_H_
#define RDMA_AGENTD_BACKENDS_IBVERBS_PROFILES_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "backends/ibverbs/verbs.h"

namespace rdma_agent::ibverbs {

// RC queue-pair attributes the backend uses (ibv_modify_qp / ibv_create_qp).
struct QueuePairParams {
  // Path MTU in bytes; the port's active MTU caps it.
  uint32_t mtu_bytes = 4096;
  // Local ACK timeout exponent: 4.096 us * 2^timeout per try (0 = infinite).
  uint8_t timeout = 14;
  // Transport retries before IBV_WC_RETRY_EXC_ERR (0-7).
  uint8_t retry_cnt = 7;
  // Receiver-not-ready retries (7 = infinite).
  uint8_t rnr_retry = 7;
  // Outstanding RDMA READs per QP, as initiator and as responder; the
  // device's max_qp_rd_atom and max_qp_init_rd_atom cap it.
  uint8_t max_rd_atomic = 16;
  // Send-queue depth (max_send_wr): WRs outstanding per QP.
  uint32_t sq_depth = 256;
  // Largest single WR in bytes; the port's max_msg_sz caps it.
  uint64_t max_message_bytes = 1ull << 30;
  // GID index for RoCE / global routing.
  int gid_index = 0;
  uint8_t service_level = 0;
  uint8_t traffic_class = 0;
};

// Per-flag overrides of a profile's defaults; unset = the profile's value.
struct QueuePairOverrides {
  std::optional<uint32_t> mtu_bytes;
  std::optional<uint8_t> timeout;
  std::optional<uint8_t> retry_cnt;
  std::optional<uint8_t> rnr_retry;
  std::optional<uint8_t> max_rd_atomic;
  std::optional<uint32_t> sq_depth;
  std::optional<uint64_t> max_message_bytes;
  std::optional<int> gid_index;
  std::optional<uint8_t> service_level;
  std::optional<uint8_t> traffic_class;
};

// A family of devices and the defaults that suit it (as Monarch's device
// impls do).
struct DeviceProfile {
  // "generic", "mlx5" or "efa".
  std::string name;
  QueuePairParams defaults;
  // Set when the family cannot run this backend (EFA has no RC QPs).
  std::string unsupported_reason;
};

// The profile called `name` ("generic", "mlx5", "efa"); INVALID_ARGUMENT
// otherwise.
absl::StatusOr<DeviceProfile> ProfileByName(absl::string_view name);

// The profile for a device, from its vendor id and name (mlx5_* / Mellanox
// -> mlx5, efa* / Amazon -> efa, else generic).
DeviceProfile DetectProfile(const std::string& device_name,
                            const ibv_device_attr& attr);

// `defaults` with `overrides` applied, then capped by what the device and
// port allow.
QueuePairParams ResolveParams(const QueuePairParams& defaults,
                              const QueuePairOverrides& overrides,
                              const ibv_device_attr& device,
                              const ibv_port_attr& port);

}  // namespace rdma_agent::ibverbs

#endif  // RDMA_AGENTD_BACKENDS_IBVERBS_PROFILES_H_
