#include "backends/ibverbs/flags.h"

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "backends/ibverbs/options.h"
#include "backends/ibverbs/real_verbs.h"

namespace {
// Defaults come from the options struct, written once.
const rdma_agent::ibverbs::IbverbsOptions kDefaults;
}  // namespace

ABSL_FLAG(bool, ibverbs_enable, true,
          "Use RDMA NICs through libibverbs when present. False: the ibverbs "
          "backend reports itself unavailable.");
ABSL_FLAG(std::vector<std::string>, ibverbs_devices, {},
          "RDMA devices to use, comma separated, e.g. mlx5_0,mlx5_1: every "
          "port of each is a rail (used while ACTIVE), and ops are striped "
          "over the rails. Empty: every device.");
ABSL_FLAG(std::string, ibverbs_device, "",
          "One RDMA device to use, e.g. mlx5_0: the same as "
          "--ibverbs_devices=mlx5_0 (kept for existing configurations).");
ABSL_FLAG(int32_t, ibverbs_port, 0,
          "1-based port used on each device. 0: every port.");
ABSL_FLAG(uint64_t, ibverbs_stripe_threshold_bytes, 64 << 10,
          "Ops of at least this many bytes are split over every rail pair to "
          "their peer, in proportion to link speed; smaller ones go whole to "
          "the least loaded pair.");
ABSL_FLAG(std::string, ibverbs_numa_policy, "nearest",
          "How rails are paired with memory by NUMA node: nearest (an op "
          "goes over the rails nearest to its buffers on both hosts; the "
          "others only when none of those works, or for striped ops when the "
          "near rails' link speed is below --ibverbs_numa_near_share of all) "
          "or all (every rail for every op).");
ABSL_FLAG(double, ibverbs_numa_near_share, 0.5,
          "With --ibverbs_numa_policy=nearest: far rails join striped ops "
          "when the near rails' total link speed is below this share (0-1) "
          "of all rails'. 0: never.");
ABSL_FLAG(std::string, ibverbs_sysfs_root, "/sys",
          "Where the NUMA nodes, their distances and the RDMA devices' nodes "
          "are read (sysfs).");
ABSL_FLAG(absl::Duration, ibverbs_rail_cooldown, absl::Seconds(1),
          "How long a rail pair whose completions failed (or a rail whose "
          "port went down) is left out before it is probed again; doubles "
          "with each failure in a row.");
ABSL_FLAG(absl::Duration, ibverbs_rail_max_cooldown, absl::Seconds(30),
          "The longest a failing rail pair or rail is left out at a time.");
ABSL_FLAG(std::string, ibverbs_profile, "auto",
          "Device profile whose queue-pair defaults apply: auto (from the "
          "device's vendor and name), generic, mlx5, efa.");
ABSL_FLAG(int32_t, ibverbs_gid_index, -1,
          "GID table index (RoCE). -1: the profile's default.");
ABSL_FLAG(int32_t, ibverbs_mtu, 0,
          "Path MTU in bytes (256, 512, 1024, 2048, 4096); the port's active "
          "MTU caps it. 0: the profile's default.");
ABSL_FLAG(int32_t, ibverbs_timeout, -1,
          "Local ACK timeout exponent, 4.096 us * 2^N per try (0 = infinite, "
          "max 31). -1: the profile's default (14, ~67 ms).");
ABSL_FLAG(int32_t, ibverbs_retry_cnt, -1,
          "Transport retries before a peer counts as unreachable (0-7). "
          "-1: the profile's default (7).");
ABSL_FLAG(int32_t, ibverbs_rnr_retry, -1,
          "Receiver-not-ready retries (0-7, 7 = infinite). -1: profile "
          "default (7).");
ABSL_FLAG(int32_t, ibverbs_max_rd_atomic, -1,
          "RDMA READs in flight per QP (initiator and responder depth); the "
          "device caps it. -1: profile default (16).");
ABSL_FLAG(int32_t, ibverbs_sq_depth, 0,
          "Send-queue depth: WRs outstanding per QP. 0: profile default "
          "(generic 256, mlx5 1024).");
ABSL_FLAG(uint64_t, ibverbs_max_message_bytes, 0,
          "Largest single RDMA work request; longer ops are split. The "
          "port's max_msg_sz caps it. 0: profile default.");
ABSL_FLAG(int32_t, ibverbs_service_level, -1,
          "InfiniBand service level (0-15). -1: 0.");
ABSL_FLAG(int32_t, ibverbs_traffic_class, -1,
          "GRH traffic class (RoCE DSCP << 2). -1: 0.");
ABSL_FLAG(absl::Duration, ibverbs_connect_timeout, absl::Seconds(5),
          "Bound on one queue-pair handshake with a peer agent.");
ABSL_FLAG(absl::Duration, ibverbs_busy_poll, absl::Microseconds(50),
          "How long the completion poller spins before blocking on the "
          "completion channel.");
