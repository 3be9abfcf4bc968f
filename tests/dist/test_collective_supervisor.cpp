// The logic that keeps a communicator's collectives from hanging a job or failing
// silently (dist/collective_supervisor.hpp), against a transport of the test's own: a
// collective's completion is a flag, an abort completes every collective (as NCCL's
// ends a hung kernel). mpx::nccl_communicator runs this same code with NCCL and CUDA.
#include "../support/testing.hpp"

#include <mpx/dist/collective_supervisor.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using mpx_test::eventually;
using mpx_test::thrown_message;

using namespace std::chrono_literals;

struct fake_transport {
  using event = std::shared_ptr<std::atomic<bool>>;  // set: the collective completed

  std::mutex mutex;
  std::string async;  // the asynchronous error it reports
  std::vector<event> issued;
  std::atomic<int> aborts{0};
  std::atomic<bool> query_fails{false};

  event issue() {
    auto e = std::make_shared<std::atomic<bool>>(false);
    std::lock_guard lock(mutex);
    issued.push_back(e);
    return e;
  }
  bool done(event const& e) {
    if (query_fails) throw mpx::error("cudaEventQuery failed: an illegal memory access was encountered");
    return e->load();
  }
  std::string async_error() {
    std::lock_guard lock(mutex);
    return async;
  }
  void abort() noexcept {
    ++aborts;
    std::lock_guard lock(mutex);
    for (auto const& e : issued) e->store(true);
  }
  void fail_async(std::string why) {
    std::lock_guard lock(mutex);
    async = std::move(why);
  }
};

using supervisor = mpx::detail::collective_supervisor<fake_transport>;
using event = fake_transport::event;

//! Enqueues a collective watched through `e` (or not watched, with no event).
std::string enqueue(supervisor& s, std::string what, std::optional<event> e = std::nullopt, bool look_first = true) {
  return s.enqueue(std::move(what), look_first, [&](std::string const&) { return e; });
}

}  // namespace

TEST_CASE("supervisor: collectives that complete pass every look, are numbered, and drain", "[dist]") {
  fake_transport t;
  supervisor s(t, "comm: rank 0", 1h);
  auto const first = t.issue();
  std::string seen;
  CHECK(s.enqueue("all_reduce (sum of 4 float32)", true, [&](std::string const& name) {
    seen = name;
    return std::optional(first);
  }) == "all_reduce (sum of 4 float32) #1");
  CHECK(seen == "all_reduce (sum of 4 float32) #1");
  CHECK(enqueue(s, "broadcast (8 bytes from rank 0)", t.issue()) == "broadcast (8 bytes from rank 0) #2");
  s.poll();
  for (auto const& e : t.issued) e->store(true);
  s.poll();
  CHECK(s.drained_within_timeout());
  CHECK_FALSE(s.aborted());
  CHECK(t.aborts == 0);
}

TEST_CASE("supervisor: a collective past its timeout aborts, and every later call throws its name", "[dist]") {
  fake_transport t;
  supervisor s(t, "comm: rank 1", 20ms);
  enqueue(s, "all_reduce (sum of 4 float32)", t.issue());
  std::this_thread::sleep_for(40ms);
  std::string const why =
      "comm: rank 1: all_reduce (sum of 4 float32) #1: not complete 20 ms after it was enqueued (a rank hung, died, or "
      "called another collective)";
  CHECK_THAT(thrown_message<mpx::collective_error>([&] { s.poll(); }), Catch::Equals(why));
  CHECK(t.aborts == 1);
  CHECK(s.aborted());
  bool called = false;
  CHECK_THAT(thrown_message<mpx::collective_error>([&] {
               s.enqueue("barrier", true, [&](std::string const&) {
                 called = true;
                 return std::optional<event>();
               });
             }),
             Catch::Equals(why + " (the communicator is aborted; end the job)"));
  CHECK_FALSE(called);
  CHECK_THROWS_AS(s.require_usable(), mpx::collective_error);
  CHECK_THROWS_AS(s.poll(), mpx::collective_error);
  CHECK(t.aborts == 1);               // aborted once
  CHECK(s.drained_within_timeout());  // the abort completed it
}

