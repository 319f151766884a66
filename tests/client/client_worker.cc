// A client process driven by a test over stdin/stdout, one command per line,
// one answer line per command. It owns the buffers it registers (mapped in
// this process), so tests can check that bytes moved by the agent land in
// the memory of a separate process.
//
//   allocate SIZE ACCESS [LIFETIME]
//                               -> ok ID BASE64_CONTEXT | error CODE MESSAGE
//   attach SIZE ACCESS [LIFETIME]
//                               -> ok ID BASE64_CONTEXT | error CODE MESSAGE
//        LIFETIME: agent, process or connection; the client library's
//        default (process) when absent
//   attach_and_drop SIZE SEED   -> ok ID BASE64_CONTEXT SHRINK_ERRNO_NAME
//        attaches a memfd filled with pattern SEED, tries to shrink it, then
//        unmaps and closes it (the agent keeps the memory)
//   fill ID SEED                -> ok            (pattern SEED over buffer ID)
//   verify ID IN_SEED IN_FROM OFFSET LENGTH OUT_SEED
//                               -> ok | mismatch POSITION
//   submit read|write LOCAL_ID LOCAL_OFFSET LENGTH REMOTE_OFFSET BASE64_CONTEXT
//                               -> result CODE BACKEND | error CODE MESSAGE
//   submit_many COUNT read|write LOCAL_ID LOCAL_OFFSET LENGTH REMOTE_OFFSET
//               BASE64_CONTEXT  -> results OK_COUNT FIRST_NON_OK_CODE|-
//        one Submit of COUNT copies of the op, with a 10-minute timeout (a
//        long-running call to abandon)
//   submit_async read|write LOCAL_ID LOCAL_OFFSET LENGTH REMOTE_OFFSET
//                BASE64_CONTEXT -> transfer ID | error CODE MESSAGE
//   transfer_get ID             -> status CODE [STATE]   (GetTransfers, no
//   wait) transfer_cancel ID          -> status CODE [STATE]   (CancelTransfer)
//   transfer_detail get|cancel ID[,ID...]
//                   -> status OK STATE[,STATE...] | status CODE MESSAGE
//        GetTransfers (no wait) of every id, or CancelTransfer of the first,
//        with the agent's message when it refuses
//   transfer_watch MILLISECONDS -> events ID,ID,... | error CODE MESSAGE
//        the ends WatchTransfers pushed within that time (error: the agent
//        ended the stream before that, e.g. refused it)
//   notifications MILLISECONDS -> notifications N DATA,... dropped D
//        what GetNotifications returned after waiting that long
//   watch_start                 -> ok STATE | error CODE MESSAGE
//        starts the client library's TransferWatch (kept until the worker
//        exits; started again if it has ended), then runs one small transfer
//        between two buffers of its own and waits for its OnDone callback:
//        once this answers ok, the agent holds the stream open
//   watch_seen ID               -> seen | unseen
//        whether that watch has delivered the end of transfer ID (any
//        transfer of the user, through its on_end callback)
//   release ID                  -> status CODE
//   readbuf ID OFFSET LENGTH    -> status CODE [HEX_DATA]
//   writebuf ID OFFSET HEX_DATA -> status CODE
//   open ID                     -> status CODE fd|nofd   (raw OpenBuffer)
//   list                        -> ids ID,ID,...   (as the agent lists them:
//                                  in the order they were registered)
//   list_all                    -> ids ID,ID,... | error CODE MESSAGE
//        every user's (ListBuffers all_users)
//   info                        -> status CODE
//   import BASE64_CONTEXT       -> handle H | error CODE MESSAGE
//   release_remote H            -> status CODE
//   remotes                     -> handles H,H,... | error CODE MESSAGE
//   submit_handle read|write LOCAL_ID LOCAL_OFFSET LENGTH REMOTE_OFFSET H
//                               -> result CODE BACKEND MESSAGE | error ...
//   prepare read|write LOCAL_ID LOCAL_OFFSET LENGTH REMOTE_OFFSET H
//                               -> prepared ID | error CODE MESSAGE
//        a prepared transfer of that one op naming handle H
//   run_prepared ID             -> result CODE BACKEND MESSAGE | error ...
//   release_prepared ID         -> status CODE
//   ring_open ENTRIES           -> ok | error CODE MESSAGE
//        a shared-memory ring session (client/ring.h), kept until exit
//   ring_op read|write LOCAL_ID LOCAL_OFFSET LENGTH REMOTE_OFFSET H
//                               -> result CODE BACKEND MESSAGE | error ...
//        one op through the ring, waited for
//   exit                        -> (exits 0)
//
// CODE is an absl status code name (OK, NOT_FOUND, ...). Flags: --target,
// --attach_socket; --uid/--gid make the worker drop to that user first.

