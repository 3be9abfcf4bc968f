// The host kernels' per-thread scratch (detail::host_scratch_floats): each (tag, slot)
// owns its buffer, a buffer grows on demand, and each thread has its own; and
// detail::host_floats_of, which widens through it (or hands float data back as is); and
// detail::stream_registry, the bookkeeping of the GPU's per-stream workspaces.
#include "../support/testing.hpp"

#include <mpx/core/cast.hpp>
#include <mpx/exec/host_scratch.hpp>
#include <mpx/exec/stream_registry.hpp>

#include <cmath>
#include <limits>
#include <thread>
#include <vector>

namespace {
struct first_kernel {};
struct second_kernel {};
}  // namespace

TEST_CASE("host scratch: one buffer per tag, slot and thread", "[host_scratch]") {
  using mpx::detail::host_scratch_floats;
  float* a0 = host_scratch_floats<first_kernel, 0>(100);
  float* a1 = host_scratch_floats<first_kernel, 1>(100);
  float* a7 = host_scratch_floats<first_kernel, 7>(100);  // any number of slots
  float* b0 = host_scratch_floats<second_kernel, 0>(100);
  CHECK(a0 != a1);
  CHECK(a0 != a7);
  CHECK(a1 != a7);
  CHECK(a0 != b0);
  CHECK(a1 != b0);
  for (int i = 0; i < 100; ++i) a0[i] = static_cast<float>(i);
  b0[0] = -1.0f;
  a1[0] = -2.0f;
  CHECK(a0[0] == 0.0f);  // the other buffers' writes do not land in a0

  // Asking again for no more than it holds returns the same buffer, contents kept.
  CHECK(host_scratch_floats<first_kernel, 0>(50) == a0);
  CHECK(a0[99] == 99.0f);

  // Asking for more grows it: the whole of the new size is writable (ASan checks).
  float* grown = host_scratch_floats<first_kernel, 0>(1 << 20);
  grown[(1 << 20) - 1] = 1.0f;
  CHECK(host_scratch_floats<first_kernel, 0>(1) == grown);

  // Another thread gets its own buffer for the same tag and slot.
  float* other = nullptr;
  std::thread([&] { other = host_scratch_floats<first_kernel, 0>(100); }).join();
  CHECK(other != grown);
}

TEST_CASE("host scratch: float data as floats, 16-bit data widened exactly", "[host_scratch]") {
  using mpx::detail::host_floats_of;
  std::vector<float> const f{1.0f, -2.5f, 3.0e-8f};
  CHECK(host_floats_of<first_kernel, 3>(f.data(), f.size()) == f.data());  // no copy

  // Awkward length (not a multiple of the eight-wide F16C step), with a NaN, an infinity,
  // a subnormal and the largest finite value in the second group of eight.
  std::vector<mpx::half> h;
  std::vector<float> expected;
  for (int i = 0; i < 19; ++i) expected.push_back(static_cast<float>(i) * 0.375f - 3.0f);
  expected[9] = std::numeric_limits<float>::infinity();
  expected[10] = 65504.0f;
  expected[11] = 0x1p-24f;
  for (float v : expected) h.push_back(mpx::cast<mpx::half>(v));
  h[12] = mpx::cast<mpx::half>(std::numeric_limits<float>::quiet_NaN());
  float const* widened = host_floats_of<first_kernel, 3>(h.data(), h.size());
  CHECK(widened != nullptr);
  for (std::size_t i = 0; i < h.size(); ++i) {
    if (i == 12) {
      CHECK(std::isnan(widened[i]));
    } else {
      CHECK(widened[i] == expected[i]);
    }
  }
  // The scratch it widened into is the (tag, slot) buffer.
  CHECK(widened == mpx::detail::host_scratch_floats<first_kernel, 3>(1));

  std::vector<mpx::bfloat16> bf{mpx::cast<mpx::bfloat16>(-1.5f), mpx::cast<mpx::bfloat16>(0x1p-130f)};
  float const* bw = host_floats_of<second_kernel, 1>(bf.data(), bf.size());
  CHECK(bw[0] == -1.5f);
  CHECK(bw[1] == 0x1p-130f);
}

