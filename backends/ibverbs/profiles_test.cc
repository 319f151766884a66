#include "backends/ibverbs/profiles.h"

#include "gtest/gtest.h"

namespace rdma_agent::ibverbs {
namespace {

ibv_device_attr Device(int max_qp_wr = 32768, int max_rd_atom = 16,
                       int max_init_rd_atom = 16) {
  ibv_device_attr attr = {};
  attr.max_qp_wr = max_qp_wr;
  attr.max_qp_rd_atom = max_rd_atom;
  attr.max_qp_init_rd_atom = max_init_rd_atom;
  return attr;
}

ibv_port_attr Port(ibv_mtu mtu = IBV_MTU_4096, uint32_t max_msg = 1u << 30,
                   uint8_t link = IBV_LINK_LAYER_ETHERNET) {
  ibv_port_attr attr = {};
  attr.active_mtu = mtu;
  attr.max_msg_sz = max_msg;
  attr.link_layer = link;
  return attr;
}

TEST(ProfilesTest, NamesAndDetection) {
  EXPECT_EQ(ProfileByName("mlx5")->name, "mlx5");
  EXPECT_EQ(ProfileByName("generic")->name, "generic");
  EXPECT_FALSE(ProfileByName("efa")->unsupported_reason.empty());
  EXPECT_EQ(ProfileByName("roce").status().code(),
            absl::StatusCode::kInvalidArgument);
  ibv_device_attr attr = {};
  EXPECT_EQ(DetectProfile("mlx5_3", attr).name, "mlx5");
  EXPECT_EQ(DetectProfile("efa_0", attr).name, "efa");
  EXPECT_EQ(DetectProfile("rxe0", attr).name, "generic");
  attr.vendor_id = 0x02c9;
  EXPECT_EQ(DetectProfile("renamed0", attr).name, "mlx5");
  attr.vendor_id = 0x1d0f;
  EXPECT_EQ(DetectProfile("renamed1", attr).name, "efa");
}

TEST(ProfilesTest, DeviceAndPortCapTheDefaults) {
  const QueuePairParams mlx5 = ProfileByName("mlx5")->defaults;
  const QueuePairParams p =
      ResolveParams(mlx5, {}, Device(/*max_qp_wr=*/512, /*max_rd_atom=*/4),
                    Port(IBV_MTU_1024, /*max_msg=*/1 << 20));
  EXPECT_EQ(p.sq_depth, 512u);
  EXPECT_EQ(p.max_rd_atomic, 4);
  EXPECT_EQ(p.mtu_bytes, 1024u);
  EXPECT_EQ(p.max_message_bytes, 1u << 20);
  EXPECT_EQ(p.gid_index, 3);  // RoCE
  EXPECT_EQ(
      ResolveParams(mlx5, {}, Device(),
                    Port(IBV_MTU_4096, 1u << 30, IBV_LINK_LAYER_INFINIBAND))
          .gid_index,
      0);
}

TEST(ProfilesTest, OverridesApplyThenCaps) {
  QueuePairOverrides o;
  o.mtu_bytes = 512;
  o.timeout = 40;  // capped at 31
  o.retry_cnt = 3;
  o.sq_depth = 100000;                      // capped by the device
  o.max_message_bytes = uint64_t{1} << 40;  // capped by the port
  o.gid_index = 5;
  const QueuePairParams p =
      ResolveParams(ProfileByName("generic")->defaults, o, Device(16384),
                    Port(IBV_MTU_4096, 1u << 31, IBV_LINK_LAYER_INFINIBAND));
  EXPECT_EQ(p.mtu_bytes, 512u);
  EXPECT_EQ(p.timeout, 31);
  EXPECT_EQ(p.retry_cnt, 3);
  EXPECT_EQ(p.sq_depth, 16384u);
  EXPECT_EQ(p.max_message_bytes, 1ull << 31);
  EXPECT_EQ(p.gid_index, 5);  // explicit wins even on InfiniBand
}

}  // namespace
}  // namespace rdma_agent::ibverbs