#include <fcntl.h>
#include <grp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <future>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "client/internal/attach_socket.h"
#include "client/rdma_agent_client.h"
#include "client/ring.h"
#include "common/grpc_status.h"
#include "common/shared_memory.h"
#include "grpcpp/grpcpp.h"
#include "tests/testing/pattern.h"

ABSL_FLAG(std::string, target, "", "agent target");
ABSL_FLAG(std::string, attach_socket, "", "attach socket path");
ABSL_FLAG(int, uid, -1, "drop to this uid before anything else");
ABSL_FLAG(int, gid, -1, "drop to this gid before anything else");

namespace rdma_agent::testing {
namespace {

using client::AgentClient;
using client::Buffer;
namespace v1 = ::rdma::agent::v1;

std::string CodeName(const absl::Status& status) {
  return absl::StatusCodeToString(status.code());
}

// Keeps answers on one line.
std::string OneLine(absl::string_view text) {
  std::string line(text);
  for (char& c : line) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return line;
}

std::string Error(const absl::Status& status) {
  return absl::StrCat("error ", CodeName(status), " ",
                      OneLine(status.message()));
}

std::optional<v1::Lifetime> ParseLifetime(absl::string_view word) {
  if (word == "agent") return v1::LIFETIME_AGENT;
  if (word == "process") return v1::LIFETIME_CLIENT_PROCESS;
  if (word == "connection") return v1::LIFETIME_CLIENT_CONNECTION;
  return std::nullopt;
}

// "result CODE BACKEND MESSAGE" of a one-op batch, or its error.
std::string OneResult(const absl::StatusOr<client::SubmitResult>& submitted) {
  if (!submitted.ok()) return Error(submitted.status());
  if (submitted->results.size() != 1) {
    return absl::StrCat("error INTERNAL ", submitted->results.size(),
                        " results");
  }
  const client::OpResult& result = submitted->results[0];
  return absl::StrCat("result ", CodeName(result.status), " ",
                      result.backend.empty() ? "-" : result.backend, " ",
                      OneLine(result.status.message()));
}

class Worker {
 public:
  explicit Worker(std::unique_ptr<AgentClient> client)
      : client_(std::move(client)) {}