TEST_CASE("supervisor: an enqueue looks first, so a hung collective fails the next before its calls run", "[dist]") {
  fake_transport t;
  supervisor s(t, "comm: rank 2", 10ms);
  enqueue(s, "all_reduce (max of 1 float32)", t.issue());
  std::this_thread::sleep_for(30ms);
  bool called = false;
  CHECK_THAT(thrown_message<mpx::collective_error>([&] {
               s.enqueue("all_reduce (sum of 9 bfloat16)", true, [&](std::string const&) {
                 called = true;
                 return std::optional<event>();
               });
             }),
             Catch::Contains("all_reduce (max of 1 float32) #1: not complete"));
  CHECK_FALSE(called);
  CHECK(t.aborts == 1);
}

TEST_CASE("supervisor: a collective captured into a graph is not timed, but an asynchronous error is seen", "[dist]") {
  fake_transport t;
  supervisor s(t, "comm: rank 0", 10ms);
  enqueue(s, "all_reduce (sum of 4 half)", std::nullopt, false);  // captured: no event to watch
  std::this_thread::sleep_for(30ms);
  s.poll();
  // A capture makes no queries: an enqueue there does not look at one overdue before it.
  fake_transport t2;
  supervisor s2(t2, "comm: rank 0", 10ms);
  enqueue(s2, "all_reduce (sum of 4 half)", t2.issue());  // hung, outside the capture
  std::this_thread::sleep_for(30ms);
  bool called = false;
  s2.enqueue("all_reduce (sum of 8 half)", false, [&](std::string const&) {
    called = true;
    return std::optional<event>();
  });
  CHECK(called);
  CHECK(t2.aborts == 0);
  t.fail_async("unhandled system error");
  CHECK_THAT(thrown_message<mpx::collective_error>([&] { s.poll(); }),
             Catch::Equals("comm: rank 0: a collective (replayed from a CUDA graph?): unhandled system error"));
  CHECK(t.aborts == 1);
}

TEST_CASE("supervisor: an asynchronous error names the oldest collective still running", "[dist]") {
  fake_transport t;
  supervisor s(t, "comm: rank 3", 1h);
  auto const completed = t.issue();
  enqueue(s, "broadcast (4 bytes from rank 0)", completed);
  enqueue(s, "all_reduce (sum of 2 float32)", t.issue());
  completed->store(true);
  t.fail_async("remote process exited or there was a network error");
  CHECK_THAT(thrown_message<mpx::collective_error>([&] { s.poll(); }),
             Catch::Equals(
                 "comm: rank 3: all_reduce (sum of 2 float32) #2: remote process exited or there was a network error"));
}

TEST_CASE("supervisor: a failure while a collective is enqueued aborts, with what failed", "[dist]") {
  fake_transport t;
  supervisor s(t, "comm: rank 0", 1h);
  CHECK_THAT(thrown_message<std::runtime_error>([&] {
               s.enqueue("all_gather (2 values)", true, [](std::string const&) -> std::optional<event> {
                 throw std::runtime_error("cudaMemcpyAsync failed: invalid argument");
               });
             }),
             Catch::Equals("cudaMemcpyAsync failed: invalid argument"));
  CHECK(t.aborts == 1);
  CHECK_THAT(thrown_message<mpx::collective_error>([&] { s.poll(); }),
             Catch::Equals("comm: rank 0: all_gather (2 values) #1: failed while it was enqueued: cudaMemcpyAsync "
                           "failed: invalid argument (the communicator is aborted; end the job)"));

  // A collective_error from the calls (NCCL refusing the call) is the reason as
  // it stands.
  fake_transport t2;
  supervisor s2(t2, "comm: rank 0", 1h);
  CHECK_THROWS_AS(s2.enqueue("broadcast (4 bytes from rank 0)", true,
                             [](std::string const&) -> std::optional<event> {
                               throw mpx::collective_error("ncclBroadcast failed: invalid usage", {});
                             }),
                  mpx::collective_error);
  CHECK_THAT(thrown_message<mpx::collective_error>([&] { s2.require_usable(); }),
             Catch::Equals("ncclBroadcast failed: invalid usage (the communicator is aborted; end the job)"));
}

