// What mpx asks of a GPU once per device (its multiprocessor count; whether its memory
// pool was told to keep freed memory): one value per device number, made on first use,
// read without a lock afterwards. Plain C++: the host suite runs it, many threads at once.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <map>
#include <mutex>
#include <type_traits>

namespace mpx::detail {

template <class T>
class per_device {
  static_assert(std::is_trivially_copyable_v<T>, "per_device keeps small values, copied out on every read");

 public:
  //! The value of `device`, made by `make()` the first time any thread asks for it:
  //! threads asking at once wait for that one call (one lock serves every device, so a
  //! device being made holds up the first asks for the others too). A make() that throws
  //! stores nothing (the next call tries again). Devices 0 to 63 are read without a lock
  //! once made; the others always take the lock.
  template <class Make>
  T get(int device, Make&& make) {
    bool const fast = device >= 0 && device < static_cast<int>(fast_devices);
    if (fast && ready_[static_cast<std::size_t>(device)].load(std::memory_order_acquire))
      return values_[static_cast<std::size_t>(device)];
    std::lock_guard lock(mutex_);
    if (fast) {
      auto const d = static_cast<std::size_t>(device);
      if (ready_[d].load(std::memory_order_relaxed)) return values_[d];
      values_[d] = make();
      ready_[d].store(true, std::memory_order_release);
      return values_[d];
    }
    auto const known = others_.find(device);
    if (known != others_.end()) return known->second;
    return others_.emplace(device, make()).first->second;
  }

 private:
  static constexpr std::size_t fast_devices = 64;
  std::array<std::atomic<bool>, fast_devices> ready_{};
  std::array<T, fast_devices> values_{};
  std::mutex mutex_;        // held while a value is made
  std::map<int, T> others_;  // devices beyond the fast ones (a node with more than 64 GPUs)
};

}  // namespace mpx::detail