  std::string Handle(const std::vector<std::string>& words) {
    const std::string& command = words[0];
    std::vector<uint64_t> n;
    for (size_t i = 1; i < words.size(); ++i) {
      uint64_t value = 0;
      if (!absl::SimpleAtoi(words[i], &value)) value = 0;
      n.push_back(value);
    }
    auto need = [&](size_t count) { return words.size() >= count + 1; };
    if ((command == "allocate" || command == "attach") && need(2)) {
      const v1::Access access = static_cast<v1::Access>(n[1]);
      absl::StatusOr<Buffer> buffer = absl::UnknownError("unset");
      if (!need(3)) {  // the library's default
        buffer = command == "allocate" ? client_->Allocate(n[0], access)
                                       : client_->Attach(n[0], access);
      } else {
        const std::optional<v1::Lifetime> lifetime = ParseLifetime(words[3]);
        if (!lifetime.has_value()) return "error INVALID_ARGUMENT bad lifetime";
        buffer = command == "allocate"
                     ? client_->Allocate(n[0], access, "", *lifetime)
                     : client_->Attach(n[0], access, "", *lifetime);
      }
      if (!buffer.ok()) return Error(buffer.status());
      const uint64_t id = buffer->id();
      const std::string context = absl::Base64Escape(buffer->remote_context());
      buffers_.emplace(id, std::move(*buffer));
      return absl::StrCat("ok ", id, " ", context);
    }
    if (command == "attach_and_drop" && need(2))
      return AttachAndDrop(n[0], n[1]);
    if (command == "fill" && need(2)) {
      Buffer* buffer = Find(n[0]);
      if (buffer == nullptr) return "error NOT_FOUND no such buffer here";
      FillPattern(buffer->bytes(), n[1]);
      return "ok";
    }
    if (command == "verify" && need(6)) {
      Buffer* buffer = Find(n[0]);
      if (buffer == nullptr) return "error NOT_FOUND no such buffer here";
      const std::optional<uint64_t> bad =
          FirstMismatch(buffer->bytes(), n[1], n[2], n[3], n[4], n[5]);
      if (bad.has_value()) return absl::StrCat("mismatch ", *bad);
      return "ok";
    }
    if (command == "submit" && need(6)) {
      client::OpSpec op;
      op.type = words[1] == "read" ? v1::OP_TYPE_READ_INTO_LOCAL
                                   : v1::OP_TYPE_WRITE_FROM_LOCAL;
      op.local_buffer_id = n[1];
      op.local_offset = n[2];
      op.length = n[3];
      op.remote_offset = n[4];
      if (!absl::Base64Unescape(words[6], &op.remote_context)) {
        return "error INVALID_ARGUMENT bad base64";
      }
      absl::StatusOr<std::vector<client::OpResult>> results =
          client_->Submit({op}, absl::Seconds(60));
      if (!results.ok()) return Error(results.status());
      const client::OpResult& result = results->at(0);
      return absl::StrCat("result ", CodeName(result.status), " ",
                          result.backend.empty() ? "-" : result.backend, " ",
                          OneLine(result.status.message()));
    }
    if (command == "submit_many" && need(7)) {
      client::OpSpec op;
      op.type = words[2] == "read" ? v1::OP_TYPE_READ_INTO_LOCAL
                                   : v1::OP_TYPE_WRITE_FROM_LOCAL;
      op.local_buffer_id = n[2];
      op.local_offset = n[3];
      op.length = n[4];
      op.remote_offset = n[5];
      if (!absl::Base64Unescape(words[7], &op.remote_context)) {
        return "error INVALID_ARGUMENT bad base64";
      }
      const std::vector<client::OpSpec> ops(n[0], op);
      absl::StatusOr<std::vector<client::OpResult>> results =
          client_->Submit(ops, absl::Minutes(10));
      if (!results.ok()) return Error(results.status());
      size_t ok = 0;
      std::string first_error = "-";
      for (const client::OpResult& result : *results) {
        if (result.status.ok()) {
          ++ok;
        } else if (first_error == "-") {
          first_error = CodeName(result.status);
        }
      }
      return absl::StrCat("results ", ok, " ", first_error);
    }
    if (command == "submit_async" && need(6)) {
      v1::SubmitRequest request;
      v1::Op* op = request.add_ops();
      op->set_type(words[1] == "read" ? v1::OP_TYPE_READ_INTO_LOCAL
                                      : v1::OP_TYPE_WRITE_FROM_LOCAL);
      op->set_local_buffer_id(n[1]);
      op->set_local_offset(n[2]);
      op->set_length(n[3]);
      op->set_remote_offset(n[4]);
      if (!absl::Base64Unescape(words[6], op->mutable_remote_context())) {
        return "error INVALID_ARGUMENT bad base64";
      }
      grpc::ClientContext context;
      v1::SubmitAsyncResponse response;
      const absl::Status status =
          FromGrpcStatus(Stub().SubmitAsync(&context, request, &response));
      if (!status.ok()) return Error(status);
      return absl::StrCat("transfer ", response.transfer_id());
    }
    if (command == "notifications" && need(1)) {
      // "notifications N DATA,DATA,... dropped D": what GetNotifications
      // returned after waiting up to n[0] ms.
      auto batch = client_->GetNotifications(absl::Milliseconds(n[0]));
      if (!batch.ok()) return Error(batch.status());
      std::vector<std::string> data;
      for (const auto& notification : batch->notifications) {
        data.push_back(absl::CEscape(notification.data));
      }
      return absl::StrCat("notifications ", batch->notifications.size(), " ",
                          data.empty() ? "-" : absl::StrJoin(data, ","),
                          " dropped ", batch->dropped);
    }
    if (command == "transfer_get" && need(1)) {
      grpc::ClientContext context;
      v1::GetTransfersRequest request;
      request.add_transfer_ids(n[0]);
      v1::GetTransfersResponse response;
      const absl::Status status =
          FromGrpcStatus(Stub().GetTransfers(&context, request, &response));
      if (!status.ok()) return absl::StrCat("status ", CodeName(status));
      return absl::StrCat(
          "status OK ", v1::TransferState_Name(response.transfers(0).state()));
    }
    if (command == "transfer_cancel" && need(1)) {
      grpc::ClientContext context;
      v1::CancelTransferRequest request;
      request.set_transfer_id(n[0]);
      v1::CancelTransferResponse response;
      const absl::Status status =
          FromGrpcStatus(Stub().CancelTransfer(&context, request, &response));
      if (!status.ok()) return absl::StrCat("status ", CodeName(status));
      return absl::StrCat("status OK ",
                          v1::TransferState_Name(response.transfer().state()));
    }
    if (command == "transfer_detail" && need(2)) {
      std::vector<uint64_t> ids;
      for (absl::string_view word : absl::StrSplit(words[2], ',')) {
        uint64_t id = 0;
        if (!absl::SimpleAtoi(word, &id))
          return "error INVALID_ARGUMENT bad id";
        ids.push_back(id);
      }
      grpc::ClientContext context;
      std::vector<std::string> states;
      absl::Status status;
      if (words[1] == "cancel") {
        v1::CancelTransferRequest request;
        request.set_transfer_id(ids.front());
        v1::CancelTransferResponse response;
        status =
            FromGrpcStatus(Stub().CancelTransfer(&context, request, &response));
        states.push_back(v1::TransferState_Name(response.transfer().state()));
      } else {
        v1::GetTransfersRequest request;
        for (uint64_t id : ids) request.add_transfer_ids(id);
        v1::GetTransfersResponse response;
        status =
            FromGrpcStatus(Stub().GetTransfers(&context, request, &response));
        for (const v1::Transfer& transfer : response.transfers()) {
          states.push_back(v1::TransferState_Name(transfer.state()));
        }
      }
      if (!status.ok()) {
        return absl::StrCat("status ", CodeName(status), " ",
                            OneLine(status.message()));
      }
      return absl::StrCat("status OK ", absl::StrJoin(states, ","));
    }
    if (command == "transfer_watch" && need(1)) {
      grpc::ClientContext context;
      context.set_deadline(
          absl::ToChronoTime(absl::Now() + absl::Milliseconds(n[0])));
      auto stream =
          Stub().WatchTransfers(&context, v1::WatchTransfersRequest());
      std::vector<uint64_t> ids;
      v1::TransferEvent event;
      while (stream->Read(&event))
        ids.push_back(event.transfer().transfer_id());
      const absl::Status ended = FromGrpcStatus(stream->Finish());
      if (!ended.ok() && !absl::IsDeadlineExceeded(ended)) return Error(ended);
      return absl::StrCat("events ", absl::StrJoin(ids, ","));
    }
    if (command == "watch_start") return WatchStart();
    if (command == "watch_seen" && need(1)) {
      absl::MutexLock lock(&watch_seen_->mu);
      return watch_seen_->ids.count(n[0]) > 0 ? "seen" : "unseen";
    }
    if (command == "release" && need(1)) {
      auto it = buffers_.find(n[0]);
      if (it == buffers_.end()) {
        // Not ours (another user's id, or already released): ask anyway.
        return absl::StrCat("status ", CodeName(client_->Release(n[0])));
      }
      const absl::Status status = it->second.Release();
      buffers_.erase(it);
      return absl::StrCat("status ", CodeName(status));
    }
    if (command == "readbuf" && need(3)) {
      absl::StatusOr<std::string> data = client_->ReadBuffer(n[0], n[1], n[2]);
      if (!data.ok()) return absl::StrCat("status ", CodeName(data.status()));
      return absl::StrCat("status OK ", absl::BytesToHexString(*data));
    }
    if (command == "writebuf" && need(3)) {
      return absl::StrCat("status ",
                          CodeName(client_->WriteBuffer(
                              n[0], n[1], absl::HexStringToBytes(words[3]))));
    }
    if (command == "open" && need(1)) {
      v1::AttachRequest request;
      request.mutable_open()->set_buffer_id(n[0]);
      absl::StatusOr<client::internal::AttachReply> reply =
          client::internal::ExchangeOnAttachSocket(
              client_->attach_socket(), request, -1, absl::Seconds(30));
      if (!reply.ok()) return Error(reply.status());
      return absl::StrCat(
          "status ",
          CodeName(client::internal::ResponseStatus(reply->response)),
          reply->fd ? " fd" : " nofd");
    }
    if (command == "list" || command == "list_all") {
      absl::StatusOr<std::vector<v1::BufferInfo>> buffers =
          client_->ListBuffers(/*all_users=*/command == "list_all");
      if (!buffers.ok()) return Error(buffers.status());
      std::vector<uint64_t> ids;
      for (const v1::BufferInfo& info : *buffers)
        ids.push_back(info.buffer_id());
      return absl::StrCat("ids ", absl::StrJoin(ids, ","));
    }
    if (command == "import" && need(1)) {
      std::string context;
      if (!absl::Base64Unescape(words[1], &context)) {
        return "error INVALID_ARGUMENT bad base64";
      }
      absl::StatusOr<client::RemoteHandle> handle =
          client_->ImportRemote(context);
      if (!handle.ok()) return Error(handle.status());
      return absl::StrCat("handle ", handle->handle);
    }
    if (command == "release_remote" && need(1)) {
      return absl::StrCat("status ", CodeName(client_->ReleaseRemote(n[0])));
    }
    if (command == "remotes") {
      auto handles = client_->ListRemotes();
      if (!handles.ok()) return Error(handles.status());
      std::vector<uint64_t> ids;
      for (const client::RemoteHandle& handle : *handles) {
        ids.push_back(handle.handle);
      }
      return absl::StrCat("handles ", absl::StrJoin(ids, ","));
    }
    if ((command == "submit_handle" || command == "prepare") && need(6)) {
      client::OpSpec op;
      op.type = words[1] == "read" ? v1::OP_TYPE_READ_INTO_LOCAL
                                   : v1::OP_TYPE_WRITE_FROM_LOCAL;
      op.local_buffer_id = n[1];
      op.local_offset = n[2];
      op.length = n[3];
      op.remote_offset = n[4];
      op.remote_handle = n[5];
      if (command == "prepare") {
        absl::StatusOr<uint64_t> id = client_->PrepareTransfer({op});
        if (!id.ok()) return Error(id.status());
        return absl::StrCat("prepared ", *id);
      }
      client::SubmitOptions options;
      options.timeout = absl::Seconds(60);
      return OneResult(client_->Submit({op}, options));
    }
    if (command == "run_prepared" && need(1)) {
      client::SubmitOptions options;
      options.timeout = absl::Seconds(60);
      return OneResult(client_->SubmitPrepared(n[0], options));
    }
    if (command == "release_prepared" && need(1)) {
      return absl::StrCat("status ", CodeName(client_->ReleasePrepared(n[0])));
    }
    if (command == "ring_open" && need(1)) {
      auto ring = client_->OpenRing(static_cast<uint32_t>(n[0]));
      if (!ring.ok()) return Error(ring.status());
      ring_ = std::move(*ring);
      return "ok";
    }
    if (command == "ring_op" && need(6)) {
      if (ring_ == nullptr) return "error FAILED_PRECONDITION no ring";
      client::RingOp op;
      op.type = words[1] == "read" ? v1::OP_TYPE_READ_INTO_LOCAL
                                   : v1::OP_TYPE_WRITE_FROM_LOCAL;
      op.local_buffer_id = n[1];
      op.local_offset = n[2];
      op.length = n[3];
      op.remote_offset = n[4];
      op.remote_handle = n[5];
      if (absl::Status s = ring_->Submit({&op, 1}, absl::Seconds(60));
          !s.ok()) {
        return Error(s);
      }
      std::vector<client::RingCompletion> ends;
      auto got = ring_->Wait(&ends, absl::Seconds(60));
      if (!got.ok()) return Error(got.status());
      const client::RingCompletion& end = ends.at(0);
      return absl::StrCat("result ", CodeName(end.status), " ",
                          end.backend.empty() ? "-" : end.backend, " ",
                          OneLine(end.status.message()));
    }
    if (command == "info") {
      return absl::StrCat("status ", CodeName(client_->GetInfo().status()));
    }
    return absl::StrCat("error INVALID_ARGUMENT bad command: ", command);
  }

