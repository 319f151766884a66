#include "backends/ibverbs/real_verbs.h"

#include <fcntl.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace rdma_agent {
namespace verbs {
namespace {

absl::Status ErrnoStatus(absl::string_view call, int err) {
  const std::string message = absl::StrCat(call, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case ENODEV:
      return absl::NotFoundError(message);
    case ENOMEM:
      return absl::ResourceExhaustedError(message);
    case EPERM:
    case EACCES:
      return absl::PermissionDeniedError(message);
    default:
      return absl::InvalidArgumentError(message);
  }
}

// Parents are held by shared_ptr so a child never outlives what it was made
// from (ibv_dealloc_pd fails with EBUSY while MRs or QPs exist).
using ContextPtr = std::shared_ptr<ibv_context>;
using PdPtr = std::shared_ptr<ibv_pd>;

class RealMemoryRegion : public MemoryRegion {
 public:
  RealMemoryRegion(PdPtr pd, ibv_mr* mr) : pd_(std::move(pd)), mr_(mr) {}
  ~RealMemoryRegion() override { ibv_dereg_mr(mr_); }
  uint32_t lkey() const override { return mr_->lkey; }
  uint32_t rkey() const override { return mr_->rkey; }
  void* addr() const override { return mr_->addr; }
  size_t length() const override { return mr_->length; }

 private:
  PdPtr pd_;
  ibv_mr* const mr_;
};

class RealCompletionQueue : public CompletionQueue {
 public:
  RealCompletionQueue(ContextPtr context, ibv_comp_channel* channel, ibv_cq* cq)
      : context_(std::move(context)), channel_(channel), cq_(cq) {}
  ~RealCompletionQueue() override {
    if (unacked_ > 0) ibv_ack_cq_events(cq_, unacked_);
    ibv_destroy_cq(cq_);
    ibv_destroy_comp_channel(channel_);
  }

  ibv_cq* raw() const { return cq_; }

  absl::StatusOr<int> Poll(absl::Span<ibv_wc> wc) override {
    const int n = ibv_poll_cq(cq_, static_cast<int>(wc.size()), wc.data());
    if (n < 0) return absl::InternalError("ibv_poll_cq failed");
    return n;
  }

  absl::Status RequestNotify() override {
    const int err = ibv_req_notify_cq(cq_, 0);
    return err == 0 ? absl::OkStatus() : ErrnoStatus("ibv_req_notify_cq", err);
  }

  absl::StatusOr<bool> WaitForEvent(absl::Duration timeout) override {
    // The channel fd is non-blocking; poll() bounds the wait.
    pollfd pfd = {channel_->fd, POLLIN, 0};
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(timeout));
    const int ready = poll(&pfd, 1, ms);
    if (ready < 0) {
      if (errno == EINTR) return false;
      return ErrnoStatus("poll(completion channel)", errno);
    }
    if (ready == 0) return false;
    ibv_cq* cq = nullptr;
    void* context = nullptr;
    if (ibv_get_cq_event(channel_, &cq, &context) != 0) {
      if (errno == EAGAIN) return false;
      return ErrnoStatus("ibv_get_cq_event", errno);
    }
    // Acked in batches: ibv_ack_cq_events takes a lock.
    if (++unacked_ >= 64) {
      ibv_ack_cq_events(cq_, unacked_);
      unacked_ = 0;
    }
    return true;
  }

 private:
  ContextPtr context_;
  ibv_comp_channel* const channel_;
  ibv_cq* const cq_;
  unsigned int unacked_ = 0;  // only the poller thread waits
};

class RealQueuePair : public QueuePair {
 public:
  RealQueuePair(PdPtr pd, ibv_qp* qp) : pd_(std::move(pd)), qp_(qp) {}
  ~RealQueuePair() override { ibv_destroy_qp(qp_); }
  uint32_t qp_num() const override { return qp_->qp_num; }

  absl::Status Modify(ibv_qp_attr& attr, int mask) override {
    const int err = ibv_modify_qp(qp_, &attr, mask);
    return err == 0 ? absl::OkStatus() : ErrnoStatus("ibv_modify_qp", err);
  }

  absl::StatusOr<ibv_qp_state> QueryState() override {
    ibv_qp_attr attr = {};
    ibv_qp_init_attr init = {};
    const int err = ibv_query_qp(qp_, &attr, IBV_QP_STATE, &init);
    if (err != 0) return ErrnoStatus("ibv_query_qp", err);
    return attr.qp_state;
  }

