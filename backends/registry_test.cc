// The backend registry: ordering, all-or-nothing registration, routing to the
// best common backend and the one retry on UNAVAILABLE.
#include "backends/registry.h"

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "backends/testing/harness.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rdma_agent {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Counts live registrations so tests can see rollbacks.
class CountedState : public BackendRegistration {
 public:
  explicit CountedState(std::atomic<int>* live) : live_(live) { ++*live_; }
  ~CountedState() override { --*live_; }

 private:
  std::atomic<int>* live_;
};

// A scripted backend: reaches contexts that advertise its name, and answers
// each op with the next status of its script (OK when the script is empty).
class FakeBackend : public Backend {
 public:
  FakeBackend(std::string name, v1::TransportLevel level, bool available = true)
      : name_(std::move(name)), level_(level), available_(available) {}

  const std::string& name() const override { return name_; }
  v1::TransportLevel transport_level() const override { return level_; }
  bool available() const override { return available_; }
  v1::TransportInfo transport_info() const override { return {}; }

  absl::StatusOr<std::unique_ptr<BackendRegistration>> Register(
      const Registration&, v1::BackendEndpoint*) override {
    ++register_calls;
    if (!register_error.ok()) return register_error;
    return std::make_unique<CountedState>(&live);
  }
  bool CanReach(const v1::RemoteBuffer& remote) const override {
    return FindEndpoint(remote, name_) != nullptr;
  }
  // Ends every batch inside Post.
  void Post(absl::Span<const Op> ops, const StopToken&, OpsDone done) override {
    std::vector<absl::Status> results;
    for (const Op& op : ops) {
      // The registry hands over the route it chose: this backend's entry.
      EXPECT_NE(op.endpoint, nullptr);
      EXPECT_EQ(op.endpoint, FindEndpoint(*op.remote, name_));
      submitted.push_back(op.index);
      if (on_op) on_op(op);
      if (script.empty()) {
        results.push_back(absl::OkStatus());
      } else {
        results.push_back(script.front());
        script.erase(script.begin());
      }
    }
    std::move(done)(std::move(results));
  }

  absl::Status register_error;
  std::vector<absl::Status> script;
  // Runs for each op as the backend takes it.
  std::function<void(const Op&)> on_op;
  std::vector<size_t> submitted;
  std::atomic<int> live{0};
  int register_calls = 0;

 private:
  const std::string name_;
  const v1::TransportLevel level_;
  const bool available_;
};

// A backend whose Post only keeps the batch: the test ends it later, from
// a thread of its choosing (FakeBackend ends every batch inside Post).
class HeldBackend : public FakeBackend {
 public:
  using FakeBackend::FakeBackend;

  void Post(absl::Span<const Op> ops, const StopToken& stop,
            OpsDone done) override {
    Posted posted{{}, stop, std::move(done), std::this_thread::get_id()};
    for (const Op& op : ops) {
      EXPECT_EQ(op.endpoint, FindEndpoint(*op.remote, name()));
      posted.indices.push_back(op.index);
    }
    absl::MutexLock lock(&mu_);
    posted_.push_back(std::move(posted));
    ++posts_;
  }

  // Waits until `count` batches were posted in all.
  bool AwaitPosts(int count) {
    absl::MutexLock lock(&mu_);
    auto posted = [this, count]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return posts_ >= count;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&posted), absl::Seconds(30));
  }
  int posts() {
    absl::MutexLock lock(&mu_);
    return posts_;
  }
  // The op indices and posting thread of the oldest batch not ended.
  std::vector<size_t> HeldIndices() {
    absl::MutexLock lock(&mu_);
    return posted_.empty() ? std::vector<size_t>() : posted_.front().indices;
  }
  std::thread::id HeldPostedOn() {
    absl::MutexLock lock(&mu_);
    return posted_.front().thread;
  }
  // The StopToken the oldest batch not ended was posted with.
  StopToken HeldStop() {
    absl::MutexLock lock(&mu_);
    return posted_.front().stop;
  }
  // Ends the oldest batch not ended, on this thread: `statuses` first, OK
  // for the ops past them.
  void EndNext(std::vector<absl::Status> statuses = {}) {
    Posted posted;
    {
      absl::MutexLock lock(&mu_);
      ASSERT_FALSE(posted_.empty());
      posted = std::move(posted_.front());
      posted_.pop_front();
    }
    statuses.resize(posted.indices.size(), absl::OkStatus());
    std::move(posted.done)(std::move(statuses));
  }

 private:
  struct Posted {
    std::vector<size_t> indices;
    StopToken stop = absl::InfiniteFuture();
    OpsDone done;
    std::thread::id thread;
  };
  absl::Mutex mu_;
  std::deque<Posted> posted_ ABSL_GUARDED_BY(mu_);
  int posts_ ABSL_GUARDED_BY(mu_) = 0;
};