 private:
  // A raw stub on the client's channel, for RPCs the library does not wrap.
  v1::RdmaAgent::Stub& Stub() {
    if (stub_ == nullptr) stub_ = v1::RdmaAgent::NewStub(client_->channel());
    return *stub_;
  }

  std::string WatchStart() {
    if (!watch_.has_value() || !watch_->status().ok()) {
      watch_.reset();  // one the agent refused, if any
      absl::StatusOr<client::TransferWatch> watch = client_->WatchTransfers(
          [seen = watch_seen_](const client::TransferResult& end) {
            absl::MutexLock lock(&seen->mu);
            seen->ids.insert(end.id);
          });
      if (!watch.ok()) return Error(watch.status());
      watch_.emplace(std::move(*watch));
    }
    // Kept for the next watch_start (a retry after a refusal).
    while (watch_buffers_.size() < 2) {
      absl::StatusOr<Buffer> buffer =
          client_->Attach(4096, v1::ACCESS_READ_WRITE);
      if (!buffer.ok()) return Error(buffer.status());
      watch_buffers_.push_back(std::move(*buffer));
    }
    client::OpSpec op;
    op.type = v1::OP_TYPE_READ_INTO_LOCAL;
    op.local_buffer_id = watch_buffers_[1].id();
    op.length = 4096;
    op.remote_context = watch_buffers_[0].remote_context();
    absl::StatusOr<client::Transfer> transfer =
        client_->SubmitAsync({op}, absl::Seconds(30));
    if (!transfer.ok()) return Error(transfer.status());
    // Shared: a callback that comes after the 30 s below still has it.
    auto ended = std::make_shared<
        std::promise<absl::StatusOr<client::TransferResult>>>();
    std::future<absl::StatusOr<client::TransferResult>> end =
        ended->get_future();
    const absl::Status set = transfer->OnDone(
        [ended](absl::StatusOr<client::TransferResult> result) {
          ended->set_value(std::move(result));
        });
    if (!set.ok()) return Error(set);
    if (end.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
      return "error DEADLINE_EXCEEDED no OnDone callback within 30s";
    }
    absl::StatusOr<client::TransferResult> result = end.get();
    if (!result.ok()) return Error(result.status());
    return absl::StrCat("ok ", client::TransferStateName(result->state));
  }

