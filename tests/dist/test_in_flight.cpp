// The in-flight list nccl_communicator::poll() finds a hung collective with: completed
// collectives leave from the front, the oldest one running is the one a timeout names,
// and one is overdue only past its timeout.
#include "../support/testing.hpp"

#include <mpx/dist/in_flight.hpp>

#include <chrono>
#include <set>
#include <stdexcept>
#include <string>

TEST_CASE("in-flight collectives: the oldest one running is found, the completed ones before it dropped", "[dist]") {
  using list = mpx::detail::in_flight_collectives<int>;
  list in_flight;
  auto const t0 = list::clock::now();
  for (int i = 0; i < 4; ++i) in_flight.push("all_reduce #" + std::to_string(i + 1), i, t0 + std::chrono::seconds(i));
  std::set<int> done;
  auto const is_done = [&](int handle) { return done.contains(handle); };

  CHECK(in_flight.oldest_enqueued() == t0);
  REQUIRE(in_flight.oldest_running(is_done) != nullptr);
  CHECK(in_flight.oldest_running(is_done)->what == "all_reduce #1");
  CHECK(in_flight.size() == 4);

  done = {0, 2};  // #3 completed too, but #2 still runs: #2 is the oldest running, #3 stays
  auto const* oldest = in_flight.oldest_running(is_done);
  REQUIRE(oldest != nullptr);
  CHECK(oldest->what == "all_reduce #2");
  CHECK(in_flight.size() == 3);

  // Overdue only past the timeout, measured from when it was enqueued (one second after t0).
  CHECK_FALSE(list::overdue(*oldest, std::chrono::milliseconds(500), t0 + std::chrono::milliseconds(1400)));
  CHECK(list::overdue(*oldest, std::chrono::milliseconds(500), t0 + std::chrono::milliseconds(1600)));
  CHECK_FALSE(list::overdue(*oldest, std::chrono::milliseconds::max(), t0 + std::chrono::hours(24 * 365)));

  CHECK(in_flight.oldest_enqueued() == t0 + std::chrono::seconds(1));
  done = {0, 1, 2, 3};
  CHECK(in_flight.oldest_running(is_done) == nullptr);
  CHECK_FALSE(in_flight.oldest_enqueued().has_value());
  CHECK(in_flight.size() == 0);
}

TEST_CASE("in-flight collectives: a failing completion query leaves the list as it was", "[dist]") {
  mpx::detail::in_flight_collectives<int> in_flight;
  in_flight.push("broadcast #1", 7);
  auto const failing = [](int) -> bool { throw std::runtime_error("the event query failed"); };
  CHECK_THROWS_AS(static_cast<void>(in_flight.oldest_running(failing)), std::runtime_error);
  CHECK(in_flight.size() == 1);
}
