// The watchdog of a communicator's collectives (dist/watchdog.hpp): it looks every period,
// hands the first reason to stop (or a check's exception) to stop_with exactly once and
// ends, and its destructor stops it at once, whatever the period.
#include "../support/testing.hpp"

#include <mpx/dist/watchdog.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

//! What stop_with received, and a way to wait for it.
struct stops {
  std::mutex mutex;
  std::condition_variable arrived;
  std::vector<std::string> reasons;
  bool add(std::string const& why) {
    std::lock_guard lock(mutex);
    reasons.push_back(why);
    arrived.notify_all();
    return true;
  }
  bool wait_for(std::size_t count, std::chrono::seconds limit) {
    std::unique_lock lock(mutex);
    return arrived.wait_for(lock, limit, [&] { return reasons.size() >= count; });
  }
};

}  // namespace

TEST_CASE("the watchdog looks every period and stops once, with the first reason", "[dist]") {
  std::atomic<int> checks{0};
  stops seen;
  std::thread::id started_on;
  {
    mpx::detail::collective_watchdog dog(
        std::chrono::milliseconds(5),
        [&] { return ++checks >= 3 ? "all_reduce #7: not complete 1000 ms after it was enqueued" : std::string(); },
        [&](std::string const& why) { return seen.add(why); }, [&] { started_on = std::this_thread::get_id(); });
    REQUIRE(seen.wait_for(1, std::chrono::seconds(10)));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // it ended: no more looks
  }
  CHECK(checks == 3);
  REQUIRE(seen.reasons.size() == 1);
  CHECK(seen.reasons[0] == "all_reduce #7: not complete 1000 ms after it was enqueued");
  CHECK(started_on != std::thread::id{});
  CHECK(started_on != std::this_thread::get_id());
}

TEST_CASE("the watchdog takes a check's exception as its reason", "[dist]") {
  stops seen;
  mpx::detail::collective_watchdog dog(
      std::chrono::milliseconds(5), []() -> std::string { throw std::runtime_error("cudaEventQuery failed"); },
      [&](std::string const& why) { return seen.add(why); });
  REQUIRE(seen.wait_for(1, std::chrono::seconds(10)));
  CHECK(seen.reasons == std::vector<std::string>{"cudaEventQuery failed"});
}

TEST_CASE("the watchdog keeps watching when the reason passed before it could act", "[dist]") {
  std::atomic<int> checks{0};
  stops seen;
  {
    mpx::detail::collective_watchdog dog(
        std::chrono::milliseconds(5), [&] { return "overdue #" + std::to_string(++checks); },
        [&](std::string const& why) {
          seen.add(why);
          return seen.reasons.size() >= 2;  // the first time, the collective had completed meanwhile
        });
    REQUIRE(seen.wait_for(2, std::chrono::seconds(10)));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  CHECK(seen.reasons == std::vector<std::string>{"overdue #1", "overdue #2"});
  CHECK(checks == 2);
}

TEST_CASE("the watchdog stops at once when destroyed, and stops nothing while all is well", "[dist]") {
  std::atomic<int> checks{0};
  stops seen;
  auto const start = std::chrono::steady_clock::now();
  {
    mpx::detail::collective_watchdog dog(
        std::chrono::hours(1), [&] { return ++checks, std::string(); }, [&](std::string const& why) { return seen.add(why); });
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  CHECK(checks == 0);
  CHECK(seen.reasons.empty());
  using mpx::detail::collective_watchdog;
  using std::chrono::milliseconds;
  CHECK(collective_watchdog::period_for(std::chrono::minutes(5)) == milliseconds(1000));
  CHECK(collective_watchdog::period_for(milliseconds(1000)) == milliseconds(100));
  CHECK(collective_watchdog::period_for(milliseconds(50)) == milliseconds(10));
  CHECK(collective_watchdog::period_for(milliseconds::max()) == milliseconds(1000));
}

TEST_CASE("a blocking call past its deadline ends the process, once, with the reason", "[dist]") {
  std::atomic<int> ended{0};
  std::atomic<bool> release{false};
  auto const start = std::chrono::steady_clock::now();
  int const got = mpx::detail::end_process_unless_returns_within(
      std::chrono::milliseconds(20), "ncclCommInitRank has not returned", [&] {
        // A rank that never joins (for ten seconds at most: a failing test must end).
        while (!release && std::chrono::steady_clock::now() - start < std::chrono::seconds(10))
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        return 7;
      },
      [&] {
        ++ended;
        release = true;  // (a test goes on; the real one is std::abort)
      });
  CHECK(got == 7);
  CHECK(ended == 1);
  CHECK(std::chrono::steady_clock::now() - start >= std::chrono::milliseconds(20));
}

TEST_CASE("a blocking call within its deadline returns at once, its value or its exception", "[dist]") {
  std::atomic<int> ended{0};
  auto const never = [&] { ++ended; };
  auto const start = std::chrono::steady_clock::now();
  CHECK(mpx::detail::end_process_unless_returns_within(std::chrono::hours(1), "init", [] { return 3; }, never) == 3);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));  // not the hour, nor a 1 s slice
  CHECK_THROWS_WITH(mpx::detail::end_process_unless_returns_within(
                        std::chrono::milliseconds::max(), "init",
                        []() -> int { throw std::runtime_error("ncclCommInitRank failed: invalid usage"); }, never),
                    "ncclCommInitRank failed: invalid usage");
  mpx::detail::end_process_unless_returns_within(std::chrono::milliseconds::max(), "init", [] {}, never);
  CHECK(ended == 0);
}