// What a PostInPlace's done was given, and where and how often it ran.
struct Ended {
  std::atomic<int> calls{0};
  std::vector<OpOutcome> outcomes;
  std::thread::id thread;
  absl::Notification notified;

  BackendRegistry::OutcomesDone Done() {
    return [this](std::vector<OpOutcome> outcomes_given) {
      if (calls.fetch_add(1) > 0) return;
      outcomes = std::move(outcomes_given);
      thread = std::this_thread::get_id();
      notified.Notify();
    };
  }
  // Waits for done; true when it came exactly once.
  bool Wait() {
    if (!notified.WaitForNotificationWithTimeout(absl::Seconds(30))) {
      return false;
    }
    absl::SleepFor(absl::Milliseconds(1));  // a second call shows at once
    return calls.load() == 1;
  }
};

std::shared_ptr<Registration> MakeRegistration() {
  auto memory = SharedMemory::Allocate(4096, "test");
  EXPECT_TRUE(memory.ok());
  return std::make_shared<Registration>(1, 0, v1::ACCESS_READ_WRITE, "", "t",
                                        std::move(*memory), true);
}

std::shared_ptr<const v1::RemoteBuffer> Advertising(
    std::vector<std::string> backends) {
  auto remote = std::make_shared<v1::RemoteBuffer>();
  for (const auto& name : backends) remote->add_endpoints()->set_backend(name);
  return remote;
}

// A one-byte read into `local` from `remote`, not yet routed.
Op ReadOp(size_t index, std::shared_ptr<const v1::RemoteBuffer> remote,
          std::shared_ptr<Registration> local) {
  Op op = testing::MakeOp(index, v1::OP_TYPE_READ_INTO_LOCAL,
                          testing::TestBuffer{std::move(local), nullptr}, 0, 1,
                          testing::TestBuffer{nullptr, std::move(remote)}, 0);
  op.endpoint = nullptr;  // BackendRegistry::Submit chooses it
  return op;
}

struct Fakes {
  FakeBackend* tcp;
  FakeBackend* nic;
  FakeBackend* memory;
  std::unique_ptr<BackendRegistry> registry;
};

Fakes MakeRegistry(bool nic_available = true) {
  auto tcp = std::make_unique<FakeBackend>("tcp", v1::TRANSPORT_LEVEL_TCP);
  auto nic = std::make_unique<FakeBackend>("nic", v1::TRANSPORT_LEVEL_NIC,
                                           nic_available);
  auto memory =
      std::make_unique<FakeBackend>("memory", v1::TRANSPORT_LEVEL_MEMORY);
  Fakes fakes{tcp.get(), nic.get(), memory.get(), nullptr};
  std::vector<std::unique_ptr<Backend>> backends;
  backends.push_back(std::move(tcp));
  backends.push_back(std::move(nic));
  backends.push_back(std::move(memory));
  fakes.registry = std::make_unique<BackendRegistry>(std::move(backends));
  return fakes;
}

TEST(BackendRegistryTest, OrdersBackendsFastestFirst) {
  Fakes fakes = MakeRegistry();
  std::vector<std::string> names;
  for (const auto& backend : fakes.registry->backends()) {
    names.push_back(backend->name());
  }
  EXPECT_THAT(names, ElementsAre("memory", "nic", "tcp"));
  EXPECT_EQ(fakes.registry->Find("nic"), fakes.nic);
  EXPECT_EQ(fakes.registry->Find("none"), nullptr);
}

