#include "daemon/api/rpc_observer.h"

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/log_context.h"
#include "common/log_text.h"
#include "daemon/local/caller_identity.h"
#include "daemon/metrics/metrics.h"
#include "google/protobuf/descriptor.h"
#include "spdlog/spdlog.h"

namespace rdma_agent {
namespace {

using grpc::experimental::InterceptionHookPoints;

// "rdma.agent.v1.RdmaAgent/Submit" from "/rdma.agent.v1.RdmaAgent/Submit".
std::string MethodName(const char* method) {
  absl::string_view name = method == nullptr ? "" : method;
  absl::ConsumePrefix(&name, "/");
  return std::string(name);
}

// What an RPC is counted under: its name when it names a method the agent
// knows (one of the services compiled into it), else "unknown". The path is
// whatever the caller sent, and every label value is a series kept for the
// agent's life: invented paths must not add series.
std::string MethodLabel(absl::string_view method) {
  const size_t slash = method.find('/');
  if (slash != absl::string_view::npos) {
    const absl::string_view service = method.substr(0, slash);
    const absl::string_view name = method.substr(slash + 1);
    const google::protobuf::MethodDescriptor* known =
        google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(
            absl::StrCat(service, ".", name));
    if (known != nullptr && known->name() == name &&
        known->service()->full_name() == service) {
      return std::string(method);
    }
  }
  return "unknown";
}

class RpcObserver : public grpc::experimental::Interceptor {
 public:
  RpcObserver(grpc::experimental::ServerRpcInfo* info,
              const CallerTable* callers, AgentMetrics* metrics,
              LogRateLimiter* error_log)
      : info_(info),
        callers_(callers),
        metrics_(metrics),
        error_log_(error_log),
        start_(absl::Now()) {}

  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::PRE_SEND_STATUS)) {
      Observe(methods->GetSendStatus());
    }
    methods->Proceed();
  }

 private:
  void Observe(const grpc::Status& status) {
    const absl::Duration took = absl::Now() - start_;
    // Logged escaped: the path comes from the caller.
    const std::string method = LogSafe(MethodName(info_->method()));
    const auto code = static_cast<absl::StatusCode>(status.error_code());
    if (metrics_ != nullptr) {
      metrics_->RecordRpc(MethodLabel(MethodName(info_->method())), code, took);
    }
    const bool failed = !status.ok();
    if (!failed && !spdlog::should_log(spdlog::level::debug)) return;
    // Who asked: the credentials the agent read when it accepted the
    // connection (absent for connections it did not accept itself).
    std::string caller = "an unidentified caller";
    LogContext log_context;
    log_context.method = method;
    const grpc::ServerContextBase* context = info_->server_context();
    if (context != nullptr && callers_ == nullptr) {
      caller = absl::StrCat("peer ", LogSafe(context->peer()));
    } else if (context != nullptr) {
      auto peer = callers_->Lookup(*context);
      if (peer.ok()) {
        caller = absl::StrCat("uid ", peer->uid, " pid ", peer->pid);
        log_context.uid = peer->uid;
        log_context.pid = peer->pid;
      }
    }
    const ScopedLogContext scoped(std::move(log_context));
    // CANCELLED is only ever the client's own doing (it cancelled, or went
    // away: Ctrl-C on rdma-agentctl watch): the normal end of a stream or
    // long poll, not an error of the agent's.
    if (code == absl::StatusCode::kCancelled) {
      spdlog::debug("{} from {} ended by the client in {}", method, caller,
                    absl::FormatDuration(took));
      return;
    }
    if (!failed) {
      spdlog::debug("{} from {}: OK in {}", method, caller,
                    absl::FormatDuration(took));
      return;
    }
    const std::string error = absl::StrCat(absl::StatusCodeToString(code), ": ",
                                           LogSafe(status.error_message()));
    if (const auto suppressed =
            callers_ != nullptr ? error_log_->Allow() : std::nullopt) {
      spdlog::warn("{} from {} failed: {} ({} similar suppressed)", method,
                   caller, error, *suppressed);
    } else {
      spdlog::debug("{} from {} failed: {} in {}", method, caller, error,
                    absl::FormatDuration(took));
    }
  }

  grpc::experimental::ServerRpcInfo* const info_;
  const CallerTable* const callers_;
  AgentMetrics* const metrics_;
  LogRateLimiter* const error_log_;
  const absl::Time start_;
};

}  // namespace

RpcObserverFactory::RpcObserverFactory(const CallerTable* callers,
                                       AgentMetrics* metrics)
    : callers_(callers), metrics_(metrics) {}

RpcObserverFactory::RpcObserverFactory(AgentMetrics* metrics)
    : callers_(nullptr), metrics_(metrics) {}

grpc::experimental::Interceptor* RpcObserverFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new RpcObserver(info, callers_, metrics_, &error_log_);
}

void ObserveRpcs(grpc::ServerBuilder& builder,
                 std::unique_ptr<RpcObserverFactory> observer) {
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      observers;
  observers.push_back(std::move(observer));
  builder.experimental().SetInterceptorCreators(std::move(observers));
}

}  // namespace rdma_agent