TEST_CASE("supervisor: the watchdog aborts a hung collective while the host waits on the GPU behind it", "[dist]") {
  fake_transport t;
  supervisor s(t, "comm: rank 1", 30ms);
  std::atomic<bool> started{false};
  std::thread::id watch_thread;
  s.watch([&] {
    watch_thread = std::this_thread::get_id();
    started = true;
  });
  auto const hung = t.issue();
  enqueue(s, "all_reduce (sum of 1024 float32)", hung);
  // The host blocks in a wait for the GPU (a batch upload behind the
  // collective); only the watchdog's abort ends it.
  REQUIRE(eventually([&] { return hung->load(); }));
  CHECK(t.aborts == 1);
  CHECK(started);
  CHECK(watch_thread != std::this_thread::get_id());
  CHECK_THAT(thrown_message<mpx::collective_error>([&] { s.poll(); }),
             Catch::Contains("all_reduce (sum of 1024 float32) #1: not complete 30 ms after it was enqueued"));
}

TEST_CASE("supervisor: the watchdog looks a second time before it aborts", "[dist]") {
  fake_transport t;
  supervisor s(t, "comm: rank 0", 10ms);  // no watch(): the test is the watchdog
  auto const slow = t.issue();
  enqueue(s, "all_reduce (sum of 8 float32)", slow);
  std::this_thread::sleep_for(30ms);
  std::string const first = s.watchdog_look();
  CHECK_THAT(first, Catch::Contains("all_reduce (sum of 8 float32) #1: not complete"));
  slow->store(true);  // completed since the first look
  CHECK_FALSE(s.watchdog_stop(first));
  CHECK(t.aborts == 0);
  s.poll();

  auto const hung = t.issue();
  enqueue(s, "all_reduce (sum of 2 float32)", hung);
  std::this_thread::sleep_for(30ms);
  CHECK(s.watchdog_stop(s.watchdog_look()));
  CHECK(t.aborts == 1);
  CHECK(s.watchdog_look().empty());  // aborted: nothing more to say
  CHECK(s.watchdog_stop("again"));   // and nothing more to do
  CHECK(t.aborts == 1);
}

TEST_CASE("supervisor: the watchdog takes a failed completion query as its reason", "[dist]") {
  fake_transport t;
  supervisor s(t, "comm: rank 0", 1h);
  enqueue(s, "all_reduce (sum of 8 float32)", t.issue());
  t.query_fails = true;
  CHECK_THROWS_AS(s.poll(), mpx::error);  // the caller gets the query's own error
  CHECK(t.aborts == 0);
  CHECK(s.watchdog_stop("the first look's reason"));  // the second look's is the one kept
  CHECK(t.aborts == 1);
  CHECK_THAT(thrown_message<mpx::collective_error>([&] { s.require_usable(); }),
             Catch::Equals("comm: rank 0: cudaEventQuery failed: an illegal memory access was encountered (the "
                           "communicator is aborted; end the job)"));
  CHECK_FALSE(s.drained_within_timeout());
}

namespace {

//! A gate a collective's calls wait at, as NCCL's enqueue waits for room on a
//! GPU that a hung collective holds.
struct gate {
  std::mutex mutex;
  std::condition_variable changed;
  bool open = false;
  void pass() {
    std::unique_lock lock(mutex);
    changed.wait(lock, [&] { return open; });
  }
  void release() {
    {
      std::lock_guard lock(mutex);
      open = true;
    }
    changed.notify_all();
  }
};

}  // namespace

TEST_CASE("supervisor: a caller stuck in an enqueue behind a hung collective ends the process", "[dist]") {
  fake_transport t;
  gate enqueue_gate;
  std::atomic<int> ended{0};
  supervisor s(t, "comm: rank 2", 20ms, [&] {
    ++ended;
    enqueue_gate.release();  // (a test goes on; the real one is std::abort)
  });
  enqueue(s, "all_reduce (sum of 4 float32)", t.issue());  // hung
  std::atomic<bool> inside{false};
  std::thread caller([&] {
    try {
      s.enqueue("all_reduce (sum of 8 float32)", false, [&](std::string const&) {
        inside = true;
        enqueue_gate.pass();
        return std::optional<event>();
      });
    } catch (...) {
      inside = true;  // (seen below: nothing ends it)
    }
  });
  bool const entered = eventually([&] { return inside.load(); });
  if (entered) s.watch();  // from now on it finds the lock held
  bool const stopped = entered && eventually([&] { return ended > 0; });
  enqueue_gate.release();
  caller.join();
  REQUIRE(entered);
  REQUIRE(stopped);
  s.stop_watching();
  CHECK(ended == 1);
  CHECK(t.aborts == 0);  // the transport's calls may not race an abort
}

