// detail::per_device: what mpx asks of a GPU once per device (its multiprocessor count,
// its memory pool's setting), made once however many threads ask at once.
#include <mpx/exec/per_device.hpp>

#include "../support/testing.hpp"

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

TEST_CASE("per_device makes each device's value once, for every device number, under many threads",
          "[exec][per_device]") {
  mpx::detail::per_device<int> values;
  std::atomic<int> made{0};
  // Devices below 64 (read without a lock once made) and beyond (a map under the lock),
  // and a negative number, which is only a key.
  std::vector<int> const devices = {0, 1, 7, 63, 64, 65, 1000, -1};
  std::vector<std::thread> threads;
  std::atomic<bool> wrong{false};
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&] {
      for (int round = 0; round < 200; ++round)
        for (int d : devices) {
          int const v = values.get(d, [&] {
            made.fetch_add(1);
            std::this_thread::yield();  // widens the window in which another thread could make it again
            return 10 * d + 3;
          });
          if (v != 10 * d + 3) wrong = true;
        }
    });
  for (auto& t : threads) t.join();
  CHECK_FALSE(wrong.load());
  CHECK(made.load() == static_cast<int>(devices.size()));
}

TEST_CASE("per_device stores nothing when making the value throws, and tries again next time",
          "[exec][per_device]") {
  mpx::detail::per_device<bool> kept;
  for (int device : {2, 99}) {
    int calls = 0;
    CHECK_THROWS_AS(kept.get(device, [&]() -> bool { ++calls; throw std::runtime_error("the driver failed"); }),
                    std::runtime_error);
    CHECK(kept.get(device, [&] { ++calls; return true; }));
    CHECK(kept.get(device, [&] { ++calls; return false; }));  // made already: not asked again
    CHECK(calls == 2);
  }
}
