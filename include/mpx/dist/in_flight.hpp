// The collectives a communicator has started and not yet seen complete, oldest first,
// each with the time it was enqueued: what a collective's timeout is measured from.
// Plain C++ over any completion handle (a CUDA event in mpx::nccl_communicator), so the
// host suite runs the logic that finds a hung collective.
#pragma once

#include <mpx/dist/communicator.hpp>

#include <chrono>
#include <cstddef>
#include <deque>
#include <optional>
#include <string>
#include <utility>

namespace mpx::detail {

template <class Handle>
class in_flight_collectives {
 public:
  using clock = std::chrono::steady_clock;
  struct entry {
    std::string what;  //!< the collective, as errors name it
    clock::time_point enqueued;
    Handle done;
  };

  void push(std::string what, Handle done, clock::time_point enqueued = clock::now()) {
    entries_.push_back(entry{std::move(what), enqueued, std::move(done)});
  }

  //! Drops the completed collectives from the front, `is_done(handle)` saying whether
  //! one has completed (it may throw), and returns the oldest one still running, or null.
  //! The collectives complete in the order they were enqueued (the communicator's stream,
  //! and graph replays on the caller's, ordered with it by events), so the look ends at
  //! the first one running.
  template <class IsDone>
  [[nodiscard]] entry const* oldest_running(IsDone&& is_done) {
    while (!entries_.empty() && is_done(entries_.front().done)) entries_.pop_front();
    return entries_.empty() ? nullptr : &entries_.front();
  }

  //! Whether `e` has run for `timeout` or longer at `now` (milliseconds::max(): never).
  [[nodiscard]] static bool overdue(entry const& e, std::chrono::milliseconds timeout,
                                    clock::time_point now = clock::now()) {
    return waited_past(e.enqueued, timeout, now);
  }

  //! When the front collective was enqueued (the oldest not yet seen complete), if any.
  [[nodiscard]] std::optional<clock::time_point> oldest_enqueued() const {
    if (entries_.empty()) return std::nullopt;
    return entries_.front().enqueued;
  }

  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }

 private:
  std::deque<entry> entries_;
};

}  // namespace mpx::detail
