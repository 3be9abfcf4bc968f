// What keeps a communicator's collectives from hanging a job or failing silently, apart
// from the transport that runs them: the lock that the caller's thread and the watchdog
// share, the collectives in flight, the timeout, the abort, and the reason every later
// call throws. mpx::nccl_communicator gives it NCCL and CUDA as the transport; it is plain
// C++, so the host suite runs this logic against a transport of its own.
#pragma once

#include <mpx/dist/communicator.hpp>
#include <mpx/dist/in_flight.hpp>
#include <mpx/dist/watchdog.hpp>

#include <atomic>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

namespace mpx::detail {

//! What a supervisor needs of a transport: `done(e)`, whether the collective whose
//! completion event is `e` has completed (it throws when it cannot tell);
//! `async_error()`, the transport's asynchronous error or "" (NCCL's
//! ncclCommGetAsyncError); `abort()`, which ends its collectives, hung ones too, without
//! waiting for any other rank (ncclCommAbort).
template <class T>
concept collective_transport = requires(T& t, typename T::event const& e) {
  { t.done(e) } -> std::same_as<bool>;
  { t.async_error() } -> std::same_as<std::string>;
  { t.abort() } noexcept;
};

template <collective_transport Transport>
class collective_supervisor {
 public:
  using event = typename Transport::event;
  using clock = std::chrono::steady_clock;

  //! `name` begins every message ("mpx::nccl_communicator: rank 3"). `end_process` is
  //! what the watchdog does when the caller is stuck inside a collective's enqueue (see
  //! stuck_in_enqueue): std::abort by default, so that the job's launcher ends the job.
  //! It must not return (only a test's does): the watchdog stops after it.
  collective_supervisor(Transport& transport, std::string name, std::chrono::milliseconds timeout,
                        std::function<void()> end_process = [] { std::abort(); })
      : transport_(transport), name_(std::move(name)), timeout_(timeout), end_process_(std::move(end_process)) {}
  ~collective_supervisor() { stop_watching(); }
  collective_supervisor(collective_supervisor const&) = delete;
  collective_supervisor& operator=(collective_supervisor const&) = delete;

  //! Starts the watchdog thread: every tenth of the timeout (at most every second) it
  //! looks (watchdog_look) and aborts (watchdog_stop). `on_start` runs first on it.
  void watch(std::function<void()> on_start = {}) {
    watchdog_ = std::make_unique<collective_watchdog>(
        collective_watchdog::period_for(timeout_), [this] { return watchdog_look(); },
        [this](std::string const& why) { return watchdog_stop(why); }, std::move(on_start));
  }
  //! Stops the watchdog and waits for its thread: nothing aborts behind the caller's back
  //! after this.
  void stop_watching() noexcept { watchdog_.reset(); }

  //! Enqueues a collective, under the lock (so the watchdog never aborts the transport in
  //! the middle of it), after making sure that the communicator is usable and, when
  //! `look_first`, that no collective failed or ran past the timeout. `calls(name)` makes
  //! the transport's calls for the collective called `name` (`what` and its sequence
  //! number) and returns its completion event to watch, or nullopt (a collective captured
  //! into a CUDA graph, whose event cannot be queried, or one the caller waits for
  //! itself). Once the calls began, a failure aborts the transport, since the ranks may
  //! no longer agree on what was enqueued. Returns the name.
  template <class Calls>
  std::string enqueue(std::string what, bool look_first, Calls&& calls) {
    std::lock_guard lock(mutex_);
    require_usable_locked();
    if (look_first)
      if (std::string why = why_stop_locked(); !why.empty()) fail_locked(why);
    what += " #" + std::to_string(++sequence_);
    std::optional<event> done;
    try {
      enqueue_mark const marked(*this);
      done = calls(std::as_const(what));
    } catch (std::exception const& e) {
      abort_locked(dynamic_cast<collective_error const*>(&e)
                       ? std::string(e.what())
                       : name_ + ": " + what + ": failed while it was enqueued: " + e.what());
      throw;
    }
    if (done) in_flight_.push(what, std::move(*done));
    return what;
  }

