// A watchdog for a communicator's collectives: a thread that asks, every `period`,
// whether the communicator must stop (a collective ran past its timeout, or failed), and
// hands the first reason to `stop_with`, which aborts the communicator. Without it a
// hung collective is only found when the host next calls the communicator; a host
// blocked in a wait for the GPU (a batch upload, a step's record) behind the hung kernel
// would never call again. (PyTorch's NCCL process group keeps such a thread too.) And a
// deadline for one blocking call that nothing can abort (NCCL's communicator init,
// which waits for every rank). Plain C++: the host suite runs both.
#pragma once

#include <mpx/dist/communicator.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace mpx::detail {

class collective_watchdog {
 public:
  //! `check()` returns why the communicator must stop, or "" while all is well; an
  //! exception it throws is a reason too (its what()). `stop_with(why)` acts on it, on
  //! the watchdog's thread, and returns whether it did (false: the reason had passed by
  //! then, and the watch goes on); once it did, the thread ends. `on_start()`, if given,
  //! runs first on that thread (to make the communicator's device current there).
  collective_watchdog(std::chrono::milliseconds period, std::function<std::string()> check,
                      std::function<bool(std::string const&)> stop_with, std::function<void()> on_start = {})
      : thread_([this, period, check = std::move(check), stop_with = std::move(stop_with),
                 on_start = std::move(on_start)] {
          if (on_start) on_start();
          std::unique_lock lock(mutex_);
          while (!wake_.wait_for(lock, period, [this] { return stopping_; })) {
            lock.unlock();
            std::string why;
            try {
              why = check();
            } catch (std::exception const& e) {
              why = e.what();
            }
            if (!why.empty() && stop_with(why)) return;  // (stop_with must not throw)
            lock.lock();
          }
        }) {}

  //! Stops the thread and waits for it (at most one check's time).
  ~collective_watchdog() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  collective_watchdog(collective_watchdog const&) = delete;
  collective_watchdog& operator=(collective_watchdog const&) = delete;

  //! How often to look, for a collective timeout: a tenth of it, between 10 ms and 1 s.
  static std::chrono::milliseconds period_for(std::chrono::milliseconds timeout) noexcept {
    auto const tenth = timeout / 10;
    if (tenth < std::chrono::milliseconds(10)) return std::chrono::milliseconds(10);
    if (tenth > std::chrono::milliseconds(1000)) return std::chrono::milliseconds(1000);
    return tenth;
  }

 private:
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;  // last: it starts once the members above exist
};

//! Runs `call()` on this thread and returns what it returns (an exception passes
//! through). If it has not returned `timeout` after it began, a collective_watchdog
//! (looking every tenth of the timeout, at most every second) says `why` on stderr and
//! calls `end_process` (std::abort by default, so that the job's launcher ends the job):
//! for a blocking library call that cannot be aborted and would otherwise wait for ever,
//! such as NCCL's communicator init waiting for a rank that never comes.
//! milliseconds::max() waits for ever. `end_process` must not return, but for a test's.
template <class Call>
decltype(auto) end_process_unless_returns_within(std::chrono::milliseconds timeout, std::string why, Call&& call,
                                                 std::function<void()> end_process = [] { std::abort(); }) {
  auto const start = std::chrono::steady_clock::now();
  // Destroyed on every way out of the call, which stops it at once.
  collective_watchdog const watch(
      collective_watchdog::period_for(timeout),
      [&] { return waited_past(start, timeout) ? why : std::string(); },
      [&](std::string const& reason) {
        std::fprintf(stderr, "%s; ending the process\n", reason.c_str());
        std::fflush(stderr);
        end_process();
        return true;
      });
  return call();
}

}  // namespace mpx::detail