TEST_CASE("supervisor: a first collective's slow enqueue (connection setup) is not a hang", "[dist]") {
  fake_transport t;
  std::atomic<int> ended{0};
  supervisor s(t, "comm: rank 0", 10ms, [&] { ++ended; });
  s.watch();
  auto const done = t.issue();
  done->store(true);
  s.enqueue("all_reduce (sum of 4 float32)", true, [&](std::string const&) {
    std::this_thread::sleep_for(150ms);  // fifteen timeouts, nothing in flight before it
    return std::optional(done);
  });
  std::this_thread::sleep_for(50ms);
  s.stop_watching();
  CHECK(ended == 0);
  CHECK(t.aborts == 0);
  s.poll();
}

TEST_CASE("supervisor: a wait returns once done, and fails past the timeout or on an asynchronous error", "[dist]") {
  {
    fake_transport t;
    supervisor s(t, "comm: rank 0", 1h);
    int looks = 0;
    s.wait("barrier #1", [&] { return ++looks == 3; });
    CHECK(looks == 3);
  }
  {
    fake_transport t;
    supervisor s(t, "comm: rank 0", 20ms);
    CHECK_THAT(thrown_message<mpx::collective_error>([&] { s.wait("all_reduce (sum of 1 values) #4", [] { return false; }); }),
               Catch::Equals("comm: rank 0: all_reduce (sum of 1 values) #4: not complete after 20 ms"));
    CHECK(t.aborts == 1);
  }
  {
    fake_transport t;
    supervisor s(t, "comm: rank 0", 1h);
    int looks = 0;
    CHECK_THAT(thrown_message<mpx::collective_error>([&] {
                 s.wait("all_gather (3 values) #2", [&] {
                   if (++looks == 2) t.fail_async("unhandled cuda error");
                   return false;
                 });
               }),
               Catch::Equals("comm: rank 0: all_gather (3 values) #2: unhandled cuda error"));
  }
  {
    // An aborted collective's stream completes too: a wait that ends after the
    // watchdog aborted throws the watchdog's reason.
    fake_transport t;
    supervisor s(t, "comm: rank 0", 10ms);
    enqueue(s, "all_reduce (sum of 4 float32)", t.issue());  // hung
    std::this_thread::sleep_for(30ms);
    REQUIRE(s.watchdog_stop(s.watchdog_look()));
    CHECK(t.aborts == 1);
    CHECK_THAT(thrown_message<mpx::collective_error>([&] { s.wait("barrier #2", [] { return true; }); }),
               Catch::Equals("comm: rank 0: all_reduce (sum of 4 float32) #1: not complete 10 ms after it was "
                             "enqueued (a rank hung, died, or called another collective) (the communicator is "
                             "aborted; end the job)"));
  }
}

TEST_CASE("supervisor: draining waits for the collectives in flight at most the timeout", "[dist]") {
  {
    fake_transport t;
    supervisor s(t, "comm: rank 0", 10s);
    auto const late = t.issue();
    enqueue(s, "all_reduce (sum of 4 float32)", late);
    std::thread finisher([&] {
      std::this_thread::sleep_for(5ms);
      late->store(true);
    });
    bool const drained = s.drained_within_timeout();
    finisher.join();
    CHECK(drained);
  }
  fake_transport t;
  supervisor s(t, "comm: rank 0", 30ms);
  enqueue(s, "all_reduce (sum of 8 float32)", t.issue());
  auto const start = std::chrono::steady_clock::now();
  CHECK_FALSE(s.drained_within_timeout());
  CHECK(std::chrono::steady_clock::now() - start >= 30ms);
  CHECK(t.aborts == 0);  // the owner decides: it aborts instead of destroying
}