  //! Waits for the collective `what` (one not in flight: a host-value collective's copy
  //! back), `is_done()` saying whether it completed (called without the lock; it may
  //! throw), at most the timeout, reading the transport's asynchronous errors as it goes.
  //! Then makes sure the watchdog did not abort meanwhile: an aborted collective
  //! completes too.
  template <class IsDone>
  void wait(std::string const& what, IsDone&& is_done) {
    auto const start = clock::now();
    for (;;) {
      bool const done = is_done();
      {
        std::lock_guard lock(mutex_);  // not held while sleeping: the watchdog takes it too
        require_usable_locked();
        if (done) return;
        if (std::string const error = transport_.async_error(); !error.empty()) fail_locked(what + ": " + error);
        if (waited_past(start, timeout_))
          fail_locked(what + ": not complete after " + std::to_string(timeout_.count()) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  //! Looks at the collectives in flight: one that failed, or ran past the timeout,
  //! aborts the transport and throws collective_error naming it. Never waits.
  void poll() {
    std::lock_guard lock(mutex_);
    require_usable_locked();
    if (std::string why = why_stop_locked(); !why.empty()) fail_locked(why);
  }
  //! Throws collective_error with the reason if the transport was aborted.
  void require_usable() const {
    std::lock_guard lock(mutex_);
    require_usable_locked();
  }
  //! `f()` under the lock (to read what an abort changes, such as the transport's handle).
  template <class F>
  decltype(auto) locked(F&& f) const {
    std::lock_guard lock(mutex_);
    return f();
  }
  [[nodiscard]] bool aborted() const {
    std::lock_guard lock(mutex_);
    return broken_;
  }

  //! Whether every collective in flight completed within the timeout (false too when
  //! one cannot be queried): for a destructor, choosing between ending the transport
  //! with the other ranks and aborting it.
  [[nodiscard]] bool drained_within_timeout() noexcept {
    auto const start = clock::now();
    for (;;) {
      try {
        std::lock_guard lock(mutex_);
        if (in_flight_.oldest_running([&](event const& e) { return transport_.done(e); }) == nullptr) return true;
      } catch (...) {
        return false;
      }
      if (waited_past(start, timeout_)) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  //! The watchdog's look (on its thread): why to stop, or "". The caller holds the lock
  //! only while it enqueues; stuck there past the timeout is a reason too.
  std::string watchdog_look() {
    std::unique_lock lock(mutex_, std::try_to_lock);
    if (!lock) return stuck_in_enqueue();
    return broken_ ? std::string() : why_stop_locked();
  }
  //! The watchdog's stop: a second look under the lock (a collective may have completed
  //! since the first), then the abort, which ends the hung collective, so a host waiting
  //! behind it goes on; the next call throws the reason, also said at once on stderr. A
  //! caller stuck inside an enqueue holds the lock, and the transport's calls may not
  //! race an abort: end_process is called instead, after saying why. Returns whether it
  //! stopped (false: the reason had passed, watch on).
  bool watchdog_stop(std::string const& /*the first look's reason, looked at again*/) noexcept {
    std::unique_lock lock(mutex_, std::try_to_lock);
    if (!lock) {
      std::string const stuck = stuck_in_enqueue();
      if (stuck.empty()) return false;
      std::fprintf(stderr, "%s: %s; ending the process\n", name_.c_str(), stuck.c_str());
      std::fflush(stderr);
      end_process_();
      return true;
    }
    if (broken_) return true;
    std::string now;
    try {
      now = why_stop_locked();
    } catch (std::exception const& e) {
      now = e.what();
    }
    if (now.empty()) return false;
    abort_locked(name_ + ": " + now);
    std::fprintf(stderr, "%s (aborted by the watchdog)\n", failure_.c_str());
    return true;
  }

 private:
  // Why the communicator must stop now, or "": the transport reports an asynchronous
  // error (also for collectives no list holds: those a CUDA graph replays), or the oldest
  // collective in flight ran past the timeout. Under the lock; throws when a completion
  // cannot be queried.
  std::string why_stop_locked() {
    auto const* const oldest = in_flight_.oldest_running([&](event const& e) { return transport_.done(e); });
    std::string const which = oldest ? oldest->what : std::string("a collective (replayed from a CUDA graph?)");
    if (std::string const error = transport_.async_error(); !error.empty()) return which + ": " + error;
    if (oldest && in_flight_.overdue(*oldest, timeout_))
      return oldest->what + ": not complete " + std::to_string(timeout_.count()) +
             " ms after it was enqueued (a rank hung, died, or called another collective)";
    return "";
  }

  // "" unless the caller has been inside a collective's enqueue for longer than the
  // timeout while a collective enqueued before it was still running: the evidence of a
  // hang (NCCL's enqueue waits for room on a GPU that a hung collective holds). A first
  // collective's lazy connection setup, inside its enqueue, has none before it and never
  // counts.
  std::string stuck_in_enqueue() const {
    auto const at = [](std::int64_t ticks) { return clock::time_point(clock::duration(ticks)); };
    std::int64_t const since = enqueue_started_.load(), behind = enqueue_behind_.load();
    // (behind <= since: the collective before it has been running longer still)
    if (since == 0 || behind == 0 || !waited_past(at(since), timeout_)) return "";
    return "a collective's enqueue has not returned " + std::to_string(timeout_.count()) +
           " ms after it began, behind a collective enqueued longer ago than that (the GPU cannot take more work "
           "behind a hung collective)";
  }
  // Marks, while an enqueue's calls run (under the lock), when they began and when the
  // oldest collective in flight before them was enqueued, for stuck_in_enqueue.
  struct enqueue_mark {
    collective_supervisor& s;
    explicit enqueue_mark(collective_supervisor& owner) : s(owner) {
      auto const behind = s.in_flight_.oldest_enqueued();
      s.enqueue_behind_.store(behind ? behind->time_since_epoch().count() : 0);
      s.enqueue_started_.store(clock::now().time_since_epoch().count());
    }
    ~enqueue_mark() { s.enqueue_started_.store(0); }
    enqueue_mark(enqueue_mark const&) = delete;
    enqueue_mark& operator=(enqueue_mark const&) = delete;
  };

  void require_usable_locked() const {
    if (broken_)
      throw collective_error(failure_ + " (the communicator is aborted; end the job)", {});
  }
  void abort_locked(std::string message) noexcept {
    broken_ = true;
    failure_ = std::move(message);
    transport_.abort();
  }
  [[noreturn]] void fail_locked(std::string const& why) {
    abort_locked(name_ + ": " + why);
    throw collective_error(failure_, {});
  }

  Transport& transport_;
  std::string name_;
  std::chrono::milliseconds timeout_;
  std::function<void()> end_process_;
  // The watchdog's thread and the caller's share the transport, broken_, failure_ and
  // in_flight_.
  mutable std::mutex mutex_;
  in_flight_collectives<event> in_flight_;
  long long sequence_ = 0;
  std::atomic<std::int64_t> enqueue_started_{0};  // clock ticks; 0: no enqueue running
  std::atomic<std::int64_t> enqueue_behind_{0};   // the oldest collective in flight then; 0: none
  bool broken_ = false;
  std::string failure_;  // why it broke, for every later call
  std::unique_ptr<collective_watchdog> watchdog_;  // last: destroyed (joined) first
};

}  // namespace mpx::detail