TEST(BackendRegistryTest, RegistersWithEveryAvailableBackend) {
  Fakes fakes = MakeRegistry(/*nic_available=*/false);
  auto registration = MakeRegistration();
  v1::RemoteBuffer context;
  ASSERT_TRUE(fakes.registry->RegisterWithAll(*registration, &context).ok());
  EXPECT_THAT(registration->backend_names(), ElementsAre("memory", "tcp"));
  ASSERT_EQ(context.endpoints_size(), 2);
  EXPECT_EQ(context.endpoints(0).backend(), "memory");
  EXPECT_EQ(context.endpoints(1).backend(), "tcp");
  EXPECT_EQ(fakes.nic->register_calls, 0);
  EXPECT_NE(registration->backend_state("tcp"), nullptr);
  EXPECT_EQ(registration->backend_state("nic"), nullptr);
  // State lives exactly as long as the registration.
  EXPECT_EQ(fakes.tcp->live.load(), 1);
  registration.reset();
  EXPECT_EQ(fakes.tcp->live.load(), 0);
  EXPECT_EQ(fakes.memory->live.load(), 0);
}

TEST(BackendRegistryTest, RollsBackWhenOneBackendFails) {
  Fakes fakes = MakeRegistry();
  fakes.tcp->register_error = absl::ResourceExhaustedError("no ports left");
  auto registration = MakeRegistration();
  v1::RemoteBuffer context;
  absl::Status status =
      fakes.registry->RegisterWithAll(*registration, &context);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("tcp"));
  EXPECT_EQ(fakes.memory->live.load(), 0) << "memory was not rolled back";
  EXPECT_EQ(fakes.nic->live.load(), 0) << "nic was not rolled back";
  EXPECT_TRUE(registration->backend_names().empty());
  EXPECT_EQ(context.endpoints_size(), 0);
}

