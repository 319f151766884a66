#include "backends/ibverbs/verbs.h"

#include <arpa/inet.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace rdma_agent {
namespace verbs {

std::string WcStatusName(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_SUCCESS:
      return "IBV_WC_SUCCESS";
    case IBV_WC_LOC_LEN_ERR:
      return "IBV_WC_LOC_LEN_ERR";
    case IBV_WC_LOC_QP_OP_ERR:
      return "IBV_WC_LOC_QP_OP_ERR";
    case IBV_WC_LOC_PROT_ERR:
      return "IBV_WC_LOC_PROT_ERR";
    case IBV_WC_WR_FLUSH_ERR:
      return "IBV_WC_WR_FLUSH_ERR";
    case IBV_WC_REM_INV_REQ_ERR:
      return "IBV_WC_REM_INV_REQ_ERR";
    case IBV_WC_REM_ACCESS_ERR:
      return "IBV_WC_REM_ACCESS_ERR";
    case IBV_WC_REM_OP_ERR:
      return "IBV_WC_REM_OP_ERR";
    case IBV_WC_RETRY_EXC_ERR:
      return "IBV_WC_RETRY_EXC_ERR";
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return "IBV_WC_RNR_RETRY_EXC_ERR";
    case IBV_WC_FATAL_ERR:
      return "IBV_WC_FATAL_ERR";
    case IBV_WC_GENERAL_ERR:
      return "IBV_WC_GENERAL_ERR";
    default:
      return absl::StrCat("IBV_WC_STATUS_", static_cast<int>(status));
  }
}

std::string QpStateName(ibv_qp_state state) {
  switch (state) {
    case IBV_QPS_RESET:
      return "RESET";
    case IBV_QPS_INIT:
      return "INIT";
    case IBV_QPS_RTR:
      return "RTR";
    case IBV_QPS_RTS:
      return "RTS";
    case IBV_QPS_SQD:
      return "SQD";
    case IBV_QPS_SQE:
      return "SQE";
    case IBV_QPS_ERR:
      return "ERR";
    default:
      return absl::StrCat("QPS_", static_cast<int>(state));
  }
}

std::string PortStateName(ibv_port_state state) {
  switch (state) {
    case IBV_PORT_DOWN:
      return "DOWN";
    case IBV_PORT_INIT:
      return "INIT";
    case IBV_PORT_ARMED:
      return "ARMED";
    case IBV_PORT_ACTIVE:
      return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER:
      return "ACTIVE_DEFER";
    default:
      return "NOP";
  }
}

std::string AsyncEventName(ibv_event_type type) {
  return absl::StrCat("IBV_EVENT_", ibv_event_type_str(type));
}

uint32_t MtuBytes(ibv_mtu mtu) {
  switch (mtu) {
    case IBV_MTU_256:
      return 256;
    case IBV_MTU_512:
      return 512;
    case IBV_MTU_1024:
      return 1024;
    case IBV_MTU_2048:
      return 2048;
    case IBV_MTU_4096:
      return 4096;
  }
  return 0;
}

absl::StatusOr<ibv_mtu> MtuFromBytes(uint32_t bytes) {
  switch (bytes) {
    case 256:
      return IBV_MTU_256;
    case 512:
      return IBV_MTU_512;
    case 1024:
      return IBV_MTU_1024;
    case 2048:
      return IBV_MTU_2048;
    case 4096:
      return IBV_MTU_4096;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "MTU must be 256, 512, 1024, 2048 or 4096 bytes, not ", bytes));
}

double PortSpeedGbps(const ibv_port_attr& port) {
  // Per-lane rates of ibv_port_attr.active_speed (see ibv_query_port(3)).
  double lane = 0;
  switch (port.active_speed) {
    case 1:
      lane = 2.5;
      break;  // SDR
    case 2:
      lane = 5.0;
      break;  // DDR
    case 4:
      lane = 10.0;
      break;  // QDR
    case 8:
      lane = 10.3125;
      break;  // FDR10
    case 16:
      lane = 14.0625;
      break;  // FDR
    case 32:
      lane = 25.78125;
      break;  // EDR
    case 64:
      lane = 53.125;
      break;  // HDR
    case 128:
      lane = 106.25;
      break;  // NDR
    default:
      lane = 0;
      break;
  }
  int lanes = 0;
  switch (port.active_width) {
    case 1:
      lanes = 1;
      break;
    case 2:
      lanes = 4;
      break;
    case 4:
      lanes = 8;
      break;
    case 8:
      lanes = 12;
      break;
    case 16:
      lanes = 2;
      break;
    default:
      lanes = 0;
      break;
  }
  return lane * lanes;
}

std::string GidToString(const ibv_gid& gid) {
  char text[INET6_ADDRSTRLEN] = {};
  if (inet_ntop(AF_INET6, gid.raw, text, sizeof(text)) == nullptr) return "";
  return text;
}

}  // namespace verbs
}  // namespace rdma_agent