ABSL_FLAG(int32_t, ibverbs_max_responders, 1024,
          "Peer sessions kept at most (one per peer agent and device, each a "
          "protection domain with one queue pair); handshakes beyond it fail "
          "with RESOURCE_EXHAUSTED.");
ABSL_FLAG(int32_t, ibverbs_max_responders_per_source,
          static_cast<int32_t>(kDefaults.max_responders_per_source),
          "Peer sessions kept at most for one caller address (the IP a Peer "
          "call comes from), so that one host holding one token cannot take "
          "every session; handshakes beyond fail with RESOURCE_EXHAUSTED.");
ABSL_FLAG(absl::Duration, ibverbs_responder_idle_timeout,
          kDefaults.responder_idle_timeout,
          "A peer session no handshake or grant request named for this long "
          "is dropped with its queue pair, protection domain and grants "
          "(agents using a session name it again well before). 0: never. "
          "Sessions also go once every buffer proven for them is released.");
ABSL_FLAG(int32_t, ibverbs_max_requester_peers,
          static_cast<int32_t>(kDefaults.max_requester_peers),
          "Peer agents (agent id and epoch, as remote contexts name them) "
          "this agent keeps lanes and queue pairs for as requester, and Peer "
          "channels (addresses) it keeps open; past it the least recently "
          "used idle one makes room, and ops to a new peer fail with "
          "RESOURCE_EXHAUSTED when every one is in use.");
ABSL_FLAG(absl::Duration, ibverbs_requester_idle_timeout,
          kDefaults.requester_idle_timeout,
          "Requester state of a peer (lanes, queue pairs, its Peer channel) "
          "unused for this long is dropped; the next op reconnects. Keep it "
          "below peers' --ibverbs_responder_idle_timeout. 0: never.");
ABSL_FLAG(int32_t, ibverbs_max_peer_link_labels,
          static_cast<int32_t>(kDefaults.max_peer_link_labels),
          "Distinct peer labels of rdma_agentd_peer_links per direction for "
          "the ibverbs backend; the peers with fewer links are summed under "
          "peer=\"other\".");