  int PostSend(ibv_send_wr* wr, ibv_send_wr** bad_wr) override {
    return ibv_post_send(qp_, wr, bad_wr);
  }

 private:
  PdPtr pd_;
  ibv_qp* const qp_;
};

class RealProtectionDomain : public ProtectionDomain {
 public:
  explicit RealProtectionDomain(PdPtr pd) : pd_(std::move(pd)) {}

  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(
      void* addr, size_t length, int access) override {
    ibv_mr* mr = ibv_reg_mr(pd_.get(), addr, length, access);
    if (mr == nullptr) return ErrnoStatus("ibv_reg_mr", errno);
    return std::unique_ptr<MemoryRegion>(new RealMemoryRegion(pd_, mr));
  }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterDmaBuf(
      uint64_t offset, size_t length, uint64_t iova, int fd,
      int access) override {
    ibv_mr* mr = ibv_reg_dmabuf_mr(pd_.get(), offset, length, iova, fd, access);
    if (mr == nullptr) return ErrnoStatus("ibv_reg_dmabuf_mr", errno);
    return std::unique_ptr<MemoryRegion>(new RealMemoryRegion(pd_, mr));
  }

  absl::StatusOr<std::unique_ptr<QueuePair>> CreateQueuePair(
      const QueuePairInit& init) override {
    auto* send_cq = dynamic_cast<RealCompletionQueue*>(init.send_cq);
    auto* recv_cq = dynamic_cast<RealCompletionQueue*>(init.recv_cq);
    if (send_cq == nullptr || recv_cq == nullptr) {
      return absl::InvalidArgumentError("ibv_create_qp: needs real CQs");
    }
    ibv_qp_init_attr attr = {};
    attr.send_cq = send_cq->raw();
    attr.recv_cq = recv_cq->raw();
    attr.cap = init.cap;
    attr.qp_type = init.qp_type;
    attr.sq_sig_all = init.sq_sig_all ? 1 : 0;
    ibv_qp* qp = ibv_create_qp(pd_.get(), &attr);
    if (qp == nullptr) return ErrnoStatus("ibv_create_qp", errno);
    return std::unique_ptr<QueuePair>(new RealQueuePair(pd_, qp));
  }

 private:
  PdPtr pd_;
};

class RealDevice : public Device {
 public:
  RealDevice(std::string name, ContextPtr context, int numa_node)
      : name_(std::move(name)),
        context_(std::move(context)),
        numa_node_(numa_node) {}

  const std::string& name() const override { return name_; }
  int NumaNode() const override { return numa_node_; }

  absl::StatusOr<ibv_device_attr> Query() override {
    ibv_device_attr attr = {};
    const int err = ibv_query_device(context_.get(), &attr);
    if (err != 0) return ErrnoStatus("ibv_query_device", err);
    return attr;
  }

  absl::StatusOr<ibv_port_attr> QueryPort(uint8_t port) override {
    ibv_port_attr attr = {};
    const int err = ibv_query_port(context_.get(), port, &attr);
    if (err != 0) return ErrnoStatus("ibv_query_port", err);
    return attr;
  }

  absl::StatusOr<ibv_gid> QueryGid(uint8_t port, int index) override {
    ibv_gid gid = {};
    if (ibv_query_gid(context_.get(), port, index, &gid) != 0) {
      return ErrnoStatus("ibv_query_gid", errno);
    }
    return gid;
  }

  absl::StatusOr<std::optional<AsyncEvent>> GetAsyncEvent(
      absl::Duration timeout) override {
    pollfd ready = {};
    ready.fd = context_->async_fd;
    ready.events = POLLIN;
    const int n = poll(&ready, 1,
                       static_cast<int>(std::clamp<int64_t>(
                           absl::ToInt64Milliseconds(timeout), 0, 1 << 30)));
    if (n < 0 && errno != EINTR) return ErrnoStatus("poll(async_fd)", errno);
    if (n <= 0) return std::nullopt;
    ibv_async_event event = {};
    if (ibv_get_async_event(context_.get(), &event) != 0) {
      return ErrnoStatus("ibv_get_async_event", errno);
    }
    AsyncEvent out;
    out.type = event.event_type;
    switch (event.event_type) {
      case IBV_EVENT_PORT_ACTIVE:
      case IBV_EVENT_PORT_ERR:
      case IBV_EVENT_LID_CHANGE:
      case IBV_EVENT_PKEY_CHANGE:
      case IBV_EVENT_SM_CHANGE:
      case IBV_EVENT_CLIENT_REREGISTER:
      case IBV_EVENT_GID_CHANGE:
        out.port = static_cast<uint8_t>(event.element.port_num);
        break;
      default:
        break;
    }
    // Every event got must be acked, or closing the device waits forever.
    ibv_ack_async_event(&event);
    return out;
  }