// The bookkeeping behind cuBLASLt's per-stream workspaces (detail::stream_registry),
// with ints for workspaces: a capture finds a stream's resource by its handle; a handle
// that comes back for a new stream (the old one destroyed) hands the old resource over
// instead of keeping it forever; forget() returns what a stream held.
TEST_CASE("stream registry: resources by stream id, found by handle during a capture", "[host_scratch][streams]") {
  using key = mpx::detail::stream_handle_key;
  mpx::detail::stream_registry<int> registry;
  key const a{0, 0x1000, {}}, b{0, 0x2000, {}};
  auto first = registry.use(a, 11);
  CHECK(first.resource == nullptr);  // cold: the caller makes one
  CHECK(registry.captured(b) == nullptr);
  registry.put(0, 11, 110);
  REQUIRE(registry.captured(a) != nullptr);
  CHECK(*registry.captured(a) == 110);
  auto again = registry.use(a, 11);
  REQUIRE(again.resource != nullptr);
  CHECK(*again.resource == 110);
  CHECK_FALSE(again.inherited);
  CHECK(again.retired.empty());
  registry.use(b, 12);
  registry.put(0, 12, 120);
  CHECK(registry.size() == 2);
  // The same handle on another device is another stream.
  CHECK(registry.captured(key{1, 0x1000, {}}) == nullptr);

  // Forgotten before its destruction: gone, and a capture on the handle is cold again.
  auto const freed = registry.forget(11);
  REQUIRE(freed.size() == 1);
  CHECK(freed[0] == std::pair{0, 110});
  CHECK(registry.captured(a) == nullptr);
  CHECK(registry.size() == 1);
  CHECK(registry.clear() == std::vector<std::pair<int, int>>{{0, 120}});
  CHECK(registry.size() == 0);
  CHECK(registry.captured(b) == nullptr);
}

TEST_CASE("stream registry: a destroyed stream's handle, back for a new stream, hands its resource over",
          "[host_scratch][streams]") {
  using key = mpx::detail::stream_handle_key;
  mpx::detail::stream_registry<int> registry;
  key const h{0, 0x1000, {}};
  registry.use(h, 1);
  registry.put(0, 1, 100);
  // Stream 1 is destroyed without forget(); stream 2 gets the same handle. Eager use
  // sees the new id: the old resource passes to stream 2 (wait first), nothing leaks.
  auto const taken = registry.use(h, 2);
  REQUIRE(taken.resource != nullptr);
  CHECK(*taken.resource == 100);
  CHECK(taken.inherited);
  CHECK(registry.size() == 1);
  CHECK(*registry.captured(h) == 100);
  CHECK(registry.forget(1).empty());  // the dead id holds nothing any more
  CHECK(registry.forget(2) == std::vector<std::pair<int, int>>{{0, 100}});

  // The new stream already has a resource (it ran under another handle key, as the
  // per-thread stream does under two handles): the dead one's is retired, to be freed.
  key const per_thread_null{0, 0, std::this_thread::get_id()};
  registry.use(h, 3);
  registry.put(0, 3, 300);
  registry.use(per_thread_null, 4);
  registry.put(0, 4, 400);
  auto const retired = registry.use(h, 4);  // stream 3 destroyed; its handle now names stream 4
  REQUIRE(retired.resource != nullptr);
  CHECK(*retired.resource == 400);
  CHECK_FALSE(retired.inherited);
  CHECK(retired.retired == std::vector<int>{300});
  CHECK(registry.size() == 1);

  // An id that another key still names (the legacy stream, one id under every thread's
  // null handle) is alive: a key moving on does not take its resource.
  mpx::detail::stream_registry<int> shared;
  key const thread_a{0, 0, std::thread::id{}}, thread_b{0, 0, std::this_thread::get_id()};
  shared.use(thread_a, 7);
  shared.use(thread_b, 7);
  shared.put(0, 7, 700);
  auto const moved = shared.use(thread_b, 8);
  CHECK(moved.resource == nullptr);
  CHECK_FALSE(moved.inherited);
  CHECK(moved.retired.empty());
  CHECK(*shared.captured(thread_a) == 700);
  CHECK(shared.captured(thread_b) == nullptr);
}