  Buffer* Find(uint64_t id) {
    auto it = buffers_.find(id);
    return it == buffers_.end() ? nullptr : &it->second;
  }

  // Speaks the attach protocol by hand so that the memory can be taken away
  // from under the registration afterwards.
  std::string AttachAndDrop(uint64_t size, uint64_t seed) {
    absl::StatusOr<SharedMemory> memory = SharedMemory::Allocate(size, "drop");
    if (!memory.ok()) return Error(memory.status());
    FillPattern(absl::MakeSpan(memory->data(), memory->size()), seed);
    v1::AttachRequest request;
    request.mutable_attach();
    absl::StatusOr<client::internal::AttachReply> reply =
        client::internal::ExchangeOnAttachSocket(
            client_->attach_socket(), request, memory->fd(), absl::Seconds(30));
    if (!reply.ok()) return Error(reply.status());
    if (absl::Status status = client::internal::ResponseStatus(reply->response);
        !status.ok()) {
      return Error(status);
    }
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::RegisterRequest registration;
    registration.set_attach_token(reply->response.attach_token());
    registration.set_access(v1::ACCESS_READ_WRITE);
    v1::RegisterResponse response;
    // Raw, to see the agent's own error: a stub of our own on the client's
    // channel.
    grpc::Status status = v1::RdmaAgent::NewStub(client_->channel())
                              ->Register(&context, registration, &response);
    if (!status.ok()) {
      return absl::StrCat("error ", status.error_code(), " ",
                          OneLine(status.error_message()));
    }
    // The seal must refuse to shrink the memory under the agent.
    const int shrink = ::ftruncate(memory->fd(), 0);
    const std::string shrink_result =
        shrink == 0 ? "SHRUNK"
                    : (errno == EPERM ? "EPERM" : std::strerror(errno));
    // Unmap and close: the agent must not care.
    { SharedMemory dropped = std::move(*memory); }
    return absl::StrCat("ok ", response.buffer_id(), " ",
                        absl::Base64Escape(response.remote_context()), " ",
                        shrink_result);
  }