  absl::StatusOr<std::unique_ptr<ProtectionDomain>> AllocateProtectionDomain()
      override {
    ibv_pd* pd = ibv_alloc_pd(context_.get());
    if (pd == nullptr) return ErrnoStatus("ibv_alloc_pd", errno);
    ContextPtr context = context_;
    PdPtr owned(pd, [context](ibv_pd* p) { ibv_dealloc_pd(p); });
    return std::unique_ptr<ProtectionDomain>(
        new RealProtectionDomain(std::move(owned)));
  }

  absl::StatusOr<std::unique_ptr<CompletionQueue>> CreateCompletionQueue(
      int cqe) override {
    ibv_comp_channel* channel = ibv_create_comp_channel(context_.get());
    if (channel == nullptr) {
      return ErrnoStatus("ibv_create_comp_channel", errno);
    }
    // Non-blocking so that WaitForEvent can bound its wait with poll().
    const int flags = fcntl(channel->fd, F_GETFL);
    if (flags < 0 || fcntl(channel->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
      const int err = errno;
      ibv_destroy_comp_channel(channel);
      return ErrnoStatus("fcntl(completion channel)", err);
    }
    ibv_cq* cq = ibv_create_cq(context_.get(), cqe, nullptr, channel, 0);
    if (cq == nullptr) {
      const int err = errno;
      ibv_destroy_comp_channel(channel);
      return ErrnoStatus("ibv_create_cq", err);
    }
    return std::unique_ptr<CompletionQueue>(
        new RealCompletionQueue(context_, channel, cq));
  }

 private:
  const std::string name_;
  ContextPtr context_;
  const int numa_node_;
};

// <ibdev_path>/device/numa_node (e.g. /sys/class/infiniband/mlx5_0/...):
// the node of the PCI device; -1 when the file is missing or says so.
int ReadNumaNode(const char* ibdev_path) {
  if (ibdev_path == nullptr || ibdev_path[0] == '\0') return -1;
  const std::string path = absl::StrCat(ibdev_path, "/device/numa_node");
  FILE* file = std::fopen(path.c_str(), "re");
  if (file == nullptr) return -1;
  int node = -1;
  if (std::fscanf(file, "%d", &node) != 1) node = -1;
  std::fclose(file);
  return node;
}

class RealVerbs : public Verbs {
 public:
  absl::StatusOr<std::vector<std::string>> ListDevices() override {
    int count = 0;
    ibv_device** list = ibv_get_device_list(&count);
    std::vector<std::string> names;
    if (list == nullptr) {
      // ENOSYS: no kernel RDMA support at all; that is "no device".
      if (errno == ENOSYS) return names;
      return ErrnoStatus("ibv_get_device_list", errno);
    }
    for (int i = 0; i < count; ++i) {
      names.push_back(ibv_get_device_name(list[i]));
    }
    ibv_free_device_list(list);
    return names;
  }

  absl::StatusOr<std::unique_ptr<Device>> OpenDevice(
      const std::string& name) override {
    int count = 0;
    ibv_device** list = ibv_get_device_list(&count);
    if (list == nullptr) {
      return absl::NotFoundError(absl::StrCat("no RDMA device ", name));
    }
    ibv_context* context = nullptr;
    int err = ENODEV;
    int numa_node = -1;
    for (int i = 0; i < count; ++i) {
      if (name == ibv_get_device_name(list[i])) {
        context = ibv_open_device(list[i]);
        if (context == nullptr) err = errno;
        numa_node = ReadNumaNode(list[i]->ibdev_path);
        break;
      }
    }
    ibv_free_device_list(list);
    if (context == nullptr) {
      return ErrnoStatus(absl::StrCat("ibv_open_device(", name, ")"), err);
    }
    ContextPtr owned(context, [](ibv_context* c) { ibv_close_device(c); });
    return std::unique_ptr<Device>(
        new RealDevice(name, std::move(owned), numa_node));
  }
};

}  // namespace

std::unique_ptr<Verbs> MakeRealVerbs() { return std::make_unique<RealVerbs>(); }

}  // namespace verbs
}  // namespace rdma_agent