ABSL_FLAG(int32_t, ibverbs_max_grants_per_peer, 4096,
          "Registrations one peer session may be granted (one memory region "
          "each in its protection domain); grants beyond it fail with "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(absl::Duration, ibverbs_drain_timeout, absl::Seconds(10),
          "Bound on flushing a queue pair moved to ERROR after a deadline.");

namespace rdma_agent {

using ibverbs::IbverbsBackend;
using ibverbs::IbverbsOptions;
using ibverbs::QueuePairOverrides;

namespace {

// Copies `value` into `out` unless it is the flag's "unset" value; checks
// [low, high].
template <typename T>
absl::Status SetIf(int64_t value, int64_t unset, int64_t low, int64_t high,
                   const char* flag, std::optional<T>& out) {
  if (value == unset) return absl::OkStatus();
  if (value < low || value > high) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, "=", value, " is outside [", low, ", ", high, "]"));
  }
  out = static_cast<T>(value);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<IbverbsOptions> IbverbsOptionsFromFlags() {
  IbverbsOptions options;
  options.enabled = absl::GetFlag(FLAGS_ibverbs_enable);
  for (const std::string& device : absl::GetFlag(FLAGS_ibverbs_devices)) {
    if (!device.empty()) options.devices.push_back(device);
  }
  const std::string single = absl::GetFlag(FLAGS_ibverbs_device);
  if (!single.empty()) {
    if (!options.devices.empty()) {
      return absl::InvalidArgumentError(
          "set --ibverbs_devices or --ibverbs_device, not both");
    }
    options.devices.push_back(single);
  }
  const int32_t port = absl::GetFlag(FLAGS_ibverbs_port);
  if (port < 0 || port > 255) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ibverbs_port=", port, " is outside [0, 255]"));
  }
  options.port = static_cast<uint8_t>(port);
  options.profile = absl::GetFlag(FLAGS_ibverbs_profile);
  QueuePairOverrides& qp = options.qp;
  for (absl::Status s : {
           SetIf(absl::GetFlag(FLAGS_ibverbs_gid_index), -1, 0, 255,
                 "ibverbs_gid_index", qp.gid_index),
           SetIf(absl::GetFlag(FLAGS_ibverbs_mtu), 0, 256, 4096, "ibverbs_mtu",
                 qp.mtu_bytes),
           SetIf(absl::GetFlag(FLAGS_ibverbs_timeout), -1, 0, 31,
                 "ibverbs_timeout", qp.timeout),
           SetIf(absl::GetFlag(FLAGS_ibverbs_retry_cnt), -1, 0, 7,
                 "ibverbs_retry_cnt", qp.retry_cnt),
           SetIf(absl::GetFlag(FLAGS_ibverbs_rnr_retry), -1, 0, 7,
                 "ibverbs_rnr_retry", qp.rnr_retry),
           SetIf(absl::GetFlag(FLAGS_ibverbs_max_rd_atomic), -1, 1, 255,
                 "ibverbs_max_rd_atomic", qp.max_rd_atomic),
           SetIf(absl::GetFlag(FLAGS_ibverbs_sq_depth), 0, 1, 1 << 20,
                 "ibverbs_sq_depth", qp.sq_depth),
           SetIf(absl::GetFlag(FLAGS_ibverbs_service_level), -1, 0, 15,
                 "ibverbs_service_level", qp.service_level),
           SetIf(absl::GetFlag(FLAGS_ibverbs_traffic_class), -1, 0, 255,
                 "ibverbs_traffic_class", qp.traffic_class),
       }) {
    if (!s.ok()) return s;
  }
  const uint64_t max_message = absl::GetFlag(FLAGS_ibverbs_max_message_bytes);
  if (max_message != 0) qp.max_message_bytes = max_message;
  options.connect_timeout = absl::GetFlag(FLAGS_ibverbs_connect_timeout);
  options.busy_poll = absl::GetFlag(FLAGS_ibverbs_busy_poll);
  options.drain_timeout = absl::GetFlag(FLAGS_ibverbs_drain_timeout);
  const int32_t max_responders = absl::GetFlag(FLAGS_ibverbs_max_responders);
  if (max_responders < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--ibverbs_max_responders=", max_responders, " must be positive"));
  }
  options.max_responders = static_cast<size_t>(max_responders);
  const int32_t max_grants = absl::GetFlag(FLAGS_ibverbs_max_grants_per_peer);
  if (max_grants < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--ibverbs_max_grants_per_peer=", max_grants, " must be positive"));
  }
  options.max_grants_per_peer = static_cast<size_t>(max_grants);
  for (const auto& [flag, value, out] :
       {std::tuple{"ibverbs_max_responders_per_source",
                   absl::GetFlag(FLAGS_ibverbs_max_responders_per_source),
                   &options.max_responders_per_source},
        std::tuple{"ibverbs_max_requester_peers",
                   absl::GetFlag(FLAGS_ibverbs_max_requester_peers),
                   &options.max_requester_peers},
        std::tuple{"ibverbs_max_peer_link_labels",
                   absl::GetFlag(FLAGS_ibverbs_max_peer_link_labels),
                   &options.max_peer_link_labels}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, "=", value, " must be positive"));
    }
    *out = static_cast<size_t>(value);
  }
  options.responder_idle_timeout =
      absl::GetFlag(FLAGS_ibverbs_responder_idle_timeout);
  options.requester_idle_timeout =
      absl::GetFlag(FLAGS_ibverbs_requester_idle_timeout);
  if (options.responder_idle_timeout < absl::ZeroDuration() ||
      options.requester_idle_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "--ibverbs_responder_idle_timeout and "
        "--ibverbs_requester_idle_timeout must not be negative");
  }
  options.stripe_threshold_bytes =
      absl::GetFlag(FLAGS_ibverbs_stripe_threshold_bytes);
  options.rail_cooldown = absl::GetFlag(FLAGS_ibverbs_rail_cooldown);
  options.rail_max_cooldown = absl::GetFlag(FLAGS_ibverbs_rail_max_cooldown);
  if (options.rail_cooldown <= absl::ZeroDuration() ||
      options.rail_max_cooldown < options.rail_cooldown) {
    return absl::InvalidArgumentError(
        "--ibverbs_rail_cooldown must be positive and at most "
        "--ibverbs_rail_max_cooldown");
  }
  const std::string policy = absl::GetFlag(FLAGS_ibverbs_numa_policy);
  if (policy == "nearest") {
    options.numa_policy = IbverbsOptions::NumaPolicy::kNearest;
  } else if (policy == "all") {
    options.numa_policy = IbverbsOptions::NumaPolicy::kAll;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--ibverbs_numa_policy=", policy, " is neither nearest nor all"));
  }
  options.numa_near_share = absl::GetFlag(FLAGS_ibverbs_numa_near_share);
  if (!(options.numa_near_share >= 0 && options.numa_near_share <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ibverbs_numa_near_share=", options.numa_near_share,
                     " is outside [0, 1]"));
  }
  options.sysfs_root = absl::GetFlag(FLAGS_ibverbs_sysfs_root);
  return options;
}

BackendFactory MakeIbverbsBackendFactoryFromFlags() {
  return [](const BackendEnvironment& env)
             -> absl::StatusOr<std::unique_ptr<Backend>> {
    auto options = IbverbsOptionsFromFlags();
    if (!options.ok()) return options.status();
    auto backend = IbverbsBackend::Create(env, std::move(*options),
                                          verbs::MakeRealVerbs());
    if (!backend.ok()) return backend.status();
    return std::unique_ptr<Backend>(std::move(*backend));
  };
}

}  // namespace rdma_agent