  std::unique_ptr<AgentClient> client_;
  std::unique_ptr<client::Ring> ring_;
  std::unique_ptr<v1::RdmaAgent::Stub> stub_;
  std::map<uint64_t, Buffer> buffers_;
  std::vector<Buffer> watch_buffers_;
  // Ends the watch delivered (written by its callback thread).
  struct Seen {
    absl::Mutex mu;
    std::set<uint64_t> ids ABSL_GUARDED_BY(mu);
  };
  std::shared_ptr<Seen> watch_seen_ = std::make_shared<Seen>();
  std::optional<client::TransferWatch> watch_;
};

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // Before any other thread exists: the whole process becomes that user.
  const int gid = absl::GetFlag(FLAGS_gid);
  const int uid = absl::GetFlag(FLAGS_uid);
  if (gid >= 0 && (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0)) {
    std::perror("setgid");
    return 3;
  }
  if (uid >= 0 && ::setuid(uid) != 0) {
    std::perror("setuid");
    return 3;
  }
  client::ConnectOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.attach_socket = absl::GetFlag(FLAGS_attach_socket);
  absl::StatusOr<std::unique_ptr<AgentClient>> client =
      AgentClient::Connect(options);
  if (!client.ok()) {
    std::cout << Error(client.status()) << std::endl;
    return 1;
  }
  std::cout << "ready " << ::getuid() << std::endl;
  Worker worker(std::move(*client));
  std::string line;
  while (std::getline(std::cin, line)) {
    std::vector<std::string> words =
        absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (words.empty()) continue;
    if (words[0] == "exit") return 0;
    std::cout << worker.Handle(words) << std::endl;
  }
  return 0;
}

}  // namespace
}  // namespace rdma_agent::testing

int main(int argc, char** argv) {
  return rdma_agent::testing::Main(argc, argv);
}