TEST(BackendRegistryTest, RoutesEachOpToTheBestCommonBackend) {
  Fakes fakes = MakeRegistry();
  auto local = MakeRegistration();
  std::vector<Op> ops = {
      ReadOp(0, Advertising({"tcp"}), local),
      ReadOp(1, Advertising({"tcp", "nic"}), local),
      ReadOp(2, Advertising({"memory", "nic", "tcp"}), local),
      ReadOp(3, Advertising({"elsewhere"}), local),
  };
  auto outcomes = fakes.registry->Submit(ops, absl::Now() + absl::Seconds(5));
  ASSERT_EQ(outcomes.size(), 4u);
  EXPECT_EQ(outcomes[0].backend, "tcp");
  EXPECT_EQ(outcomes[1].backend, "nic");
  EXPECT_EQ(outcomes[2].backend, "memory");
  EXPECT_TRUE(outcomes[0].status.ok());
  EXPECT_EQ(outcomes[3].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(outcomes[3].status.message(), HasSubstr("op 3"));
  EXPECT_THAT(outcomes[3].status.message(), HasSubstr("elsewhere"));
  EXPECT_THAT(fakes.tcp->submitted, ElementsAre(0));
  EXPECT_THAT(fakes.nic->submitted, ElementsAre(1));
  EXPECT_THAT(fakes.memory->submitted, ElementsAre(2));
}

// Routes are worked out once per distinct context of a batch: ops sharing
// a context, interleaved with ops of others, still each go to their own
// context's best backend with their own context's endpoint (FakeBackend
// checks the endpoint of every op it gets).
TEST(BackendRegistryTest, RoutesInterleavedSharedContextsEachByItsOwn) {
  Fakes fakes = MakeRegistry();
  auto local = MakeRegistration();
  auto near = Advertising({"memory", "tcp"});
  auto far = Advertising({"tcp", "nic"});
  auto nowhere = Advertising({"elsewhere"});
  std::vector<Op> ops = {
      ReadOp(0, near, local), ReadOp(1, near, local),    ReadOp(2, far, local),
      ReadOp(3, near, local), ReadOp(4, nowhere, local), ReadOp(5, far, local),
      ReadOp(6, far, local),  ReadOp(7, near, local),
  };
  auto outcomes = fakes.registry->Submit(ops, absl::Now() + absl::Seconds(5));
  ASSERT_EQ(outcomes.size(), ops.size());
  for (size_t i : {0, 1, 3, 7}) EXPECT_EQ(outcomes[i].backend, "memory") << i;
  for (size_t i : {2, 5, 6}) EXPECT_EQ(outcomes[i].backend, "nic") << i;
  EXPECT_EQ(outcomes[4].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(outcomes[4].status.message(), HasSubstr("op 4"));
  EXPECT_THAT(fakes.memory->submitted, ElementsAre(0, 1, 3, 7));
  EXPECT_THAT(fakes.nic->submitted, ElementsAre(2, 5, 6));
  EXPECT_TRUE(fakes.tcp->submitted.empty());
}

// SubmitInPlace routes the caller's own ops: a run of consecutive ops for
// one backend goes over as it lies, scattered ones as copies, and each op
// is left with the entry of the backend that ran it last (the retry's).
TEST(BackendRegistryTest, SubmitInPlaceRoutesTheCallersOps) {
  Fakes fakes = MakeRegistry();
  fakes.nic->script = {absl::OkStatus(), absl::UnavailableError("link down")};
  auto local = MakeRegistration();
  auto near = Advertising({"memory", "tcp"});
  auto far = Advertising({"nic", "tcp"});
  std::vector<Op> ops = {
      ReadOp(0, near, local), ReadOp(1, near, local), ReadOp(2, near, local),
      ReadOp(3, far, local),  ReadOp(4, far, local),  ReadOp(5, near, local),
  };
  auto outcomes = fakes.registry->SubmitInPlace(absl::MakeSpan(ops),
                                                absl::Now() + absl::Seconds(5));
  ASSERT_EQ(outcomes.size(), ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    EXPECT_TRUE(outcomes[i].status.ok()) << i << ": " << outcomes[i].status;
  }
  EXPECT_THAT(fakes.memory->submitted, ElementsAre(0, 1, 2, 5));
  EXPECT_THAT(fakes.nic->submitted, ElementsAre(3, 4));
  EXPECT_THAT(fakes.tcp->submitted, ElementsAre(4));
  EXPECT_EQ(outcomes[4].backend, "tcp");
  EXPECT_EQ(outcomes[4].retried_from, "nic");
  for (size_t i : {0, 1, 2, 5}) {
    EXPECT_EQ(ops[i].endpoint, FindEndpoint(*near, "memory")) << i;
  }
  EXPECT_EQ(ops[3].endpoint, FindEndpoint(*far, "nic"));
  EXPECT_EQ(ops[4].endpoint, FindEndpoint(*far, "tcp"));
}

TEST(BackendRegistryTest, SkipsUnavailableBackendsWhenRouting) {
  Fakes fakes = MakeRegistry(/*nic_available=*/false);
  auto outcomes = fakes.registry->Submit(
      {ReadOp(0, Advertising({"nic", "tcp"}), MakeRegistration())},
      absl::Now() + absl::Seconds(5));
  EXPECT_EQ(outcomes[0].backend, "tcp");
  EXPECT_TRUE(fakes.nic->submitted.empty());
}

TEST(BackendRegistryTest, RetriesUnavailableOnceOnTheNextBackend) {
  Fakes fakes = MakeRegistry();
  fakes.nic->script = {absl::UnavailableError("link down"),
                       absl::PermissionDeniedError("bad key")};
  auto local = MakeRegistration();
  auto outcomes =
      fakes.registry->Submit({ReadOp(0, Advertising({"nic", "tcp"}), local),
                              ReadOp(1, Advertising({"nic", "tcp"}), local)},
                             absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(outcomes[0].status.ok()) << outcomes[0].status;
  EXPECT_EQ(outcomes[0].backend, "tcp");
  EXPECT_EQ(outcomes[0].retried_from, "nic") << "for the retry metric";
  // Only UNAVAILABLE is retried.
  EXPECT_EQ(outcomes[1].status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(outcomes[1].backend, "nic");
  EXPECT_EQ(outcomes[1].retried_from, "");
  EXPECT_THAT(outcomes[1].status.message(), HasSubstr("op 1: bad key"));
  EXPECT_THAT(fakes.tcp->submitted, ElementsAre(0));
}

TEST(BackendRegistryTest, RetriesAtMostOnce) {
  Fakes fakes = MakeRegistry();
  fakes.memory->script = {absl::UnavailableError("one")};
  fakes.nic->script = {absl::UnavailableError("two")};
  auto outcomes = fakes.registry->Submit(
      {ReadOp(0, Advertising({"memory", "nic", "tcp"}), MakeRegistration())},
      absl::Now() + absl::Seconds(5));
  EXPECT_EQ(outcomes[0].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(outcomes[0].backend, "nic");
  EXPECT_TRUE(fakes.tcp->submitted.empty());
}

TEST(BackendRegistryTest, DoesNotRetryAfterTheDeadline) {
  Fakes fakes = MakeRegistry();
  fakes.nic->script = {absl::UnavailableError("link down")};
  auto outcomes = fakes.registry->Submit(
      {ReadOp(0, Advertising({"nic", "tcp"}), MakeRegistration())},
      absl::Now() - absl::Seconds(1));
  EXPECT_EQ(outcomes[0].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(fakes.tcp->submitted.empty());
}

TEST(BackendRegistryTest, DoesNotRetryOnceCancelled) {
  Fakes fakes = MakeRegistry();
  fakes.nic->script = {absl::UnavailableError("link down")};
  Cancellation cancellation;
  cancellation.Cancel(absl::CancelledError("client went away"));
  auto outcomes = fakes.registry->Submit(
      {ReadOp(0, Advertising({"nic", "tcp"}), MakeRegistration())},
      StopToken(absl::Now() + absl::Seconds(5), &cancellation));
  EXPECT_EQ(outcomes[0].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(fakes.tcp->submitted.empty());
}

// Spins (bounded) until the coarse clock reads later than `nanos`.
void WaitForCoarseClockPast(int64_t nanos) {
  for (int i = 0; i < 10000 && CoarseNowNanos() <= nanos; ++i) {
    absl::SleepFor(absl::Microseconds(500));
  }
  ASSERT_GT(CoarseNowNanos(), nanos);
}

TEST(BackendRegistryTest, StampsLocalBuffersUsedWhenOpsStartAndEnd) {
  Fakes fakes = MakeRegistry();
  auto local = MakeRegistration();
  const int64_t created = local->create_time_nanos();
  WaitForCoarseClockPast(created);
  int64_t seen_by_backend = 0;
  fakes.tcp->on_op = [&](const Op& op) {
    seen_by_backend = op.local->last_use_nanos();
    WaitForCoarseClockPast(seen_by_backend);
  };
  // Failed ops count too: the buffer was the local side of an op.
  fakes.tcp->script = {absl::DataLossError("scripted")};
  auto outcomes =
      fakes.registry->Submit({ReadOp(0, Advertising({"tcp"}), local)},
                             StopToken(absl::Now() + absl::Seconds(5)));
  ASSERT_EQ(outcomes[0].status.code(), absl::StatusCode::kDataLoss);
  EXPECT_GT(seen_by_backend, created) << "stamped when the op started";
  EXPECT_GT(local->last_use_nanos(), seen_by_backend)
      << "stamped again when it ended";
}

// Backends of three speeds, the given ones held (HeldBackend), the others
// ending every batch inside Post.
struct Mixed {
  FakeBackend* tcp;
  FakeBackend* nic;
  FakeBackend* memory;
  std::unique_ptr<BackendRegistry> registry;
};

Mixed MakeMixed(bool held_tcp, bool held_nic, bool held_memory) {
  auto make = [](bool held, std::string name,
                 v1::TransportLevel level) -> std::unique_ptr<FakeBackend> {
    if (held) return std::make_unique<HeldBackend>(std::move(name), level);
    return std::make_unique<FakeBackend>(std::move(name), level);
  };
  auto tcp = make(held_tcp, "tcp", v1::TRANSPORT_LEVEL_TCP);
  auto nic = make(held_nic, "nic", v1::TRANSPORT_LEVEL_NIC);
  auto memory = make(held_memory, "memory", v1::TRANSPORT_LEVEL_MEMORY);
  Mixed mixed{tcp.get(), nic.get(), memory.get(), nullptr};
  std::vector<std::unique_ptr<Backend>> backends;
  backends.push_back(std::move(tcp));
  backends.push_back(std::move(nic));
  backends.push_back(std::move(memory));
  mixed.registry = std::make_unique<BackendRegistry>(std::move(backends));
  return mixed;
}

HeldBackend& Held(FakeBackend* backend) {
  return *static_cast<HeldBackend*>(backend);
}

// Every backend ends its share inside Post: so does PostInPlace, on the
// caller's thread.
TEST(BackendRegistryPostTest, EndsInsidePostWhenEveryShareDoes) {
  Mixed mixed = MakeMixed(false, false, false);
  auto local = MakeRegistration();
  std::vector<Op> ops = {ReadOp(0, Advertising({"memory", "tcp"}), local),
                         ReadOp(1, Advertising({"nic", "tcp"}), local)};
  Ended ended;
  mixed.registry->PostInPlace(absl::MakeSpan(ops),
                              absl::Now() + absl::Seconds(5), ended.Done());
  EXPECT_TRUE(ended.notified.HasBeenNotified()) << "ended inside PostInPlace";
  ASSERT_TRUE(ended.Wait());
  EXPECT_EQ(ended.thread, std::this_thread::get_id());
  ASSERT_EQ(ended.outcomes.size(), 2u);
  EXPECT_EQ(ended.outcomes[0].backend, "memory");
  EXPECT_EQ(ended.outcomes[1].backend, "nic");
  // An empty batch ends at once too.
  Ended empty;
  mixed.registry->PostInPlace({}, absl::Now() + absl::Seconds(5), empty.Done());
  ASSERT_TRUE(empty.Wait());
  EXPECT_TRUE(empty.outcomes.empty());
}

// A batch spanning two backends: PostInPlace returns with the slower share
// still out, and done comes when it ends, on the thread that ended it, with
// every outcome in order and each share's own latency.
TEST(BackendRegistryPostTest, ABatchOnTwoBackendsEndsWhenTheSlowerOneDoes) {
  Mixed mixed = MakeMixed(false, /*held_nic=*/true, false);
  auto local = MakeRegistration();
  auto near = Advertising({"memory", "tcp"});
  auto far = Advertising({"nic", "tcp"});
  std::vector<Op> ops = {ReadOp(0, far, local), ReadOp(1, near, local),
                         ReadOp(2, far, local), ReadOp(3, near, local),
                         ReadOp(4, Advertising({"elsewhere"}), local)};
  mixed.memory->script = {absl::OkStatus(), absl::NotFoundError("gone")};
  Ended ended;
  mixed.registry->PostInPlace(absl::MakeSpan(ops),
                              absl::Now() + absl::Seconds(5), ended.Done());
  EXPECT_THAT(mixed.memory->submitted, ElementsAre(1, 3));
  ASSERT_TRUE(Held(mixed.nic).AwaitPosts(1));
  EXPECT_THAT(Held(mixed.nic).HeldIndices(), ElementsAre(0, 2));
  // Scattered ops went over as copies, each with the nic's entry in place.
  EXPECT_EQ(ops[0].endpoint, FindEndpoint(*far, "nic"));
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_FALSE(ended.notified.HasBeenNotified()) << "the nic's share is out";
  std::thread::id ender;
  std::thread end([&] {
    ender = std::this_thread::get_id();
    Held(mixed.nic).EndNext({absl::OkStatus(), absl::DataLossError("torn")});
  });
  end.join();
  ASSERT_TRUE(ended.Wait());
  EXPECT_EQ(ended.thread, ender);
  const auto& outcomes = ended.outcomes;
  ASSERT_EQ(outcomes.size(), ops.size());
  EXPECT_TRUE(outcomes[0].status.ok()) << outcomes[0].status;
  EXPECT_TRUE(outcomes[1].status.ok()) << outcomes[1].status;
  EXPECT_EQ(outcomes[2].status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(outcomes[2].status.message(), HasSubstr("op 2: torn"));
  EXPECT_EQ(outcomes[3].status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(outcomes[3].status.message(), HasSubstr("op 3: gone"));
  EXPECT_EQ(outcomes[4].status.code(), absl::StatusCode::kUnavailable);
  for (size_t i : {0, 2}) EXPECT_EQ(outcomes[i].backend, "nic") << i;
  for (size_t i : {1, 3}) EXPECT_EQ(outcomes[i].backend, "memory") << i;
  EXPECT_GE(outcomes[0].latency, absl::Milliseconds(30));
  EXPECT_EQ(outcomes[0].latency, outcomes[2].latency) << "the share's";
  EXPECT_LT(outcomes[1].latency, outcomes[0].latency);
}

// An op that ended UNAVAILABLE is posted again on its next backend from the
// thread that ended its share, before the batch ends; retried ops carry
// the next backend's entry.
TEST(BackendRegistryPostTest, RetriesFromTheCompletionThreadOnTheNextBackend) {
  Mixed mixed = MakeMixed(/*held_tcp=*/true, /*held_nic=*/true, false);
  auto local = MakeRegistration();
  auto far = Advertising({"nic", "tcp"});
  std::vector<Op> ops = {ReadOp(0, far, local), ReadOp(1, far, local),
                         ReadOp(2, far, local)};
  Ended ended;
  mixed.registry->PostInPlace(absl::MakeSpan(ops),
                              absl::Now() + absl::Seconds(5), ended.Done());
  ASSERT_TRUE(Held(mixed.nic).AwaitPosts(1));
  std::thread::id ender;
  std::thread end([&] {
    ender = std::this_thread::get_id();
    Held(mixed.nic).EndNext({absl::UnavailableError("link down"),
                             absl::OkStatus(),
                             absl::UnavailableError("link down")});
  });
  end.join();
  ASSERT_TRUE(Held(mixed.tcp).AwaitPosts(1));
  EXPECT_THAT(Held(mixed.tcp).HeldIndices(), ElementsAre(0, 2));
  EXPECT_EQ(Held(mixed.tcp).HeldPostedOn(), ender);
  EXPECT_FALSE(ended.notified.HasBeenNotified()) << "the retry is out";
  EXPECT_EQ(ops[0].endpoint, FindEndpoint(*far, "tcp"));
  EXPECT_EQ(ops[1].endpoint, FindEndpoint(*far, "nic"));
  // The retry fails UNAVAILABLE too: no third attempt.
  Held(mixed.tcp).EndNext({absl::OkStatus(), absl::UnavailableError("down")});
  ASSERT_TRUE(ended.Wait());
  EXPECT_EQ(ended.thread, std::this_thread::get_id());
  const auto& outcomes = ended.outcomes;
  EXPECT_TRUE(outcomes[0].status.ok()) << outcomes[0].status;
  EXPECT_EQ(outcomes[0].backend, "tcp");
  EXPECT_EQ(outcomes[0].retried_from, "nic");
  EXPECT_EQ(outcomes[1].backend, "nic");
  EXPECT_EQ(outcomes[1].retried_from, "");
  EXPECT_EQ(outcomes[2].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(outcomes[2].backend, "tcp");
  EXPECT_EQ(Held(mixed.tcp).posts(), 1);
  EXPECT_EQ(Held(mixed.nic).posts(), 1);
}

// Cancelled while a share is out: the share ends with the cancellation's
// reason (as a backend does), an UNAVAILABLE it reports is not retried any
// more, and done still comes once with every outcome.
TEST(BackendRegistryPostTest, CancelWhileAShareIsOutstanding) {
  Mixed mixed = MakeMixed(false, /*held_nic=*/true, false);
  auto local = MakeRegistration();
  auto far = Advertising({"nic", "tcp"});
  std::vector<Op> ops = {ReadOp(0, far, local),
                         ReadOp(1, Advertising({"memory"}), local),
                         ReadOp(2, far, local)};
  Cancellation cancellation;
  Ended ended;
  mixed.registry->PostInPlace(
      absl::MakeSpan(ops),
      StopToken(absl::Now() + absl::Seconds(5), &cancellation), ended.Done());
  ASSERT_TRUE(Held(mixed.nic).AwaitPosts(1));
  cancellation.Cancel(absl::CancelledError("client went away"));
  EXPECT_FALSE(ended.notified.HasBeenNotified());
  const StopToken held_stop = Held(mixed.nic).HeldStop();
  ASSERT_TRUE(held_stop.cancelled()) << "the share sees the batch's token";
  std::thread end([&] {
    Held(mixed.nic).EndNext(
        {held_stop.StopStatus("x"), absl::UnavailableError("link down")});
  });
  end.join();
  ASSERT_TRUE(ended.Wait());
  const auto& outcomes = ended.outcomes;
  EXPECT_EQ(outcomes[0].status.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(outcomes[0].status.message(), HasSubstr("client went away"));
  EXPECT_TRUE(outcomes[1].status.ok()) << outcomes[1].status;
  EXPECT_EQ(outcomes[2].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(mixed.tcp->submitted.empty()) << "no retry once cancelled";
}

// Shares ending at the same moment on two threads: done comes exactly once
// per batch, after both, whichever ends last.
TEST(BackendRegistryPostTest, SharesEndingTogetherEndTheBatchOnce) {
  Mixed mixed = MakeMixed(/*held_tcp=*/true, /*held_nic=*/true, false);
  auto local = MakeRegistration();
  auto by_nic = Advertising({"nic"});
  auto by_tcp = Advertising({"tcp"});
  for (int round = 0; round < 200; ++round) {
    std::vector<Op> ops = {ReadOp(0, by_nic, local), ReadOp(1, by_tcp, local)};
    Ended ended;
    mixed.registry->PostInPlace(absl::MakeSpan(ops),
                                absl::Now() + absl::Seconds(5), ended.Done());
    ASSERT_TRUE(Held(mixed.nic).AwaitPosts(round + 1));
    ASSERT_TRUE(Held(mixed.tcp).AwaitPosts(round + 1));
    absl::Notification go;
    std::thread a([&] {
      go.WaitForNotification();
      Held(mixed.nic).EndNext({absl::DataLossError("nic")});
    });
    std::thread b([&] {
      go.WaitForNotification();
      Held(mixed.tcp).EndNext();
    });
    go.Notify();
    a.join();
    b.join();
    ASSERT_TRUE(ended.Wait()) << "round " << round;
    ASSERT_EQ(ended.outcomes.size(), 2u);
    EXPECT_EQ(ended.outcomes[0].status.code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(ended.outcomes[0].backend, "nic");
    EXPECT_TRUE(ended.outcomes[1].status.ok());
    EXPECT_EQ(ended.outcomes[1].backend, "tcp");
  }
}

TEST(RegistrationTest, MemoryOutlivesReleaseWhileAnOpPinsIt) {
  auto registration = MakeRegistration();
  std::memset(registration->data(), 'q', 4096);
  Op op = ReadOp(0, Advertising({"tcp"}), registration);
  std::weak_ptr<Registration> watch = registration;
  registration.reset();  // the directory's reference is gone: "released"
  ASSERT_FALSE(watch.expired());
  EXPECT_EQ(static_cast<char>(op.local->data()[4095]), 'q');
  op.local.reset();
  EXPECT_TRUE(watch.expired());
}

}  // namespace
}  // namespace rdma_agent
