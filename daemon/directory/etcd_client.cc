#include "daemon/directory/etcd_client.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace rdma_agent {
namespace {

// The end of the range of keys that start with `prefix` (etcd's "prefix
// end": the prefix with its last byte incremented, dropping 0xff bytes).
std::string PrefixEnd(std::string prefix) {
  while (!prefix.empty()) {
    unsigned char& last = reinterpret_cast<unsigned char&>(prefix.back());
    if (last < 0xff) {
      ++last;
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

// The operations counted, as WithFailover's callers name them.
constexpr const char* kOperations[] = {
    "lease grant", "lease keep-alive", "lease revoke", "put",  "range",
    "get",         "transaction",      "delete",       "watch"};

bool IsInvalidToken(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAUTHENTICATED;
}

}  // namespace

EtcdClient::EtcdClient(Options options) : options_(std::move(options)) {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options_.ca_pem.empty()) {
    credentials = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options_.ca_pem;
    ssl.pem_cert_chain = options_.cert_pem;
    ssl.pem_private_key = options_.key_pem;
    credentials = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments arguments;
  // A list of agents is bounded by the directory's own limits; leave room
  // for them (gRPC's default is 4 MiB).
  arguments.SetMaxReceiveMessageSize(64 << 20);
  // Fail over quickly: reconnect attempts to a dead endpoint must not keep
  // a call waiting past the next endpoint.
  arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // An endpoint that went away is looked up again within a second, not
  // after gRPC's default 30 s between resolutions.
  arguments.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, 1000);
  for (const std::string& address : options_.endpoints) {
    auto endpoint = std::make_unique<Endpoint>();
    endpoint->address = address;
    endpoint->channel =
        grpc::CreateCustomChannel(address, credentials, arguments);
    endpoint->kv = etcdserverpb::KV::NewStub(endpoint->channel);
    endpoint->lease = etcdserverpb::Lease::NewStub(endpoint->channel);
    endpoint->auth = etcdserverpb::Auth::NewStub(endpoint->channel);
    endpoint->watch = etcdserverpb::Watch::NewStub(endpoint->channel);
    endpoints_.push_back(std::move(endpoint));
  }
}

EtcdClient::Counter& EtcdClient::CounterOf(const char* what) {
  for (size_t i = 0; i < std::size(kOperations); ++i) {
    if (std::strcmp(kOperations[i], what) == 0) return counters_[i];
  }
  return counters_.back();  // every caller names one of kOperations
}

std::vector<EtcdClient::OperationCount> EtcdClient::Counts() const {
  std::vector<OperationCount> counts;
  for (size_t i = 0; i < std::size(kOperations); ++i) {
    OperationCount count;
    count.operation = kOperations[i];
    for (char& c : count.operation) {
      if (c == ' ' || c == '-') c = '_';
    }
    count.calls = counters_[i].calls.load(std::memory_order_relaxed);
    count.errors = counters_[i].errors.load(std::memory_order_relaxed);
    counts.push_back(std::move(count));
  }
  return counts;
}

std::string EtcdClient::current_endpoint() const {
  absl::MutexLock lock(&mu_);
  return endpoints_[current_]->address;
}

absl::Status EtcdClient::Authenticate(Endpoint& endpoint, absl::Time deadline) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  etcdserverpb::AuthenticateRequest request;
  request.set_name(options_.user);
  request.set_password(options_.password);
  etcdserverpb::AuthenticateResponse response;
  const grpc::Status status =
      endpoint.auth->Authenticate(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  absl::MutexLock lock(&mu_);
  token_ = response.token();
  return absl::OkStatus();
}

absl::Status EtcdClient::Prepare(Endpoint& endpoint,
                                 grpc::ClientContext& context,
                                 absl::Time deadline) {
  context.set_deadline(absl::ToChronoTime(deadline));
  if (options_.user.empty()) return absl::OkStatus();
  std::string token;
  {
    absl::MutexLock lock(&mu_);
    token = token_;
  }
  if (token.empty()) {
    absl::Status status = Authenticate(endpoint, deadline);
    if (!status.ok()) return status;
    absl::MutexLock lock(&mu_);
    token = token_;
  }
  context.AddMetadata("token", token);
  return absl::OkStatus();
}

template <typename Call>
absl::Status EtcdClient::WithFailover(absl::Time deadline, const char* what,
                                      Call call) {
  Counter& counter = CounterOf(what);
  counter.calls.fetch_add(1, std::memory_order_relaxed);
  absl::Status status = CallWithFailover(deadline, what, call);
  if (!status.ok()) counter.errors.fetch_add(1, std::memory_order_relaxed);
  return status;
}

template <typename Call>
absl::Status EtcdClient::CallWithFailover(absl::Time deadline, const char* what,
                                          Call call) {
  size_t first;
  {
    absl::MutexLock lock(&mu_);
    first = current_;
  }
  absl::Status last;
  bool reauthenticated = false;
  // Several endpoints: round after round until the deadline, since members
  // of a cluster that has just lost its leader answer UNAVAILABLE, or hold
  // a call, until they have elected another; each attempt gets a slice of
  // the deadline. One endpoint: once, failing fast.
  const bool cluster = endpoints_.size() > 1;
  const size_t rounds_end = cluster ? SIZE_MAX : endpoints_.size();
  const absl::Duration slice =
      std::max(options_.call_timeout / 4, absl::Milliseconds(250));
  for (size_t tried = 0; tried < rounds_end; ++tried) {
    if (tried > 0 && tried % endpoints_.size() == 0) {
      absl::SleepFor(std::min(absl::Milliseconds(100), deadline - absl::Now()));
    }
    const size_t index = (first + tried) % endpoints_.size();
    Endpoint& endpoint = *endpoints_[index];
    grpc::Status status;
    for (;;) {
      grpc::ClientContext context;
      absl::Status prepared =
          Prepare(endpoint, context,
                  cluster ? std::min(deadline, absl::Now() + slice) : deadline);
      if (!prepared.ok()) {
        status = ToGrpcStatus(prepared);
        break;
      }
      status = call(endpoint, context);
      if (!IsInvalidToken(status) || options_.user.empty() || reauthenticated) {
        break;
      }
      // etcd forgets tokens (restart, token TTL): log in again, once.
      reauthenticated = true;
      absl::MutexLock lock(&mu_);
      token_.clear();
    }
    const bool next =
        status.error_code() == grpc::StatusCode::UNAVAILABLE ||
        (cluster && status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
    if (!next) {
      absl::MutexLock lock(&mu_);
      current_ = index;
      if (status.ok()) return absl::OkStatus();
      return absl::Status(FromGrpcStatus(status).code(),
                          absl::StrCat("etcd ", what, " at ", endpoint.address,
                                       ": ", status.error_message()));
    }
    last = absl::UnavailableError(absl::StrCat(
        "etcd ", what, " at ", endpoint.address, ": ", status.error_message()));
    if (absl::Now() >= deadline) break;
  }
  return last;
}

absl::StatusOr<int64_t> EtcdClient::GrantLease(absl::Duration ttl) {
  etcdserverpb::LeaseGrantRequest request;
  request.set_ttl(absl::ToInt64Seconds(ttl));
  etcdserverpb::LeaseGrantResponse response;
  absl::Status status = WithFailover(
      absl::Now() + options_.call_timeout, "lease grant",
      [&](Endpoint& endpoint, grpc::ClientContext& context) {
        return endpoint.lease->LeaseGrant(&context, request, &response);
      });
  if (!status.ok()) return status;
  if (!response.error().empty()) {
    return absl::UnavailableError(
        absl::StrCat("etcd lease grant: ", response.error()));
  }
  return response.id();
}

absl::StatusOr<absl::Duration> EtcdClient::KeepAlive(int64_t lease) {
  etcdserverpb::LeaseKeepAliveResponse response;
  absl::Status status =
      WithFailover(absl::Now() + options_.call_timeout, "lease keep-alive",
                   [&](Endpoint& endpoint, grpc::ClientContext& context) {
                     // One renewal per stream: the agent renews every few
                     // seconds, and a stream kept open would need a thread of
                     // its own to read it.
                     auto stream = endpoint.lease->LeaseKeepAlive(&context);
                     etcdserverpb::LeaseKeepAliveRequest request;
                     request.set_id(lease);
                     if (stream->Write(request)) {
                       stream->WritesDone();
                       if (!stream->Read(&response)) response.Clear();
                     }
                     return stream->Finish();
                   });
  if (!status.ok()) return status;
  if (response.id() != lease) {
    return absl::UnavailableError("etcd lease keep-alive: no answer");
  }
  return absl::Seconds(response.ttl());
}

absl::Status EtcdClient::RevokeLease(int64_t lease) {
  etcdserverpb::LeaseRevokeRequest request;
  request.set_id(lease);
  etcdserverpb::LeaseRevokeResponse response;
  return WithFailover(absl::Now() + options_.call_timeout, "lease revoke",
                      [&](Endpoint& endpoint, grpc::ClientContext& context) {
                        return endpoint.lease->LeaseRevoke(&context, request,
                                                           &response);
                      });
}

absl::Status EtcdClient::Put(const std::string& key, const std::string& value,
                             int64_t lease) {
  etcdserverpb::PutRequest request;
  request.set_key(key);
  request.set_value(value);
  request.set_lease(lease);
  etcdserverpb::PutResponse response;
  return WithFailover(absl::Now() + options_.call_timeout, "put",
                      [&](Endpoint& endpoint, grpc::ClientContext& context) {
                        return endpoint.kv->Put(&context, request, &response);
                      });
}

absl::StatusOr<etcdserverpb::RangeResponse> EtcdClient::RangePrefix(
    const std::string& prefix, int64_t limit, absl::Time deadline) {
  etcdserverpb::RangeRequest request;
  request.set_key(prefix);
  request.set_range_end(PrefixEnd(prefix));
  request.set_limit(limit);
  request.set_sort_order(etcdserverpb::RangeRequest::ASCEND);
  request.set_sort_target(etcdserverpb::RangeRequest::KEY);
  etcdserverpb::RangeResponse response;
  absl::Status status = WithFailover(
      std::min(deadline, absl::Now() + options_.call_timeout), "range",
      [&](Endpoint& endpoint, grpc::ClientContext& context) {
        return endpoint.kv->Range(&context, request, &response);
      });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<std::unique_ptr<EtcdClient::WatchStream>> EtcdClient::OpenWatch(
    grpc::ClientContext* context) {
  CounterOf("watch").calls.fetch_add(1, std::memory_order_relaxed);
  Endpoint* endpoint;
  {
    absl::MutexLock lock(&mu_);
    endpoint = endpoints_[current_].get();
  }
  if (!options_.user.empty()) {
    std::string token;
    {
      absl::MutexLock lock(&mu_);
      token = token_;
    }
    if (token.empty()) {
      absl::Status status =
          Authenticate(*endpoint, absl::Now() + options_.call_timeout);
      if (!status.ok()) {
        CounterOf("watch").errors.fetch_add(1, std::memory_order_relaxed);
        return status;
      }
      absl::MutexLock lock(&mu_);
      token = token_;
    }
    context->AddMetadata("token", token);
  }
  return std::unique_ptr<WatchStream>(endpoint->watch->Watch(context));
}

void EtcdClient::WatchEnded(const grpc::Status& status) {
  if (status.error_code() != grpc::StatusCode::CANCELLED) {
    CounterOf("watch").errors.fetch_add(1, std::memory_order_relaxed);
  }
  absl::MutexLock lock(&mu_);
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    current_ = (current_ + 1) % endpoints_.size();
  } else if (IsInvalidToken(status)) {
    token_.clear();
  }
}

absl::StatusOr<etcdserverpb::TxnResponse> EtcdClient::Txn(
    const etcdserverpb::TxnRequest& request) {
  etcdserverpb::TxnResponse response;
  absl::Status status =
      WithFailover(absl::Now() + options_.call_timeout, "transaction",
                   [&](Endpoint& endpoint, grpc::ClientContext& context) {
                     return endpoint.kv->Txn(&context, request, &response);
                   });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<std::optional<mvccpb::KeyValue>> EtcdClient::Get(
    const std::string& key, absl::Time deadline, int64_t* revision) {
  etcdserverpb::RangeRequest request;
  request.set_key(key);
  etcdserverpb::RangeResponse response;
  absl::Status status = WithFailover(
      std::min(deadline, absl::Now() + options_.call_timeout), "get",
      [&](Endpoint& endpoint, grpc::ClientContext& context) {
        return endpoint.kv->Range(&context, request, &response);
      });
  if (!status.ok()) return status;
  if (revision != nullptr) *revision = response.header().revision();
  if (response.kvs_size() == 0) return std::optional<mvccpb::KeyValue>();
  return std::optional<mvccpb::KeyValue>(response.kvs(0));
}

absl::Status EtcdClient::Delete(const std::string& key) {
  etcdserverpb::DeleteRangeRequest request;
  request.set_key(key);
  etcdserverpb::DeleteRangeResponse response;
  return WithFailover(absl::Now() + options_.call_timeout, "delete",
                      [&](Endpoint& endpoint, grpc::ClientContext& context) {
                        return endpoint.kv->DeleteRange(&context, request,
                                                        &response);
                      });
}

}  // namespace rdma_agent
